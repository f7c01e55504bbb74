"""Mixed precision (numpitron/precision/formats.py, precision/master_weights.py; docs/07-numbers.md):
the formats' rounding and ranges, dynamic loss scaling, fp16's underflow without it,
the 2 + 2 + 12 bytes per parameter of every ZeRO stage, activations kept in 2 bytes,
checkpoints of the master weights, and bf16 layouts against one process in bf16."""

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from numpitron.distributed.topology import Topology
from numpitron.errors import UserError
from numpitron.transformer.activation_memory import block_activation_bytes
from numpitron.nn.cache_bytes import cache_nbytes
from numpitron.optim.memory_report import memory_bytes
from numpitron.precision.formats import FORMATS, LossScaler, check_precision
from tests.harness import assert_on_every_rank, make_trainer, run, serial_reference, tiny_model, tiny_tokens, tiny_train
from tests.harness import train_steps

BF16_EPS = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)          # 2^-7


def test_rounding_errs_by_at_most_half_an_epsilon_and_fp16_has_its_range():
    x = np.random.default_rng(0).normal(size=10000).astype(np.float32)
    for name in ("bf16", "fp16"):
        fmt = FORMATS[name]
        rounded = fmt.round(x)
        assert rounded.dtype == np.float32 and not np.array_equal(rounded, x)
        assert np.max(np.abs(rounded - x) / np.abs(x)) <= fmt.eps / 2
    assert FORMATS["fp32"].round(x) is x
    fp16 = FORMATS["fp16"].round(np.array([7e4, 2.0 ** -26, 2.0 ** -23], np.float32))
    assert fp16[0] == np.inf and fp16[1] == 0 and fp16[2] == 2.0 ** -23
    bf16 = FORMATS["bf16"].round(np.array([1e38, 2.0 ** -126], np.float32))
    assert np.all(np.isfinite(bf16)) and bf16[1] == 2.0 ** -126        # bf16 has fp32's range


def test_dynamic_loss_scale_halves_and_skips_on_overflow_and_doubles_after_a_clean_window():
    scaler = LossScaler(FORMATS["fp16"], initial=8.0, window=3)
    assert scaler.record(False) is False and scaler.state() == {"loss_scale": 4.0, "skipped_steps": 1}
    assert all(scaler.record(True) for _ in range(3)) and scaler.scale == 8.0
    bf16 = LossScaler(FORMATS["bf16"])
    assert bf16.record(True) and bf16.scale == 1.0 and bf16.skipped_steps == 0


@pytest.mark.parametrize("precision, dtype, scale, message", [
    ("fp4", "float32", 0, "unknown precision 'fp4'"),
    ("bf16", "float64", 0, "use --dtype float32"),
    ("fp16", "float32", 3.0, "positive power of two"),
    ("fp16", "float32", -4.0, "positive power of two"),
])
def test_bad_precision_input_is_one_clear_line(precision, dtype, scale, message):
    with pytest.raises(UserError, match=message) as error:
        check_precision(precision, dtype, scale, 1000)
    assert "\n" not in str(error.value)


def test_an_overflowing_fp16_step_is_skipped_and_leaves_parameters_and_moments_alone():
    trainer = make_trainer(tiny_model("float32"), tiny_train(precision="fp16", loss_scale=2.0 ** 40),
                           Topology.serial())
    before = trainer.optimizer.adam.master.copy()
    out = trainer.train_step(tiny_tokens())
    assert out["skipped_steps"] == 1 and out["loss_scale"] == 2.0 ** 39
    assert np.array_equal(trainer.optimizer.adam.master, before) and not trainer.optimizer.adam.m.any()


def _reduced_grads(precision: str, loss_scale: float) -> np.ndarray:
    trainer = make_trainer(tiny_model("float32"), tiny_train(precision=precision, loss_scale=loss_scale,
                                                               grad_clip=0.0), Topology.serial())
    trainer.train_step(tiny_tokens())
    return trainer.optimizer.reduced_grads().copy()


def test_fp16_loses_small_gradients_to_underflow_and_loss_scaling_recovers_them():
    exact = _reduced_grads("fp32", 0)
    unscaled, scaled = _reduced_grads("fp16", 1.0), _reduced_grads("fp16", 2.0 ** 16)
    nonzero = exact != 0
    lost_unscaled = np.flatnonzero(nonzero & (unscaled == 0))
    lost_scaled = np.flatnonzero(nonzero & (scaled == 0))
    smallest_fp16 = 2.0 ** -24
    assert len(lost_unscaled) >= 100, len(lost_unscaled)
    # Lost: below fp16's range, as the scaled run (the same fp16 forward) computes them.
    # Not as fp32 does: a gradient below eps times the largest is cancellation, and the
    # fp16 activations (nn/layer.py) move it by more than its size.
    assert np.all(np.abs(scaled[lost_unscaled]) < 4 * smallest_fp16)
    assert len(lost_scaled) * 4 <= len(lost_unscaled), (len(lost_scaled), len(lost_unscaled))
    assert np.all(np.abs(exact[lost_scaled]) < 4 * smallest_fp16 / 2.0 ** 16)  # only what even 2^16 cannot lift


