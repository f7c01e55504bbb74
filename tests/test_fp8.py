"""FP8 matmuls (numpitron/precision/fp8.py; docs/07-numbers.md): the casts' bounds, the product
against the plain one, a tiny model training in fp8, its amax agreement and its
trajectory on dp = 2 and tp = 2 against one process, checkpointed histories, bad input."""

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from numpitron.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from numpitron.distributed.topology import Topology
from numpitron.errors import UserError
from numpitron.nn.matmul import PLAIN
from numpitron.precision.fp8 import E4M3, E5M2, DelayedScaling, Fp8Matmul, linear_layers, quantize, scales_from
from numpitron.precision.formats import check_precision
from tests.harness import (assert_on_every_rank, error_lines, make_trainer, run, run_script, tiny_model, tiny_train,
                           train_steps)

BF16_EPS = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)          # 2^-7
# A sequence a tiny model learns in a few steps (random tokens stay at log 65).
LEARNABLE = (np.arange(6000) * 7 % 23).astype(np.uint16)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_a_cast_errs_by_half_an_epsilon_in_range_half_a_subnormal_below_and_saturates_above(fmt):
    info = ml_dtypes.finfo(fmt)
    x = (np.random.default_rng(0).normal(size=20000) * 10.0 ** np.random.default_rng(1).uniform(-12, 1, 20000))
    x = x.astype(np.float32)
    amax = np.abs(x).max()
    scale = float(scales_from(np.array([[amax, amax, amax]], np.float32))[0, 0 if fmt == E4M3 else 2])
    assert np.log2(scale) == int(np.log2(scale)) and info.max / 2 < amax * scale <= info.max   # a power of two
    back = quantize(x, scale, fmt) / scale
    normal = np.abs(x) * scale >= float(info.tiny)
    assert normal.sum() > 1000 and (~normal).sum() > 1000
    assert np.all(np.abs(back - x)[normal] <= float(info.eps) / 2 * np.abs(x[normal]))
    assert np.all(np.abs(back - x)[~normal] <= float(info.smallest_subnormal) / 2 / scale)
    over = quantize(np.array([3 * amax, -3 * amax], np.float32), scale, fmt)
    assert np.array_equal(over, [info.max, -info.max])            # saturated, never inf or nan


def test_the_fp8_product_is_the_plain_product_of_the_dequantised_operands_bit_for_bit():
    rng = np.random.default_rng(2)
    x, w, dy = (rng.normal(size=s).astype(np.float32) * m for s, m in [((24, 16), 3.0), ((16, 8), 0.02),
                                                                        ((24, 8), 1e-4)])
    scaling = DelayedScaling(["fc"], Topology.serial().world)
    fp8 = Fp8Matmul(scaling, 0)
    calibrating = [fp8.forward(x, w), fp8.input_grad(dy, w), fp8.weight_grad(x, dy)]
    plain = [PLAIN.forward(x, w), PLAIN.input_grad(dy, w), PLAIN.weight_grad(x, dy)]
    assert all(np.array_equal(a, b) for a, b in zip(calibrating, plain))          # no history yet: no cast
    scaling.end_step()
    q = {name: quantize(a, float(scaling.scale[0, role]), fmt) / scaling.scale[0, role]
         for name, a, role, fmt in [("x", x, 0, E4M3), ("w", w, 1, E4M3), ("dy", dy, 2, E5M2)]}
    assert not np.array_equal(q["w"], w)
    np.testing.assert_array_equal(fp8.forward(x, w), q["x"] @ q["w"])
    np.testing.assert_array_equal(fp8.input_grad(dy, w), q["dy"] @ q["w"].T)
    np.testing.assert_array_equal(fp8.weight_grad(x, dy), q["x"].T @ q["dy"])


def test_a_tiny_model_trains_in_fp8_close_to_bf16():
    fp8 = make_trainer(tiny_model("float32"), tiny_train(precision="fp8", max_iters=20), Topology.serial())
    losses = train_steps(fp8, 20, LEARNABLE)
    bf16 = train_steps(make_trainer(tiny_model("float32"), tiny_train(precision="bf16", max_iters=20),
                                    Topology.serial()), 20, LEARNABLE)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] / 2, losses
    assert abs(losses[-1] - bf16[-1]) < 0.1 * bf16[-1], (losses[-1], bf16[-1])
    linears = linear_layers(fp8.model)
    assert len(linears) == 4 * fp8.model_cfg.n_layers
    assert all(isinstance(layer.matmul, Fp8Matmul) for layer in linears.values())
    assert np.all(fp8.fp8.history[:, :, :20].max(axis=-1) > 0)          # every layer, every role, seen
    assert np.all(np.log2(fp8.fp8.scale) == np.round(np.log2(fp8.fp8.scale)))


