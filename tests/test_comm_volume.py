"""Bytes moved per training iteration, against formulas derived from the config.

Each test resets the topology's counters, runs one `train_step`, and compares the
snapshot ({"<group>.<kind>": {"bytes", "calls"}}) with what the strategy must move:
an all-reduce of b bytes over k ranks counts 2(k-1)/k * b, a reduce-scatter or an
all-gather (k-1)/k of the full buffer, a send its buffer. Besides the strategy's own
traffic, every iteration averages its loss over dp (1 float64 all-reduce), sends it
from the last stage to the others (1 float64 broadcast over pp), and sums the squared
gradient norm (1 float64 all-reduce over the model group, or the world under ZeRO-1);
collectives over a group of one rank count nothing.
All figures are all-gathered before asserting, so a failure never hangs the ranks.
"""

import math

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.distributed.sharding import pad_to_multiple
from tests.harness import assert_on_every_rank, identical_over, make_trainer as harness_trainer, tiny_model
from tests.harness import tiny_tokens, tiny_train

F64 = 8          # the loss and the squared norm travel as one float64


def all_reduce_bytes(nbytes, k):
    return 2 * (k - 1) / k * nbytes


def make_trainer(dtype="float64", train=None, **mesh):
    return harness_trainer(tiny_model(dtype), train or tiny_train(), **mesh)


def one_step(trainer, tokens):
    trainer.topo.stats.reset()
    trainer.train_step(tokens)
    return trainer.topo.stats.snapshot()


def measured(snap, key, field="bytes"):
    return snap.get(key, {}).get(field, 0)


@pytest.mark.parallel(nprocs=2)
def test_data_parallel_zero0_and_zero1_volume():
    tokens, bucket = tiny_tokens(), 10000
    zero0 = make_trainer(data=2, bucket_size=bucket)
    store, item, k = zero0.model.store, zero0.model.dtype.itemsize, 2
    snap = one_step(zero0, tokens)
    grad_bytes = all_reduce_bytes(store.size * item, k)
    buckets = len(zero0.optimizer.buckets.buckets)
    checks = {
        "zero0 dp_cp.all_reduce bytes": (measured(snap, "dp_cp.all_reduce"), grad_bytes + all_reduce_bytes(F64, k)),
        "zero0 dp_cp.all_reduce calls": (measured(snap, "dp_cp.all_reduce", "calls"), buckets + 1),
        "zero0 several buckets": (buckets > 1, True),
        "zero0 kinds": (sorted(snap), ["dp_cp.all_reduce"]),
        "zero0 state": (zero0.optimizer.adam.state_nbytes, 2 * store.size * item),
    }

    zero1 = make_trainer(data=2, zero_stage=1, bucket_size=bucket)
    store1 = zero1.model.store
    checks["zero1 store padded to dp"] = (store1.size, pad_to_multiple(store.numel, k))
    checks["zero1 state"] = (zero1.optimizer.adam.state_nbytes, math.ceil(store1.size / k) * 2 * item)
    for step in range(3):
        snap = one_step(zero1, tokens)
        rs, ag = measured(snap, "dp_cp.reduce_scatter"), measured(snap, "dp_cp.all_gather")
        if step == 0:
            checks.update({
                "zero1 reduce_scatter": (rs, (k - 1) / k * store1.size * item),
                "zero1 all_gather": (ag, (k - 1) / k * store1.size * item),
                "zero1 rs + ag == zero0 all_reduce": (rs + ag, all_reduce_bytes(store1.size * item, k)),
                "zero1 same store as zero0": (store1.size, store.size),
                "zero1 loss all_reduce": (measured(snap, "dp_cp.all_reduce"), all_reduce_bytes(F64, k)),
                "zero1 norm over world": (measured(snap, "world.all_reduce"), all_reduce_bytes(F64, k)),
                "zero1 kinds": (sorted(snap), ["dp_cp.all_gather", "dp_cp.all_reduce", "dp_cp.reduce_scatter",
                                               "world.all_reduce"]),
            })
        checks[f"zero1 params identical over dp after step {step + 1}"] = (
            identical_over(zero1.topo.dp_comm, store1.data), True)
    assert_on_every_rank(checks)


