"""The planner prices training across slow links (plan/slow_links.py) as a real run
counts it, to the byte, on dp = 2: DiLoCo's outer all-reduce amortised over its round,
and int8 and PowerSGD gradients in place of plain data parallelism's all-reduce."""

import pytest
from mpi4py import MPI

from numpitron.distributed.topology import Mesh
from numpitron.plan.accounting import Rank
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
@pytest.mark.parametrize("compression", [dict(grad_compression="int8"),
                                         dict(grad_compression="powersgd", powersgd_rank=2),
                                         dict(grad_compression="powersgd", powersgd_rank=10_000)])
def test_planned_compressed_gradient_bytes_equal_a_steps_counts(compression):
    train = tiny_train()
    trainer = make_trainer(MODEL, train, data=2, **compression)
    measured = bytes_per_iteration(trainer, 1)
    planned = comm_bytes(MODEL, trainer.parallel_cfg, train, Rank.of(trainer.topo, trainer.parallel_cfg))
    expected = trainer.optimizer.compressor.bytes_per_step(trainer.optimizer.store, 2)
    loss = 8 if compression["grad_compression"] == "powersgd" else 0      # the loss is all-reduced too
    assert planned[next(k for k in planned if k.startswith("dp_cp.all_"))] == expected + loss
    assert_on_every_rank({"comm": (measured, planned)})
