"""A run that goes wrong numerically ends in one line: a loss, validation loss or (where
every update is applied) gradient norm that is no longer finite is "training diverged",
without NumPy's RuntimeWarnings before it and before anything is saved; an fp16 run whose
every step overflowed is an error, not "done"."""

import json

import pytest

from tests.harness import train_script as train

HUGE_LR = ["--lr", "1e9", "--min-lr", "0", "--grad-clip", "0", "--warmup-iters", "0"]


def only_line(result) -> str:
    assert result.returncode != 0, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("iters", [9, 20])
def test_a_huge_learning_rate_is_one_line_and_saves_no_broken_weights(data_dir, tmp_path, iters):
    """At 9 iterations the loss is still finite when the run ends; before, it said "done"
    with a validation loss of nan and saved the weights that gave it."""
    out = tmp_path / "run"
    line = only_line(train(data_dir, out, "--max-iters", str(iters), *HUGE_LR))
    assert line.startswith("error: training diverged at iteration "), line
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


FP16 = ["--dtype", "float32", "--precision", "fp16", "--max-iters", "6"]


def test_an_fp16_run_whose_every_step_overflowed_is_an_error_not_done(data_dir, tmp_path):
    """--loss-scale 2^80: the scale halves at each skipped step and is still 2^74 after six;
    before, the run said "done: 6 iterations" having applied none of them."""
    line = only_line(train(data_dir, tmp_path / "huge", *FP16, "--loss-scale", str(2.0 ** 80)))
    assert line == ("error: every one of this run's 6 steps overflowed fp16 and was skipped (its loss scale fell "
                    "from 2^80 to 2^74): start again from a smaller --loss-scale (0: the default)"), line
    # A scale that is too large for a few steps only is what the scaler is for: the run trains.
    searched = train(data_dir, tmp_path / "searched", *FP16, "--loss-scale", str(2.0 ** 19))
    assert searched.returncode == 0 and searched.stderr == "", searched.stderr
    rows = [json.loads(line) for line in (tmp_path / "searched" / "metrics.jsonl").read_text().splitlines()]
    assert 0 < rows[-1]["skipped_steps"] < 6, rows[-1]


@pytest.mark.parametrize("precision, scale, fragment", [
    ("fp16", 8.0, "in 10 steps in a row at loss scale 1, with no lower scale to try"),
    ("bf16", 0.0, "overflowed bf16 in 10 steps in a row at loss scale 1"),
])
def test_overflowing_with_no_lower_scale_to_try_ends_the_run(precision, scale, fragment):
    """fp16 skips three steps on its way from 8 down to 1, its floor; from there on (and
    for bf16 from the start) nothing changes between tries, so ten in a row end the run."""
    from numpitron.errors import UserError
    from numpitron.precision.formats import FORMATS, LossScaler
    from numpitron.divergence import SkippedSteps
    scaler = LossScaler(FORMATS[precision], scale)
    skips = SkippedSteps(scaler)
    overflow = {"grad_norm": float("inf")}
    floor_steps = 3 if precision == "fp16" else 0
    for it in range(1, floor_steps + SkippedSteps.STALLED):
        used = scaler.scale
        scaler.record(False)
        skips.record(it, overflow, used, last=False)
    skips.record(1000, {"grad_norm": 1.0}, scaler.scale, last=False)     # a clean step starts the count again
    with pytest.raises(UserError, match=fragment):
        for it in range(SkippedSteps.STALLED):
            used = scaler.scale
            scaler.record(False)
            skips.record(2000 + it, overflow, used, last=False)
