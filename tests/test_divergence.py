"""A run that goes wrong numerically ends in one line: a loss, validation loss or (where
every update is applied) gradient norm that is no longer finite is "training diverged",
without NumPy's RuntimeWarnings before it and before anything is saved; an fp16 run whose
every step overflowed is an error, not "done"."""

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
