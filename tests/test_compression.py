"""Compressed gradients with error feedback (compression/, docs/18-across-slow-links.md),
in float64 on dp = 2: PowerSGD at full rank and error feedback around a lossless
compressor are plain data parallelism; int8 and low-rank PowerSGD keep the telescoping
identity; the counted bytes are the formula's; the residuals resume bit for bit."""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.checkpoint import load_checkpoint, save_checkpoint
from numpitron.compression.int8 import Lossless
from numpitron.errors import UserError
from tests.harness import (SMALLER, assert_close_on_every_rank, make_trainer, run, tiny_model, tiny_tokens,
                           tiny_train, train_steps)
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

MODEL = tiny_model(**SMALLER)
TRAIN = tiny_train()


def plain_dp(steps=6):
    return run(make_trainer(MODEL, TRAIN, data=2), steps)


def same_as_plain_dp(trainer, steps=6):
    losses, norms, params, _ = run(trainer, steps)
    ref_losses, ref_norms, ref_params, _ = plain_dp(steps)
    diffs = {"loss": rel_diff(losses, ref_losses), "norm": rel_diff(norms, ref_norms),
             "params": 0.0 if params is None else max(rel_diff(params[k], ref_params[k]) for k in params)}
    assert_close_on_every_rank(diffs, EQUIV_RTOL_FLOAT64)


@pytest.mark.parallel(nprocs=2)
def test_powersgd_at_full_rank_is_plain_data_parallelism():
    """Each matrix oriented short side first: at r = its short side P^ is square and
    orthogonal, P^ P^T = I, and the approximation is the mean gradient to rounding."""
    same_as_plain_dp(make_trainer(MODEL, TRAIN, data=2, grad_compression="powersgd", powersgd_rank=10_000))


@pytest.mark.parallel(nprocs=2)
def test_error_feedback_around_a_lossless_compressor_is_plain_data_parallelism():
    trainer = make_trainer(MODEL, TRAIN, data=2, grad_compression="int8")
    trainer.optimizer.compressor = Lossless()
    same_as_plain_dp(trainer)
    assert not trainer.optimizer.residual.any()


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("method", ["int8", "powersgd"])
def test_error_feedback_telescopes(method):
    """sum over steps of the reduced gradient + the mean residual = sum of the mean true
    gradient, while each step's reduced gradient is not the true one."""
    trainer = make_trainer(MODEL, TRAIN, data=2, grad_compression=method, powersgd_rank=2)
    opt, comm = trainer.optimizer, MPI.COMM_WORLD
    true, applied = [], []
    reduce = opt.reduce_grads

    def recording():
        mean = opt.store.grad.copy()
        comm.Allreduce(MPI.IN_PLACE, mean)
        true.append(mean / comm.size)
        reduce()
        applied.append(opt.store.grad.copy())
    opt.reduce_grads = recording
    run(trainer, 6)
    residual = opt.residual.copy()
    comm.Allreduce(MPI.IN_PLACE, residual)
    lhs, rhs = np.sum(applied, axis=0) + residual / comm.size, np.sum(true, axis=0)
    assert_close_on_every_rank({"telescoping": rel_diff(lhs, rhs)}, 1e-13)
    assert rel_diff(applied[-1], true[-1]) > 1e-4          # each step really was compressed


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("method", ["int8", "powersgd"])
def test_bytes_per_step_are_the_formula(method):
    trainer = make_trainer(MODEL, TRAIN, data=2, grad_compression=method, powersgd_rank=2)
    opt, stats = trainer.optimizer, trainer.topo.stats
    counted, reduce = [], opt.reduce_grads

    def measured():             # the gradients' reduction alone (the step also averages its loss: 8 bytes)
        before = sum(stats.bytes.values())
        reduce()
        counted.append(sum(stats.bytes.values()) - before)
    opt.reduce_grads = measured
    train_steps(trainer, 2)
    assert counted[0] == counted[1]
    sent = counted[1]
    store, p = opt.store, 2
    if method == "int8":
        pieces = len(store.params) + (store.size > max(hi for _, hi in store.offsets.values()))
        formula = (p - 1) * (store.size * 1 + pieces * 8)
    else:
        matrices = [(x.local_shape[0], int(np.prod(x.local_shape[1:]))) for x in store.params
                    if x.decay and len(x.local_shape) >= 2]        # qkv's weight is (C, 3, C): C x 3C
        shapes = [(min(n, m), max(n, m)) for n, m in matrices]
        vectors = store.size - sum(a * b for a, b in shapes)
        formula = 2 * (p - 1) / p * (sum((a + b) * min(2, a) for a, b in shapes) + vectors) * 8
    assert sent == formula == opt.compressor.bytes_per_step(store, p)
    plain = 2 * (p - 1) / p * store.size * 8
    assert sent < plain / 3


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("method", ["int8", "powersgd"])
def test_residuals_resume_bit_for_bit_on_the_same_mesh_only(method, shared_dir):
    options = dict(grad_compression=method, powersgd_rank=2)
    whole = make_trainer(MODEL, TRAIN, data=2, **options)
    expected = [whole.train_step(tiny_tokens())["train_loss"] for _ in range(6)]
    first = make_trainer(MODEL, TRAIN, data=2, **options)
    for _ in range(3):
        first.train_step(tiny_tokens())
    assert first.optimizer.residual.any()
    path = save_checkpoint(shared_dir / method, first)
    resumed = make_trainer(MODEL, TRAIN, data=2, **options)
    load_checkpoint(path, resumed)
    assert np.array_equal(resumed.optimizer.residual, first.optimizer.residual)
    assert [resumed.train_step(tiny_tokens())["train_loss"] for _ in range(3)] == expected[3:]
    assert np.array_equal(resumed.optimizer.store.data, whole.optimizer.store.data)
    with pytest.raises(UserError, match="same compression on the same mesh"):
        load_checkpoint(path, make_trainer(MODEL, TRAIN, tensor=2, **options))


