"""Nothing lost, nothing silently wrong: a used run directory, damaged data, nonsense
flags, a checkpoint with NaN in it, and kills at random moments during saves and
prunes. Every refusal is one line from one rank, a non-zero exit, and the user's files
byte for byte as they were."""

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from numpitron.checkpoint import latest_checkpoint
from tests.conftest import REPO
from tests.harness import MPIEXEC, PYTHON, TINY_FLAGS, error_lines, logged_losses, run_script, snapshot, train_script
from tests.processes import watch_job

TRAIN = TINY_FLAGS + ["--eval-interval", "4"]


def one_line_error(result, fragment: str):
    assert result.returncode != 0, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("run")
    assert train_script(data_dir, out, "--max-iters", "4").returncode == 0
    return out


def test_a_fresh_run_into_a_used_out_dir_is_refused_and_overwrite_replaces_only_ours(finished_run, data_dir,
                                                                                      tmp_path):
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished_run), str(out)], check=True)
    (out / "notes.txt").write_text("keep me")
    before = snapshot(out)
    result = train_script(data_dir, out, "--max-iters", "3", nprocs=2)
    one_line_error(result, "already holds a run")
    assert "--resume" in result.stderr and "--overwrite" in result.stderr
    assert snapshot(out) == before
    assert train_script(data_dir, out, "--max-iters", "3", "--overwrite").returncode == 0
    assert sorted(logged_losses(out)) == [1, 2, 3] and (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("damage, fragment", [
    ("id out of range", "outside the vocabulary"),
    ("truncated tokenizer", "tokenizer.json"),
    ("short val", "val.bin"),
])
def test_damaged_prepared_data_is_refused_naming_the_file(data_dir, tmp_path, damage, fragment):
    data = tmp_path / "data"
    subprocess.run(["cp", "-r", str(data_dir), str(data)], check=True)
    assert train_script(data, tmp_path / "first", "--max-iters", "1").returncode == 0      # prepares data/
    if damage == "id out of range":
        ids = np.fromfile(data / "train.bin", np.uint16)
        ids[100] = 900
        ids.tofile(data / "train.bin")
        (data / "prepared.json").unlink()            # as if prepared before the record existed
    elif damage == "truncated tokenizer":
        raw = (data / "tokenizer.json").read_bytes()
        (data / "tokenizer.json").write_bytes(raw[: len(raw) // 2])
    else:
        np.fromfile(data / "val.bin", np.uint16)[:10].tofile(data / "val.bin")
    before = snapshot(data)
    one_line_error(train_script(data, tmp_path / "second", "--max-iters", "1", nprocs=2), fragment)
    assert snapshot(data) == before


@pytest.mark.parametrize("flags, fragment", [
    (["--grad-clip", "nan"], "grad-clip must be a finite number"),
    (["--lr", "inf"], "lr must be a finite number"),
    (["--beta1", "1.5"], "beta1 must lie in [0, 1)"),
    (["--beta2", "-3"], "beta2 must lie in [0, 1)"),
    (["--weight-decay", "nan"], "weight-decay must be a finite number"),
    (["--min-lr", "nan"], "min-lr must be a finite number"),
    (["--seed", "-5"], "seed must not be negative"),
    (["--d-model", "100000", "--n-heads", "4"], "GiB per rank"),
    (["--seq-len", "100000"], "GiB per rank"),
])
def test_nonsense_numbers_are_one_line_from_one_rank(data_dir, tmp_path, flags, fragment):
    one_line_error(train_script(data_dir, tmp_path, "--max-iters", "2", *flags, nprocs=2), fragment)


def test_an_out_dir_that_cannot_be_written_is_one_line(data_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    one_line_error(train_script(data_dir, blocker / "out", "--max-iters", "1"), "cannot write to --out-dir")


def test_a_checkpoint_with_nan_or_a_mistyped_config_is_refused_by_sample_and_resume(finished_run, data_dir,
                                                                                    tmp_path):
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished_run), str(out)], check=True)
    ckpt = latest_checkpoint(out / "checkpoints")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    # A NaN where ln_f.weight's parameters are, with the shard's size and checksum made
    # to match: only the values themselves can give it away.
    piece = next(p for p in manifest["pieces"] if (p["kind"], p["name"]) == ("params", "ln_f.weight"))
    shard = ckpt / piece["file"]
    raw = bytearray(shard.read_bytes())
    nan = np.array([np.nan], manifest["tensors"]["ln_f.weight"]["dtype"]).tobytes()
    raw[piece["offset"]:piece["offset"] + len(nan)] = nan
    shard.write_bytes(bytes(raw))
    from numpitron.checksum import file_crc32 as file_checksum
    manifest["files"][piece["file"]]["crc32"] = file_checksum(shard)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(out)
    one_line_error(run_script(["--out-dir", str(out)], script="sample.py", nprocs=2), "NaN or infinite")
    one_line_error(train_script(data_dir, out, "--max-iters", "6", "--resume"), "NaN or infinite")
    manifest["model_config"]["d_model"] = "32"
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(out)
    one_line_error(run_script(["--out-dir", str(out)], script="sample.py", nprocs=2), "model_config.d_model must be an integer")
    one_line_error(train_script(data_dir, out, "--max-iters", "6", "--resume"), "d_model is '32' (str)")
    assert snapshot(out) == before


def test_convert_refuses_a_text_file_and_an_unwritable_target_in_one_line(finished_run, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    convert = ["-m", "numpitron.checkpoint.convert"]
    result = subprocess.run([PYTHON, *convert, "import", str(text), str(tmp_path / "root")],
                            capture_output=True, text=True, cwd=REPO)
    one_line_error(result, "is not an .npz archive")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    ckpt = latest_checkpoint(finished_run / "checkpoints")
    result = subprocess.run([PYTHON, *convert, "export", str(ckpt), str(blocker / "model.npz")],
                            capture_output=True, text=True, cwd=REPO)
    one_line_error(result, "cannot write")


def test_a_partial_metrics_line_is_dropped_on_resume_with_one_note(finished_run, data_dir, tmp_path):
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished_run), str(out)], check=True)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"iter": 5, "train_lo')                  # a row cut short by a kill
    result = train_script(data_dir, out, "--max-iters", "6", "--resume")
    assert result.returncode == 0, result.stderr
    assert "dropped 1 unreadable line" in result.stdout
    assert sorted(logged_losses(out)) == [1, 2, 3, 4, 5, 6]


