"""python -m numpitron.plot: a run's losses against iterations, tokens, time and bytes."""

import json

from numpitron.plot import curves, plot


def fake_run(path, seq_len=16):
    """Rows every two iterations (--log-interval 2), an evaluation at 4."""
    path.mkdir()
    rows = [{"iter": 2, "train_loss": 4.0, "global_batch_size": 8, "elapsed_s": 0.5, "comm_bytes": 100.0},
            {"iter": 4, "train_loss": 3.5, "global_batch_size": 8, "elapsed_s": 1.0, "comm_bytes": 100.0,
             "val_loss": 3.6}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.toml").write_text(f"[model]\nseq_len = {seq_len}\n")
    return path


def test_each_row_stands_for_the_iterations_since_the_last(tmp_path):
    run = curves(fake_run(tmp_path / "run"))
    assert run["iteration"] == [2, 4] and run["tokens"] == [2 * 8 * 16, 4 * 8 * 16]
    assert run["bytes"] == [200.0, 400.0] and run["seconds"] == [0.5, 1.0] and run["val"] == [(1, 3.6)]


def test_runs_are_drawn_side_by_side(tmp_path):
    """Conditional on matplotlib alone (the `docs` extra)."""
    import matplotlib  # noqa: F401  (the dev extra installs it: the drawing is tested, never skipped)
    out = tmp_path / "loss.svg"
    plot([fake_run(tmp_path / "a"), fake_run(tmp_path / "b", seq_len=32)], str(out))
    assert "<svg" in out.read_text()