@pytest.mark.parallel(nprocs=2)
def test_powersgd_at_full_rank_under_zero_1_is_plain_data_parallelism():
    """ZeRO-1 holds the whole gradient until it reduces: the compressed mean replaces its
    reduce-scatter and each rank keeps its slice of it."""
    same_as_plain_dp(make_trainer(MODEL, TRAIN, data=2, zero_stage=1, grad_compression="powersgd",
                                  powersgd_rank=10_000))


@pytest.mark.parallel(nprocs=2)
def test_int8_under_zero_1_equals_int8_without_it():
    """The same compressed means (ZeRO's padding is one more piece, all zeros), applied
    slice by slice: losses and parameters to 1e-10, and the residual is the same."""
    losses, _, params, plain = run(make_trainer(MODEL, TRAIN, data=2, grad_compression="int8"), 6)
    z_losses, _, z_params, zero = run(make_trainer(MODEL, TRAIN, data=2, zero_stage=1, grad_compression="int8"), 6)
    n = plain.optimizer.store.size
    diffs = {"loss": rel_diff(z_losses, losses),
             "residual": rel_diff(zero.optimizer.residual[:n], plain.optimizer.residual),
             "params": 0.0 if params is None else max(rel_diff(z_params[k], params[k]) for k in params)}
    assert_close_on_every_rank(diffs, EQUIV_RTOL_FLOAT64)
    assert plain.optimizer.residual.any()


@pytest.mark.parametrize("flags", [dict(zero_stage=2), dict(hierarchical_all_reduce=True, data_shard=1)])
def test_other_data_parallel_optimizers_are_refused(flags):
    with pytest.raises(UserError, match="data parallelism in fp32"):
        make_trainer(MODEL, TRAIN, grad_compression="int8", **flags)
