"""The command-line entry points as a user runs them: one-line errors, no hangs,
exact resume, and no lost work when a run is killed."""

import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from numpitron.checkpoint import latest_checkpoint, read_manifest
from tests.conftest import REPO
from tests.harness import PYTHON, TINY_FLAGS, error_lines, logged_losses, run_script, train_script

def test_abort_on_one_rank_ends_every_rank_quickly():
    start = time.monotonic()
    result = run_script([], nprocs=4, script="tests/scripts/fail_on_rank.py", timeout=30)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 10, elapsed
    assert "rank 1" in result.stderr and "deliberate failure on rank 1" in result.stderr
    assert result.stderr.count("Traceback") == 1      # from the failing rank only


@pytest.mark.parametrize("args, message", [
    (["--n-heads", "3"], "d_model (128) must be divisible by n_heads (3)"),
    (["--n-layers", "0"], "n-layers must be positive"),
    (["--micro-batch-size", "-2"], "micro-batch-size must be positive"),
    (["--dtype", "float16"], "invalid choice: 'float16'"),
    (["--zero-stage", "4"], "invalid choice: 4"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"], "global batch size (10) must be divisible"),
    (["--tensor-parallel-size", "3"], "world size 1 is not divisible by tensor x context x pipeline parallel size (3 x 1 x 1 = 3)"),
    (["--input", "/nonexistent/tinyshakespeare.txt", "--data-dir", "/tmp/numpitron-no-such-dir"], "/nonexistent"),
    (["--virtual-stages", "2"], "--pipeline-schedule interleaved and --virtual-stages 2 or more go together"),
    (["--pipeline-schedule", "interleaved", "--virtual-stages", "2"], "it needs --pipeline-parallel-size 2 or more"),
    (["--num-experts", "4", "--moe-load-balancing", "none"], "invalid choice: 'none'"),
    (["--num-experts", "4", "--moe-shared-experts", "-1"], "--moe-shared-experts must not be negative"),
    # Sizes past a C integer (local_shape took len(range)) or a float (the accounting):
    # the memory refusal, not an OverflowError from every rank.
    (["--num-experts", "2", "--moe-expert-hidden", str(10 ** 23)], "GiB available: use smaller sizes"),
    (["--num-experts", str(10 ** 23)], "GiB available: use smaller sizes"),
    (["--num-experts", "2", "--moe-shared-experts", str(10 ** 23)], "GiB available: use smaller sizes"),
    (["--num-experts", str(10 ** 400)], "needs more memory than any host has"),
    (["--muon-lr", "0.02"], "--muon-lr and --muon-momentum set Muon, and this run uses --optimizer adamw"),
    (["--muon-momentum", "0.9"], "--muon-lr and --muon-momentum set Muon, and this run uses --optimizer adamw"),
    (["--d-model", str(10 ** 400), "--n-heads", "1"], "needs more memory than any host has"),
])
def test_bad_input_is_one_line_and_nonzero(args, message):
    result = run_script(args + ["--max-iters", "1", "--no-progress"])
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_huge_expert_sizes_from_a_config_file_are_one_line_on_two_ranks(tmp_path):
    config = tmp_path / "huge.toml"
    config.write_text(f"[model]\nnum_experts = 2\nmoe_expert_hidden = {10 ** 23}\n")
    result = run_script(["--config", str(config), "--data-parallel-size", "2", "--max-iters", "1", "--no-progress"],
                        nprocs=2, timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "GiB available: use smaller sizes" in lines[0], result.stderr


def test_zero3_with_a_pipeline_is_refused_in_one_line():
    result = run_script(["--pipeline-parallel-size", "2", "--zero-stage", "3", "--no-progress"], nprocs=2, timeout=30)
    assert result.returncode != 0
    assert "again for every micro-batch" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_bad_config_on_four_ranks_is_reported_once():
    start = time.monotonic()
    result = run_script(["--n-heads", "3", "--no-progress"], nprocs=4, timeout=30)
    assert result.returncode != 0
    assert time.monotonic() - start < 10
    assert len([l for l in result.stderr.splitlines() if "must be divisible by n_heads" in l]) == 1, result.stderr


def test_world_that_does_not_factor_is_an_error(data_dir, tmp_path):
    result = train_script(data_dir, tmp_path, "--tensor-parallel-size", "2", "--max-iters", "1", nprocs=3)
    assert result.returncode != 0
    assert "world size 3 is not divisible by tensor x context x pipeline parallel size" in result.stderr


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(data_dir, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    twelve = ["--max-iters", "12", "--save-interval", "6", "--keep-checkpoints", "10"]
    assert train_script(data_dir, full, *twelve).returncode == 0
    first = train_script(data_dir, cut, *twelve)
    assert first.returncode == 0
    # Keep only the iteration-6 checkpoint, as if the run had stopped there.
    for ckpt in (cut / "checkpoints").glob("iter_*"):
        if ckpt.name != "iter_000006":
            shutil.rmtree(ckpt)
    (cut / "checkpoints" / "latest").unlink()
    resumed = train_script(data_dir, cut, *twelve, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert logged_losses(cut) == logged_losses(full)        # float64: exactly equal


def test_resume_without_checkpoint_is_an_error(data_dir, tmp_path):
    result = train_script(data_dir, tmp_path, "--max-iters", "2", "--resume")
    assert result.returncode != 0 and "no checkpoint" in result.stderr


def test_corrupt_checkpoint_on_resume_is_one_line_on_two_ranks(data_dir, tmp_path):
    assert train_script(data_dir, tmp_path, "--max-iters", "5").returncode == 0
    victim = sorted((tmp_path / "checkpoints").glob("iter_*/shards/rank-*.bin"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    result = train_script(data_dir, tmp_path, "--max-iters", "8", "--resume", "--data-parallel-size", "2", nprocs=2)
    assert result.returncode != 0
    assert len(error_lines(result.stderr)) == 1, result.stderr
    assert "checksum" in result.stderr


@pytest.mark.parametrize("moment", ["mid-iteration", "mid-save"])
def test_killed_run_resumes_to_the_same_losses(data_dir, tmp_path, moment):
    reference, victim = tmp_path / "reference", tmp_path / "victim"
    args = ["--max-iters", "30", "--save-interval", "4", "--eval-interval", "10"]
    assert train_script(data_dir, reference, *args).returncode == 0
    marker = tmp_path / "saving"
    cmd = [PYTHON, str(REPO / "tests/scripts/train_slow_save.py")] + TINY_FLAGS + [
        "--data-dir", str(data_dir), "--out-dir", str(victim)] + args
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "SLOW_SAVE_MARKER": str(marker)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    if moment == "mid-save":
        # wait for a save after the first complete checkpoint, then kill inside it
        while time.monotonic() < deadline and not list((victim / "checkpoints").glob("iter_*/manifest.json")):
            time.sleep(0.01)
        marker.unlink(missing_ok=True)
        while time.monotonic() < deadline and not marker.exists():
            time.sleep(0.005)
    else:
        while time.monotonic() < deadline and len(losses_if_any(victim)) < 10:
            time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resumed = train_script(data_dir, victim, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert logged_losses(victim) == logged_losses(reference)


def losses_if_any(out_dir):
    try:
        return logged_losses(out_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_moe_recipe_flags_reach_the_model(data_dir, tmp_path):
    """Bias balancing, a shared expert and narrow routed experts from the command line:
    the metrics log the balance, the checkpoint keeps the flags and the moved bias."""
    flags = ["--num-experts", "4", "--moe-load-balancing", "bias", "--moe-bias-update-rate", "0.01",
             "--moe-shared-experts", "1", "--moe-expert-hidden", "64"]
    result = train_script(data_dir, tmp_path, "--max-iters", "2", *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["moe_max_over_mean_load"]) == 2 and min(r["moe_max_over_mean_load"]) >= 1 for r in rows)
    manifest = read_manifest(latest_checkpoint(tmp_path / "checkpoints"))
    saved = manifest["model_config"]
    assert (saved["moe_load_balancing"], saved["moe_shared_experts"], saved["moe_expert_hidden"]) == ("bias", 1, 64)
    assert np.any(manifest["moe_routing_bias"])