@pytest.mark.parallel(nprocs=2)
def test_tensor_parallel_bytes_match_the_formula_in_both_dtypes():
    checks = {}
    for dtype in ("float64", "float32"):
        trainer = make_trainer(dtype, tensor=2)
        cfg, m, k = trainer.model_cfg, trainer.num_microbatches, 2
        item = np.dtype(dtype).itemsize
        n_tokens = trainer.train_cfg.micro_batch_size * cfg.seq_len
        activation = n_tokens * cfg.d_model * item
        # per micro-batch: embedding forward 1, per block 2 forward ("g": attention and
        # MLP output) + 2 backward ("f": qkv and fc input), head backward 1: each (N, C);
        # cross-entropy: max, target logit and sum of exponentials, N values each.
        per_mb = (1 + 4 * cfg.n_layers + 1) * activation + 3 * n_tokens * item
        calls_per_mb = 1 + 4 * cfg.n_layers + 1 + 3
        snap = one_step(trainer, tiny_tokens())
        checks.update({
            f"{dtype} micro-batches": (m, 4),
            f"{dtype} tp.all_reduce bytes": (measured(snap, "tp.all_reduce"), m * all_reduce_bytes(per_mb, k)),
            f"{dtype} tp.all_reduce calls": (measured(snap, "tp.all_reduce", "calls"), m * calls_per_mb),
            f"{dtype} grad norm": (measured(snap, "model.all_reduce"), all_reduce_bytes(F64, k)),
            f"{dtype} kinds": (sorted(snap), ["model.all_reduce", "tp.all_reduce"]),
        })
    assert_on_every_rank(checks)


def pipeline_checks(trainer, snap, label):
    """Send/recv, tied-embedding and control traffic of one pipeline iteration."""
    topo, cfg, m = trainer.topo, trainer.model_cfg, trainer.num_microbatches
    P, s, item, v = topo.pp, topo.pp_rank, trainer.model.dtype.itemsize, trainer.model.virtual_stages
    activation = trainer.train_cfg.micro_batch_size * cfg.seq_len * cfg.d_model * item
    # activations forward, gradients backward; interleaved, every chunk sends both but
    # the first virtual stage's gradient and the last one's activations
    sends = 2 * v - (s == 0) - (s == P - 1)
    ends = s in (0, P - 1)
    vocab = pad_to_multiple(cfg.vocab_size, topo.tp)
    return {
        f"{label} pp.send": (measured(snap, "pp.send"), m * sends * activation),
        f"{label} pp.recv": (measured(snap, "pp.recv"), m * sends * activation),
        f"{label} embedding.all_reduce": (measured(snap, "embedding.all_reduce"),
                                          all_reduce_bytes(vocab * cfg.d_model * item, 2) if ends else 0),
        f"{label} loss broadcast": (measured(snap, "pp.broadcast"), F64),
        f"{label} grad norm": (measured(snap, "model.all_reduce"), all_reduce_bytes(F64, P)),
    }


def peak_expected(schedule, m, P, stage, v=1):
    """(micro-batch, chunk) pairs in flight: all of them (GPipe), P - stage (1F1B), P on
    every stage (ZB-H1: caches live until W), (v-1)P + P - stage chunks (interleaved)."""
    return {"gpipe": m, "1f1b": min(P - stage, m), "zero-bubble": min(P, m),
            "interleaved": min((v - 1) * P + P - stage, m * v)}[schedule]


@pytest.mark.parallel(nprocs=2)
def test_pipeline_two_stages_volume_peak_and_tied_embedding():
    checks, tokens = {}, tiny_tokens()
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1), ("interleaved", 2)):
        trainer = make_trainer(pipeline=2, schedule=schedule, virtual_stages=v)
        topo, m = trainer.topo, trainer.num_microbatches
        checks[f"{schedule} m"] = (m, 4)
        for step in range(3):
            snap = one_step(trainer, tokens)
            if step == 0:
                checks.update(pipeline_checks(trainer, snap, schedule))
                checks[f"{schedule} peak"] = (trainer.last_pipeline_stats.peak_in_flight,
                                              peak_expected(schedule, m, topo.pp, topo.pp_rank, v))
            weight = trainer.model.token_embedding.weight.data
            checks[f"{schedule} tied copies equal after step {step + 1}"] = (
                identical_over(topo.embedding_comm, weight), True)
    assert_on_every_rank(checks)