def kill_loop_args(data_dir, out):
    return TRAIN + ["--data-dir", str(data_dir), "--out-dir", str(out), "--max-iters", "16",
                    "--save-interval", "1", "--keep-checkpoints", "1"]


def metrics_history(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["iter"]: tuple(r.get(k) for k in ("train_loss", "lr", "grad_norm", "val_loss")) for r in rows}


def test_random_kills_during_saves_and_prunes_always_resume_exactly(data_dir, tmp_path):
    """20 SIGKILLs at random moments (fixed seed); after each the run is started again
    (--resume once a checkpoint exists). The finished run has the uninterrupted run's
    float64 losses and its whole metrics history."""
    reference = tmp_path / "reference"
    assert run_script(kill_loop_args(data_dir, reference)).returncode == 0
    victim, rng, kills, start_over, inside_io = tmp_path / "victim", random.Random(1234), 0, False, 0
    script = [PYTHON, str(REPO / "tests/scripts/train_slow_io.py")]
    while kills < 20:
        resume = latest_checkpoint(victim / "checkpoints") is not None and not start_over
        proc = subprocess.Popen(script + kill_loop_args(data_dir, victim) + (["--resume"] if resume else ["--overwrite"]),
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(0.3, 1.5))
        start_over = proc.poll() is not None          # finished before the kill: run it again from scratch
        if start_over:
            assert proc.returncode == 0, proc.stderr.read()
            continue
        busy = [p.name for p in (victim / "checkpoints").glob(".*")] if (victim / "checkpoints").is_dir() else []
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        inside_io += bool(busy)                        # a save or a prune was under way
    resumed = run_script(kill_loop_args(data_dir, victim) + (["--resume"] if latest_checkpoint(victim / "checkpoints")
                                                      else ["--overwrite"]))
    assert resumed.returncode == 0, resumed.stderr
    assert metrics_history(victim) == metrics_history(reference)
    assert kills == 20 and inside_io >= 3, inside_io


def test_an_agreed_error_exits_cleanly_without_leaving_shared_memory_behind(tmp_path):
    """Every rank fails alike: they finalize instead of aborting, so MPICH removes its
    /dev/shm segments, and stderr holds the one line and nothing from the launcher.
    Only the segments this job's own processes mapped are checked: another MPI job on
    the machine may hold (or have leaked) its own."""
    proc = subprocess.Popen([MPIEXEC, "-n", "2", PYTHON, str(REPO / "train_shakespeare.py"), "--n-heads", "3",
                             "--out-dir", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    ours = watch_job(proc)
    stderr = proc.stderr.read()
    assert proc.returncode != 0
    assert stderr.strip().splitlines() == ["error: d_model (128) must be divisible by n_heads (3)"]
    if Path("/dev/shm").is_dir():
        assert ours, "the job was never seen mapping a segment: nothing was checked"
        assert not [s for s in ours if s.exists()]
