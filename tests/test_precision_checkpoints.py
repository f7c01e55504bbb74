"""Checkpoints of mixed-precision runs (docs/07-numbers.md): the fp16 loss scaler resumes
where it stopped, and a checkpoint (fp32 master weights, fp32 moments) loads into any
precision on any mesh, its master weights exactly what was saved."""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.checkpoint import load_checkpoint, save_checkpoint
from numpitron.config import TrainConfig
from numpitron.distributed.gather import gather_full
from numpitron.distributed.topology import Topology
from numpitron.errors import UserError
from numpitron.precision.formats import FORMATS
from tests.harness import SMALLER, assert_on_every_rank, make_trainer, rewrite_manifest, tiny_model, whole_buffers
from tests.tolerances import EQUIV_RTOL_FLOAT32, rel_diff

MODEL = tiny_model("float32", **SMALLER)
TOKENS = np.random.default_rng(0).integers(0, 65, 5000).astype(np.uint16)


def train_cfg(**overrides) -> TrainConfig:
    return TrainConfig(micro_batch_size=2, global_batch_size=4, max_iters=10, warmup_iters=2, seed=1,
                       eval_iters=1, eval_interval=1, **overrides).validate()


def steps(trainer, n: int) -> list[dict]:
    return [trainer.train_step(TOKENS) for _ in range(n)]


# fp16 from a scale of 2^24: the first steps overflow (gradients of ~1e-2 times 2^24 pass
# 65504) and are skipped, each halving the scale, until 2^18 lets a step through; the
# second clean step doubles it, which overflows again: every part of the scaler's state
# changes within ten steps, and the cut after seven falls between two clean steps.
FP16 = dict(precision="fp16", loss_scale=2.0 ** 24, loss_scale_window=2)


def test_a_resumed_fp16_run_scales_skips_and_doubles_as_the_uninterrupted_one(tmp_path):
    straight = steps(make_trainer(MODEL, train_cfg(**FP16), Topology.serial()), 10)

    first = make_trainer(MODEL, train_cfg(**FP16), Topology.serial())
    steps(first, 7)
    saved_scaler = first.scaler.checkpoint()
    path = save_checkpoint(tmp_path, first)
    resumed = make_trainer(MODEL, train_cfg(**FP16), Topology.serial())
    load_checkpoint(path, resumed)
    assert resumed.scaler.checkpoint() == saved_scaler
    rest = steps(resumed, 3)

    keys = ("train_loss", "loss_scale", "skipped_steps", "grad_norm")
    assert [[row[k] for k in keys] for row in straight[7:]] == [[row[k] for k in keys] for row in rest]
    # The test means something only if the state at the cut matters: steps were skipped
    # before it, one clean step was counted towards the next doubling, and the scale
    # moves after it.
    assert saved_scaler["skipped_steps"] > 0 and saved_scaler["clean_steps"] == 1, saved_scaler
    assert len({row["loss_scale"] for row in rest}) > 1


def test_a_corrupt_loss_scaler_is_one_line_and_leaves_the_trainer_alone(tmp_path):
    trainer = make_trainer(MODEL, train_cfg(**FP16), Topology.serial())
    steps(trainer, 2)
    path = save_checkpoint(tmp_path, trainer)
    rewrite_manifest(path, lambda manifest: manifest["loss_scaler"].update(loss_scale=3.0))
    fresh = make_trainer(MODEL, train_cfg(**FP16), Topology.serial())
    before = fresh.scaler.checkpoint()
    with pytest.raises(UserError, match="corrupt checkpoint manifest in .*: loss_scaler is") as error:
        load_checkpoint(path, fresh)
    assert "\n" not in str(error.value) and fresh.scaler.checkpoint() == before and fresh.iteration == 0


def full_state(trainer) -> dict | None:
    """{params (the fp32 master weights of a mixed run), adam_m, adam_v: {name: full tensor}}
    on world rank 0 (collective)."""
    return gather_full(trainer.model, trainer.topo, whole_buffers(trainer.optimizer))