# Two layouts in fp8 differ first as in bf16: fp32 sums in another order, which the
# rounding to bf16 absorbs or turns into one bf16 ulp. An fp8 cast of a value that moved
# by one bf16 ulp (relative 2^-7) lands on another fp8 value only when the move straddles
# an fp8 rounding boundary, one time in eps_fp8 / eps_bf16 (16 for E4M3, 32 for E5M2),
# and then moves it by one fp8 ulp, eps_fp8: on average the same eps_bf16 as in bf16,
# concentrated in fewer elements. The loss, a mean of smooth functions of them, differs
# by at most about eps_bf16 relative; a parameter, as any two AdamW runs from the same
# start, by at most 2 lr a step (an update is at most lr in size).
# The scales agree exactly after the first step: the weights are the same numbers on
# every layout, their amax (over the tp shards) is the same; a gradient's amax on dp = 2
# is 2x one process's (each rank weights its half of the micro-batches 1/2, not 1/4),
# so its scale is half, and the cast values are the same.
@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("mesh", [dict(data=2), dict(tensor=2)], ids=["dp2", "tp2"])
def test_fp8_layouts_agree_on_the_scales_and_equal_one_process_within_the_bound(mesh):
    model, train = tiny_model("float32"), tiny_train(precision="fp8")
    layout, serial = make_trainer(model, train, **mesh), make_trainer(model, train, Topology.serial())
    first = [trainer.train_step(LEARNABLE)["train_loss"] for trainer in (layout, serial)]
    mine, one = layout.fp8.history[:, :, 0], serial.fp8.history[:, :, 0]
    dp = mesh.get("data", 1)
    assert_on_every_rank({"weights' amax": (mine[:, 1].tolist(), one[:, 1].tolist()),
                          "gradients' amax": (mine[:, 2].tolist(), (dp * one[:, 2]).tolist()) if dp > 1 else True,
                          "inputs' amax": np.allclose(mine[:, 0], one[:, 0], rtol=BF16_EPS, atol=0)})
    losses, _, params, _ = run(layout, 9, LEARNABLE)
    ref_losses, _, ref_params, _ = run(serial, 9, LEARNABLE)
    loss_diff = np.max(np.abs(np.array([first[0], *losses]) - [first[1], *ref_losses]) / ref_losses.min())
    adam_bound = 2 * sum(serial.lr(t) for t in range(10))
    param_diff = max(np.max(np.abs(params[k] - ref_params[k])) for k in ref_params) \
        if MPI.COMM_WORLD.rank == 0 else 0.0
    assert_on_every_rank({"loss": loss_diff <= BF16_EPS,
                          "params": MPI.COMM_WORLD.bcast(param_diff, root=0) <= adam_bound})


# The histories are saved by layer name, the same on every rank: a tp = 2 run's load on
# dp = 2 with its scales, and continues as one uninterrupted process would (the bound
# above); a bf16 run's checkpoint holds none, and fp8 calibrates again after it.
@pytest.mark.parallel(nprocs=2)
def test_fp8_amax_histories_are_checkpointed_and_load_on_another_mesh(shared_dir):
    model, train = tiny_model("float32"), tiny_train(precision="fp8")
    expected = train_steps(make_trainer(model, train, Topology.serial()), 6, LEARNABLE)
    source = make_trainer(model, train, tensor=2)
    train_steps(source, 3, LEARNABLE)
    path = save_checkpoint(shared_dir, source)
    assert sorted(read_manifest(path)["fp8_amax_history"]) == source.fp8.names
    resumed = make_trainer(model, train, data=2)
    load_checkpoint(path, resumed)
    assert_on_every_rank({"history": (resumed.fp8.history.tolist(), source.fp8.history.tolist()),
                          "scales": (resumed.fp8.scale.tolist(), source.fp8.scale.tolist())})
    losses = train_steps(resumed, 3, LEARNABLE)
    assert_on_every_rank({"losses": np.max(np.abs(np.subtract(losses, expected[3:])) / min(expected)) <= BF16_EPS})
    bf16 = make_trainer(model, tiny_train(precision="bf16"), data=2)
    train_steps(bf16, 1, LEARNABLE)
    again = make_trainer(model, train, data=2)
    load_checkpoint(save_checkpoint(shared_dir, bf16, keep=3), again)
    assert_on_every_rank({"calibrates": not again.fp8.history.any() and not again.fp8.scale.any()})


@pytest.mark.parametrize("precision, dtype, message", [
    ("fp8", "float64", "precision fp8 keeps float32 master weights: use --dtype float32, not float64"),
    ("fp4", "float32", "unknown precision 'fp4'; choose one of fp32, bf16, fp16, fp8"),
])
def test_bad_fp8_input_is_one_clear_line(precision, dtype, message):
    with pytest.raises(UserError, match=message) as error:
        check_precision(precision, dtype, 0, 1000)
    assert "\n" not in str(error.value)


def test_fp8_with_float64_from_the_command_line_is_one_line(data_dir, tmp_path):
    result = run_script(["--precision", "fp8", "--dtype", "float64", "--max-iters", "1", "--data-dir", str(data_dir),
                         "--out-dir", str(tmp_path / "out"), "--no-progress"])
    assert result.returncode != 0 and len(error_lines(result.stderr)) == 1, result.stderr
    assert "use --dtype float32" in result.stderr and "Traceback" not in result.stderr