def test_bf16_keeps_fp32_master_weights_and_hands_the_layers_their_rounding():
    trainer = make_trainer(tiny_model("float32"), tiny_train(precision="bf16"), Topology.serial())
    train_steps(trainer, 3)
    master, used = trainer.optimizer.adam.master, trainer.model.store.data
    assert np.array_equal(used, FORMATS["bf16"].round(master)) and not np.array_equal(used, master)
    assert trainer.optimizer.state.values_in_range(0, 8)["params"] is not None
    np.testing.assert_array_equal(trainer.optimizer.state.whole("params"), master)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_activations_are_kept_in_2_bytes_and_statistics_in_4_and_recomputation_keeps_the_trajectory(precision):
    # Every activation a layer keeps for its backward (x-hat, the linear layers' inputs,
    # q, k, v, the probabilities, GELU's slope and output) holds the format's values in
    # 2 bytes; the statistics (1/std, the log-sum-exps) and the loss's probabilities stay
    # fp32 (transformer/activation_memory.py derives a block's bytes). To the byte, against fp32's.
    model, tokens = tiny_model("float32"), tiny_tokens()
    B, T, C, H = tiny_train().micro_batch_size, model.seq_len, model.d_model, model.n_heads
    for recompute in ("none", "selective", "full"):
        kept = {}
        for name in ("fp32", precision):
            trainer = make_trainer(model, tiny_train(precision=name), Topology.serial(), recompute=recompute)
            ids, targets = trainer.microbatches(tokens, "train", 0)[0]
            kept[name] = [cache_nbytes(c) for c in trainer.model.forward(ids, targets)[1]]
        block = dict(B=B, T=T, C=C, H=H, recompute=recompute)
        assert kept["fp32"][1:-1] == [block_activation_bytes(**block, itemsize=4)] * model.n_layers, recompute
        assert kept[precision][1:-1] == [block_activation_bytes(**block, itemsize=2, stat_itemsize=4)] \
            * model.n_layers, recompute
        # The embeddings keep token ids; the head halves ln_f's x-hat and its own input.
        assert kept[precision][0] == kept["fp32"][0] and kept[precision][-1] == kept["fp32"][-1] - 2 * 2 * B * T * C
    # Kept exactly, so full recomputation's rerun forward is the first: bit for bit the
    # run that keeps every activation.
    train = tiny_train(precision=precision)
    full, full_norms, full_params, _ = run(make_trainer(model, train, Topology.serial(), recompute="full"), steps=4)
    plain, plain_norms, plain_params, _ = run(make_trainer(model, train, Topology.serial()), steps=4)
    assert list(full) == list(plain) and list(full_norms) == list(plain_norms)
    assert all(np.array_equal(full_params[k], plain_params[k]) for k in plain_params)


def expected_model_state(stage: int, size: int, dp: int) -> dict:
    """(2 + 2 + 12) bytes a parameter (Rajbhandari et al. 2020, Fig. 1) divided as each
    ZeRO stage shards: parameters 2 from stage 3, optimizer state 12 from stage 1, and
    the gradients this implementation keeps between steps: the whole 2 (stage 0), the
    whole and the reduce-scattered slice (stage 1), the slice only (stages 2 and 3)."""
    grads = {0: 2 * size, 1: 2 * size + 2 * size // dp, 2: 2 * size // dp, 3: 2 * size // dp}[stage]
    return {"params": 2 * size // (dp if stage == 3 else 1), "grads": grads,
            "optimizer_state": 12 * size // (dp if stage >= 1 else 1)}


@pytest.mark.parallel(nprocs=2)
def test_mixed_precision_model_state_is_2_2_12_bytes_per_parameter_over_every_zero_stage():
    for stage in (0, 1, 2, 3):
        trainer = make_trainer(tiny_model("float32"), tiny_train(precision="bf16"), data=2, zero_stage=stage)
        size = trainer.model.store.size
        measured = memory_bytes(trainer.optimizer)
        assert {k: measured[k] for k in ("params", "grads", "optimizer_state")} == \
            expected_model_state(stage, size, 2), stage


# Two layouts in bf16 sum the same fp32 products in different orders (the dp all-reduce,
# the tp partial sums), and a dp rank rounds its own gradients before the reduction
# where one process rounds the sum of all micro-batches: differences of a few fp32 ulps
# or one bf16 rounding, which the rounding to bf16 either absorbs or turns into one bf16
# ulp, a relative eps = 2^-7, in a parameter, an activation or a gradient. The loss and
# the gradient norm, smooth functions of them, then differ by at most about eps relative.
# A parameter's Adam update moves it by at most about lr (|m_hat / sqrt(v_hat)| <= 1 for
# beta1^2 < beta2), so where a flipped rounding changes an update's sign two runs' master
# weights part by at most 2 lr a step: 2 sum(lr_t) over ten steps, in absolute terms.
@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("mesh", [dict(data=2), dict(tensor=2)], ids=["dp2", "tp2"])
def test_bf16_layouts_equal_one_process_in_bf16_within_the_formats_epsilon(mesh):
    model, train = tiny_model("float32"), tiny_train(precision="bf16")
    losses, norms, params, trainer = run(make_trainer(model, train, **mesh))
    ref_losses, ref_norms, ref_params, _ = serial_reference(model, train)
    adam_bound = 2 * sum(trainer.lr(t) for t in range(10))
    moved = None
    if trainer.topo.rank == 0:
        moved = max(float(np.max(np.abs(params[k] - ref_params[k]))) for k in ref_params)
    moved = MPI.COMM_WORLD.bcast(moved, root=0)
    assert_on_every_rank({"loss": bool(np.max(np.abs(losses - ref_losses) / ref_losses) <= BF16_EPS),
                          "grad norm": bool(np.max(np.abs(norms - ref_norms) / ref_norms) <= BF16_EPS),
                          "master weights": moved <= adam_bound})