def loaded_as_saved(saved, trainer) -> dict:
    """Checks that `trainer` holds exactly the saved state, and that a mixed run's layers
    use its rounding."""
    loaded, checks = full_state(trainer), {}
    if MPI.COMM_WORLD.rank == 0:
        checks["every buffer exactly as saved"] = all(
            np.array_equal(saved[kind][name], loaded[kind][name]) for kind in saved for name in saved[kind])
    opt = trainer.optimizer
    if opt.precision.mixed:
        used = opt.params if opt.params.size == opt.adam.master.size else opt.params[opt.lo:opt.hi]
        checks["the layers use the rounded master"] = np.array_equal(used, opt.precision.round(opt.adam.master))
    return checks


@pytest.mark.parallel(nprocs=2)
def test_a_bf16_checkpoint_loads_into_fp32_and_fp16_on_other_meshes_and_an_fp32_one_into_bf16(shared_dir):
    source = make_trainer(MODEL, train_cfg(precision="bf16"), data=2, zero_stage=1)
    steps(source, 3)
    saved = full_state(source)
    bf16_path = save_checkpoint(shared_dir / "bf16", source)
    checks = {}
    for name, train, mesh in (("fp32 on tp2", train_cfg(), dict(tensor=2)),
                              ("fp16 on dp2 zero3", train_cfg(precision="fp16"), dict(data=2, zero_stage=3))):
        target = make_trainer(MODEL, train, **mesh)
        load_checkpoint(bf16_path, target)
        checks.update({f"{name}: {k}": v for k, v in loaded_as_saved(saved, target).items()})
        # Another precision's scale is not this one's: fp16 starts from its own 2^16.
        checks[f"{name}: scale"] = (target.scaler.scale, FORMATS[train.precision].loss_scale)
        one = make_trainer(MODEL, train, Topology.serial())
        load_checkpoint(bf16_path, one)
        continued, alone = [r["train_loss"] for r in steps(target, 2)], [r["train_loss"] for r in steps(one, 2)]
        bound = EQUIV_RTOL_FLOAT32 if train.precision == "fp32" else FORMATS[train.precision].eps
        checks[f"{name}: continues as one process does"] = rel_diff(continued, alone) <= bound
        if train.precision == "fp32":
            fp32_saved, fp32_path = full_state(target), save_checkpoint(shared_dir / "fp32", target)

    target = make_trainer(MODEL, train_cfg(precision="bf16"), data=2, zero_stage=2)
    load_checkpoint(fp32_path, target)
    checks.update({f"bf16 from fp32 on dp2 zero2: {k}": v for k, v in loaded_as_saved(fp32_saved, target).items()})
    checks["bf16 from fp32 continues"] = bool(np.all(np.isfinite([r["train_loss"] for r in steps(target, 2)])))
    assert_on_every_rank(checks)


def test_a_float32_checkpoint_of_any_precision_resumes_in_float64_exactly_and_not_the_other_way(tmp_path):
    """docs/07-numbers.md promised it and the loader refused it ("dtype float32 != float64"): widening
    is exact, so the float64 run holds the very numbers saved; narrowing would round them."""
    source = make_trainer(MODEL, train_cfg(precision="bf16"), Topology.serial())
    steps(source, 3)
    saved, path = full_state(source), save_checkpoint(tmp_path / "bf16", source)
    wide = make_trainer(tiny_model("float64", **SMALLER), train_cfg(), Topology.serial())
    load_checkpoint(path, wide)
    loaded = full_state(wide)
    assert all(loaded[kind][name].dtype == np.float64 and np.array_equal(saved[kind][name], loaded[kind][name])
               for kind in saved for name in saved[kind])
    assert wide.iteration == 3 and np.isfinite(steps(wide, 1)[0]["train_loss"])
    narrow = make_trainer(MODEL, train_cfg(), Topology.serial())
    with pytest.raises(UserError, match=r"dtype float64 != float32 \(it would round the saved weights\)"):
        load_checkpoint(save_checkpoint(tmp_path / "float64", wide), narrow)