@pytest.mark.parallel(nprocs=4)
def test_pipeline_four_stages_peak_in_flight():
    checks, tokens = {}, tiny_tokens()
    for schedule, global_batch in (("1f1b", 8), ("1f1b", 4), ("gpipe", 8), ("zero-bubble", 8), ("zero-bubble", 4)):
        trainer = make_trainer(pipeline=4, schedule=schedule, train=tiny_train(global_batch_size=global_batch))
        topo, m = trainer.topo, trainer.num_microbatches
        label = f"{schedule} m={m}"
        checks[f"{label} m"] = (m, global_batch // trainer.train_cfg.micro_batch_size)
        for step in range(2):
            snap = one_step(trainer, tokens)
            checks[f"{label} peak step {step}"] = (trainer.last_pipeline_stats.peak_in_flight,
                                                   peak_expected(schedule, m, topo.pp, topo.pp_rank))
        checks.update(pipeline_checks(trainer, snap, label))
        ends = topo.pp_rank in (0, topo.pp - 1)
        weight = trainer.model.token_embedding.weight.data if ends else None
        copies = MPI.COMM_WORLD.allgather(weight)
        ends_equal = np.array_equal(copies[0], copies[-1])
        checks[f"{label} tied copies equal"] = (ends_equal, True)
    assert_on_every_rank(checks)


def test_buckets_cover_the_buffer_along_parameter_boundaries_last_layer_first():
    trainer = make_trainer(bucket_size=3000)
    store, buckets = trainer.model.store, trainer.optimizer.buckets.buckets
    starts = {lo for lo, _ in store.offsets.values()}
    assert buckets[0][1] == store.size and buckets[-1][0] == 0
    assert all(hi == next_lo for (_, hi, _), (next_lo, _, _) in zip(buckets[1:], buckets))   # contiguous
    assert all(lo in starts for lo, _, _ in buckets)
    assert set().union(*(names for _, _, names in buckets)) == set(store.offsets)
    # the last block's parameters are in the first bucket, the embeddings in the last
    assert any(n.startswith(f"blocks.{trainer.model_cfg.n_layers - 1}.") for n in buckets[0][2])
    assert "embedding.token.weight" in buckets[-1][2]


@pytest.mark.parallel(nprocs=2)
def test_overlapped_buckets_start_during_the_backward():
    """With overlap, every bucket but the one holding the tied embedding is started
    inside the last micro-batch's backward; the optimizer then only waits."""
    checks, tokens = {}, tiny_tokens()
    for overlap in (True, False):
        trainer = make_trainer(data=2, bucket_size=3000, overlap_grad_reduce=overlap)
        buckets = trainer.optimizer.buckets
        started = []
        original = trainer.model.finalize_grads

        def finalize(grads_ready, original=original, buckets=buckets):
            started.append(len(buckets.pending))      # in flight before the tied embedding is final
            original(grads_ready)
        trainer.model.finalize_grads = finalize
        snap = one_step(trainer, tokens)
        n = len(buckets.buckets)
        checks[f"overlap={overlap} started in backward"] = (started[0], n - 1 if overlap else 0)
        checks[f"overlap={overlap} calls"] = (measured(snap, "dp_cp.all_reduce", "calls"), n + 1)
        checks[f"overlap={overlap} seconds counted"] = measured(snap, "dp_cp.all_reduce", "seconds") > 0
    assert_on_every_rank(checks)


@pytest.mark.parallel(nprocs=2)
def test_v_schedules_send_where_the_v_crosses_ranks_and_keep_one_embedding():
    """A V of p = 2 (rank 0: virtual stages 0 and 3, rank 1: 1 and 2) sends each
    micro-batch's activation and gradient across only where neighbouring stages sit on
    different ranks: two messages per rank, none at the bottom of the V (1 to 2). Both
    ends on rank 0: one token embedding, no all-reduce of it. In flight: 2p chunks
    (ZB-V, 1F1B's memory) or 2p + 1 (DualPipeV)."""
    checks, tokens = {}, tiny_tokens()
    for schedule, peak in (("zb-v", 4), ("dualpipev", 5)):
        trainer = make_trainer(pipeline=2, schedule=schedule)
        topo, cfg, m = trainer.topo, trainer.model_cfg, trainer.num_microbatches
        activation = trainer.train_cfg.micro_batch_size * cfg.seq_len * cfg.d_model * trainer.model.dtype.itemsize
        snap = one_step(trainer, tokens)
        checks.update({
            f"{schedule} pp.send": (measured(snap, "pp.send"), m * 2 * activation),
            f"{schedule} pp.recv": (measured(snap, "pp.recv"), m * 2 * activation),
            f"{schedule} embedding.all_reduce": (measured(snap, "embedding.all_reduce"), 0),
            f"{schedule} embedding here": (bool(trainer.model.tied), topo.pp_rank == 0),
            f"{schedule} loss broadcast": (measured(snap, "pp.broadcast"), F64),
            f"{schedule} peak": (trainer.last_pipeline_stats.peak_in_flight, peak)})
    assert_on_every_rank(checks)
