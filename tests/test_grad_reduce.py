"""Gradients summed over dp in the low format or in fp32 (--grad-reduce-dtype;
distributed/wire.py, docs/07-numbers.md): the bytes of every ZeRO stage and of HSDP's
replica all-reduce against the chapter's formula, parameters gathered at 2 bytes, the
rounding of a low-format sum, and fp32 runs unchanged."""

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from numpitron.distributed.sharding import pad_to_multiple
from numpitron.distributed.topology import Topology
from numpitron.errors import UserError
from numpitron.optim.memory_report import memory_bytes
from tests.harness import assert_on_every_rank, make_trainer, tiny_model, tiny_tokens, tiny_train

BF16 = np.dtype(ml_dtypes.bfloat16)
F64 = 8          # the loss and the squared norm travel as one float64
WIRE = {"fp32": 4, "param": 2}     # bytes a gradient element travels in, under bf16


def second_step_bytes(trainer) -> dict:
    """{collective: bytes} of one step after a first (ZeRO-3 gathers afresh every step)."""
    tokens = tiny_tokens()
    trainer.train_step(tokens)
    trainer.topo.stats.reset()
    trainer.train_step(tokens)
    return {k: v["bytes"] for k, v in trainer.topo.stats.snapshot().items()}


def expected_dp2_bytes(trainer, stage: int, wire: int) -> dict:
    """What the chapter's formula says two dp ranks move, summed over both (ZeRO-3 cuts
    layers where the slices fall, so one rank's share alone is uneven): gradients of N
    elements at `wire` bytes, parameters at 2. Stage 0: one all-reduce, 2 (k-1)/k w N a
    rank; stages 1 and 2: a reduce-scatter of the gradients and an all-gather of the
    parameters, (k-1)/k N each; stage 3 with m micro-batches and a root of R elements:
    all-gathers of N + (2m - 1)(N - R), reduce-scatters of R + m (N - R)."""
    n, k, m = trainer.model.store.size, 2, trainer.num_microbatches
    if stage == 0:
        return {"dp_cp.all_reduce": k * (2 * (k - 1) / k * (wire * n + F64))}
    if stage in (1, 2):
        return {"dp_shard.reduce_scatter": (k - 1) * wire * n, "dp_shard.all_gather": (k - 1) * 2 * n}
    root = trainer.optimizer.gatherer.units[-1].nelements
    return {"dp_shard.reduce_scatter": (k - 1) * wire * (root + m * (n - root)),
            "dp_shard.all_gather": (k - 1) * 2 * (n + (2 * m - 1) * (n - root))}


@pytest.mark.parallel(nprocs=2)
def test_bf16_gradients_travel_in_2_or_4_bytes_and_parameters_in_2_on_every_zero_stage():
    checks = {}
    for stage in (0, 1, 2, 3):
        kept = {}
        for reduce_dtype, wire in WIRE.items():
            trainer = make_trainer(tiny_model("float32"), tiny_train(precision="bf16", grad_reduce_dtype=reduce_dtype),
                                   data=2, zero_stage=stage, bucket_size=3000)
            moved = second_step_bytes(trainer)
            for kind, expected in expected_dp2_bytes(trainer, stage, wire).items():
                checks[f"stage {stage} {reduce_dtype} {kind}"] = (MPI.COMM_WORLD.allreduce(moved[kind]), expected)
            kept[reduce_dtype] = memory_bytes(trainer.optimizer)
        # The wire is a copy made per bucket: what a rank keeps (test_precision.py: 2 + 2 + 12) stays.
        checks[f"stage {stage} the same model state either way"] = (kept["param"], kept["fp32"])
    assert_on_every_rank(checks)


@pytest.mark.parallel(nprocs=2)
def test_two_ranks_sum_the_same_in_either_dtype_and_fp32_runs_are_unchanged():
    """Over two ranks a low-format sum rounds once, as the fp32 sum rounded into the
    gradient buffer does: the two reduce dtypes give one trajectory bit for bit. An fp32
    run ignores the flag: its gradients travel as they are, 4 bytes."""
    runs = {}
    for reduce_dtype in WIRE:
        trainer = make_trainer(tiny_model("float32"), tiny_train(precision="bf16", grad_reduce_dtype=reduce_dtype),
                               data=2, zero_stage=2, bucket_size=3000)
        runs[reduce_dtype] = ([trainer.train_step(tiny_tokens())["train_loss"] for _ in range(3)],
                              trainer.optimizer.state.whole("params").copy())
    fp32 = {}
    for reduce_dtype in WIRE:
        trainer = make_trainer(tiny_model("float32"), tiny_train(grad_reduce_dtype=reduce_dtype), data=2)
        moved = second_step_bytes(trainer)
        fp32[reduce_dtype] = (moved["dp_cp.all_reduce"], trainer.optimizer.state.whole("params").copy())
    n = trainer.model.store.size
    assert_on_every_rank({
        "bf16 losses": (runs["param"][0], runs["fp32"][0]),
        "bf16 master weights": np.array_equal(runs["param"][1], runs["fp32"][1]),
        "fp32 bytes": (fp32["param"][0], fp32["fp32"][0]),
        "fp32 is 4 bytes": (fp32["fp32"][0], 2 * 1 / 2 * (4 * n + F64)),
        "fp32 params": np.array_equal(fp32["param"][1], fp32["fp32"][1]),
    })


