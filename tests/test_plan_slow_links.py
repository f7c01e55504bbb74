"""The planner prices training across slow links (plan/slow_links.py) as a real run
counts it, to the byte, on dp = 2: DiLoCo's outer all-reduce amortised over its round,
and int8 and PowerSGD gradients in place of plain data parallelism's all-reduce."""

import pytest
from mpi4py import MPI

from numpitron.distributed.topology import Mesh
from numpitron.plan.accounting import Rank
from numpitron.plan.slow_links import diloco_state_bytes, hidden_outer_seconds
from numpitron.plan.traffic import comm_bytes
from tests.harness import SMALLER, assert_on_every_rank, make_trainer, tiny_model, tiny_tokens, tiny_train
from tests.test_diloco import diloco_trainer

MODEL = tiny_model(**SMALLER)


def bytes_per_iteration(trainer, steps: int) -> dict:
    trainer.topo.stats.reset()
    for _ in range(steps):
        trainer.train_step(tiny_tokens())
    return {kind: entry["bytes"] / steps for kind, entry in trainer.topo.stats.snapshot().items() if entry["bytes"]}


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("inner_steps", [1, 3])
def test_planned_diloco_bytes_per_iteration_equal_a_rounds_counts(inner_steps):
    train = tiny_train(diloco_replicas=2, diloco_inner_steps=inner_steps)
    trainer = diloco_trainer(train, Mesh(1, 1, 2))
    measured = bytes_per_iteration(trainer, inner_steps)       # one whole round
    planned = comm_bytes(MODEL, trainer.parallel_cfg, train, Rank(1, 1, 2, 1, dp_rank=MPI.COMM_WORLD.rank))
    store = trainer.optimizer.store
    assert planned["diloco.all_reduce"] == store.size * store.dtype.itemsize / inner_steps    # 2 (R-1)/R = 1
    assert_on_every_rank({"comm": (measured, planned)})


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("streaming", [dict(diloco_fragments=2, diloco_overlap_steps=1),
                                       dict(diloco_fragments=3, diloco_outer_dtype="bf16"),
                                       dict(diloco_fragments=2, diloco_outer_dtype="int8"),
                                       dict(diloco_fragments=2, diloco_outer_dtype="int4", diloco_overlap_steps=3)],
                         ids=["fp32-tau1", "bf16", "int8", "int4-tau3"])
def test_planned_streaming_bytes_and_buffers_equal_a_runs(streaming):
    """A round of streaming DiLoCo (H = 4) moves what the planner says per iteration, in
    its outer dtype; its buffers (θ_start, momentum, and the mean in flight when τ > 0)
    are the planner's bytes."""
    train = tiny_train(diloco_replicas=2, diloco_inner_steps=4, max_iters=20, **streaming)
    trainer = diloco_trainer(train, Mesh(1, 1, 2))
    trainer.train_step(tiny_tokens())               # a step in: the round counted below wraps around
    measured = bytes_per_iteration(trainer, 4)
    rank = Rank(1, 1, 2, 1, dp_rank=MPI.COMM_WORLD.rank)
    planned = comm_bytes(MODEL, trainer.parallel_cfg, train, rank)
    buffers = sum(buf.nbytes for buf in trainer.optimizer.adam.buffers())
    assert diloco_state_bytes(MODEL, trainer.parallel_cfg, train, rank) == {"diloco": buffers}
    assert_on_every_rank({"comm": (measured, planned)})


def test_overlap_hides_at_most_the_exchange_and_tau_steps_of_compute():
    """F exchanges a round of H steps, each outer_seconds H / F long, behind τ steps."""
    train = tiny_train(diloco_replicas=2, diloco_inner_steps=10, diloco_fragments=5, diloco_overlap_steps=2)
    assert hidden_outer_seconds(train, 1.0, 10.0) == 1.0                   # all of it: the link is fast enough
    assert hidden_outer_seconds(train, 1.0, 0.1) == 5 / 10 * 2 * 0.1       # τ steps' worth per exchange
    assert hidden_outer_seconds(tiny_train(diloco_replicas=2, diloco_inner_steps=10), 1.0, 10.0) == 0.0


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("compression", [dict(grad_compression="int8"),
                                         dict(grad_compression="powersgd", powersgd_rank=2),
                                         dict(grad_compression="powersgd", powersgd_rank=10_000),
                                         dict(grad_compression="int8", zero_stage=1),
                                         dict(grad_compression="powersgd", powersgd_rank=2, zero_stage=1)])
def test_planned_compressed_gradient_bytes_equal_a_steps_counts(compression):
    train = tiny_train()
    trainer = make_trainer(MODEL, train, data=2, **compression)
    measured = bytes_per_iteration(trainer, 1)
    planned = comm_bytes(MODEL, trainer.parallel_cfg, train, Rank.of(trainer.topo, trainer.parallel_cfg))
    expected = trainer.optimizer.compressor.bytes_per_step(trainer.optimizer.store, 2)
    loss = 8 if compression["grad_compression"] == "powersgd" else 0      # the loss is all-reduced too
    assert planned[next(k for k in planned if k.startswith("dp_cp.all_"))] == expected + loss
    assert_on_every_rank({"comm": (measured, planned)})


def test_the_planned_step_hides_the_outer_exchange_behind_tau_steps():
    """dp = 4 on two hosts of two, replicas across a slow inter-host link: DiLoCo's outer
    all-reduce adds its amortised seconds to a step; streaming with τ = 2 hides what τ
    steps of compute cover, down to plain training inside a replica when they cover it."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    cpu = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=1e9, inter_bandwidth=1e5,
                  intra_latency=0.0, inter_latency=0.0, cores_per_node=0)
    model, parallel = ModelConfig(n_layers=2), ParallelConfig()

    def step(inter_bandwidth, **diloco):
        train = TrainConfig(micro_batch_size=2, global_batch_size=8, diloco_replicas=2, diloco_inner_steps=10, **diloco)
        return plan(model, parallel, train, (1, 1, 4, 1), replace(cpu, inter_bandwidth=inter_bandwidth))["step_s"]
    free = step(1e30)
    blocking, streamed = step(1e5), step(1e5, diloco_fragments=5, diloco_overlap_steps=2)
    assert free < streamed < blocking
    assert step(1e30, diloco_fragments=5, diloco_overlap_steps=2) == pytest.approx(free)