@pytest.mark.parallel(nprocs=4)
def test_a_low_format_sum_over_four_ranks_rounds_at_every_addition_and_fp32_once():
    """Why fp32 reduction exists: four ranks' bf16 values summed in fp32 and rounded once
    err by at most half an ulp of the sum (fp32's own rounding of four 8-bit numbers is
    far below it); summed in bf16 each of the three additions rounds, so the error grows
    with the number of ranks: up to 3 eps/2 of the sum of magnitudes, measurably more."""
    topo = Topology.from_world(data=4)
    rng = np.random.default_rng(topo.rank)
    mine = rng.normal(size=4000).astype(BF16).astype(np.float32)
    every = np.array(MPI.COMM_WORLD.allgather(mine), np.float64)
    exact, magnitude = every.sum(axis=0), np.abs(every).sum(axis=0)
    eps = float(ml_dtypes.finfo(BF16).eps)
    in_fp32, in_bf16 = mine.copy(), mine.copy()
    topo.dp_cp_comm.all_reduce(in_fp32)
    in_fp32 = in_fp32.astype(BF16).astype(np.float64)        # where it lands: the bf16 gradient buffer
    topo.dp_cp_comm.all_reduce(in_bf16, wire=BF16)
    err_fp32, err_bf16 = np.abs(in_fp32 - exact), np.abs(in_bf16 - exact)
    assert_on_every_rank({
        "fp32: one rounding": bool(np.all(err_fp32 <= eps / 2 * np.abs(exact) + 2.0 ** -23 * magnitude)),
        "bf16: three roundings at most": bool(np.all(err_bf16 <= 3 * eps / 2 * magnitude)),
        "bf16 errs more": float(err_bf16.mean()) > 1.5 * float(err_fp32.mean()),
        "bf16 result is bf16": np.array_equal(in_bf16, in_bf16.astype(BF16).astype(np.float64)),
        "same on every rank": MPI.COMM_WORLD.allreduce(float(in_bf16.sum()), op=MPI.MAX) == float(in_bf16.sum()),
        "2 bytes an element": (topo.stats.bytes["dp_cp.all_reduce"], 2 * 3 / 4 * (4 + 2) * mine.size),
    })


@pytest.mark.parallel(nprocs=4)
def test_hsdp_replicas_all_reduce_the_slice_in_the_gradients_format():
    """dp = 4, S = 2: the replica group (2 ranks) all-reduces each rank's 1/S slice of N
    gradient elements, 2 (h-1)/h w N/S bytes, at w = 2 or 4; the shard group gathers
    the parameters at 2 bytes."""
    checks = {}
    for stage in (2, 3):
        for reduce_dtype, wire in WIRE.items():
            trainer = make_trainer(tiny_model("float32"), tiny_train(precision="bf16", grad_reduce_dtype=reduce_dtype),
                                   data=4, data_shard=2, zero_stage=stage)
            moved = second_step_bytes(trainer)
            n = pad_to_multiple(trainer.model.store.numel, 2)
            checks[f"stage {stage} {reduce_dtype} replicas"] = (moved["dp_replica.all_reduce"], 2 * 1 / 2 * wire * n // 2)
            if stage == 2:
                checks[f"stage 2 {reduce_dtype} params gathered at 2 bytes"] = (moved["dp_shard.all_gather"], 1 / 2 * 2 * n)
    assert_on_every_rank(checks)


def test_an_unknown_reduce_dtype_is_one_line():
    with pytest.raises(UserError, match="unknown --grad-reduce-dtype 'bf16'; choose one of fp32, param") as error:
        tiny_train(precision="bf16", grad_reduce_dtype="bf16")
    assert "\n" not in str(error.value)
