"""The entry points as a user (or a careless script) meets them: a checkpoint with a
tp shard missing, a directory numpitron did not write where it would save, an import
into a run, sizes no host has, flags that make no sense, a second job in a used
directory. Each refusal is one line from one rank and a non-zero exit, and the
user's files are byte for byte as they were."""

import json
import shutil
import subprocess
import time

import numpy as np
import pytest

from numpitron.checkpoint import latest_checkpoint
from tests.conftest import REPO
from tests.processes import alive
from tests.harness import PYTHON, TINY_FLAGS as TINY, run_script as run, snapshot, train_script as train


def one_line(result, fragment: str) -> None:
    assert result.returncode != 0, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def convert(*args):
    return subprocess.run([PYTHON, "-m", "numpitron.checkpoint.convert", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, timeout=60)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):
    """One process, 4 iterations, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("trained")
    assert train(data_dir, out, "--max-iters", "4", "--save-interval", "2", "--keep-checkpoints", "10").returncode == 0
    return out


@pytest.fixture
def copy(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def test_a_tp_shard_missing_from_the_manifest_is_refused_by_export_resume_and_sample(data_dir, tmp_path):
    out = tmp_path / "tp2"
    assert train(data_dir, out, "--max-iters", "1", "--tensor-parallel-size", "2", nprocs=2).returncode == 0
    ckpt = latest_checkpoint(out / "checkpoints")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["pieces"] = [p for p in manifest["pieces"] if (p["name"], p["tp_rank"]) != ("blocks.0.mlp.fc.weight", 1)]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(out)
    fragment = "uncovered on tp rank 1 of 2"
    one_line(convert("export", ckpt, tmp_path / "w.npz"), fragment)
    one_line(train(data_dir, out, "--max-iters", "2", "--resume"), fragment)
    one_line(run(["--out-dir", str(out), "--max-new-tokens", "3"], script="sample.py"), fragment)
    assert snapshot(out) == before and not (tmp_path / "w.npz").exists()


def test_sampling_with_experts_and_fewer_samples_than_replicas_matches_one_process(data_dir, tmp_path):
    out = tmp_path / "moe"
    assert train(data_dir, out, "--max-iters", "1", "--num-experts", "2", "--moe-top-k", "1").returncode == 0
    flags = ["--out-dir", str(out), "--max-new-tokens", "12", "--num-samples", "1", "--collective-timeout", "60"]
    two = run(flags + ["--expert-parallel-size", "2"], script="sample.py", nprocs=2, timeout=90)
    one = run(flags, script="sample.py")
    assert two.returncode == one.returncode == 0, two.stderr + one.stderr
    assert two.stdout == one.stdout


def test_overwrite_refuses_a_checkpoint_directory_holding_files_it_did_not_write(data_dir, copy):
    (copy / "checkpoints" / "iter_000004" / "my_notes.txt").write_text("mine")
    before = snapshot(copy)
    one_line(train(data_dir, copy, "--max-iters", "4", "--overwrite", nprocs=2), "iter_000004 holds files numpitron")
    assert snapshot(copy) == before


def test_a_users_npy_where_the_old_layout_wrote_survives_overwrite_and_resume(data_dir, copy):
    kept = copy / "checkpoints" / "iter_000001" / "params"
    kept.mkdir(parents=True)
    np.save(kept / "ln_f.weight.npy", np.arange(3.0))
    before = snapshot(copy)
    one_line(train(data_dir, copy, "--max-iters", "4", "--overwrite"), "iter_000001 holds files numpitron")
    assert snapshot(copy) == before
    resumed = train(data_dir, copy, "--max-iters", "5", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert np.array_equal(np.load(kept / "ln_f.weight.npy"), np.arange(3.0))


def test_convert_refuses_to_rewind_a_run_or_replace_a_users_file(copy, tmp_path):
    archive = tmp_path / "w.npz"
    assert convert("export", latest_checkpoint(copy / "checkpoints"), archive).returncode == 0
    before = snapshot(copy)
    one_line(convert("import", archive, copy / "checkpoints"), "already holds checkpoints")
    one_line(convert("export", latest_checkpoint(copy / "checkpoints"), archive), "exists; pass --force")
    checkpoints = copy / "checkpoints"
    one_line(convert("export", checkpoints / "iter_000002", checkpoints / "iter_000004" / "manifest.json", "--force"),
             "inside checkpoint")
    assert snapshot(copy) == before


def edit_latest_manifest(out, edit):
    ckpt = latest_checkpoint(out / "checkpoints")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    edit(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_sizes_no_host_has_are_one_line_before_anything_is_allocated(data_dir, copy):
    sample = ["--out-dir", str(copy)]
    before = snapshot(copy)
    # Several samples keep every token (one is streamed and keeps only the model's window).
    one_line(run(sample + ["--max-new-tokens", str(10**12), "--num-samples", "2"], script="sample.py", nprocs=2),
             "GiB per rank")
    one_line(run(sample + ["--num-samples", str(10**12)], script="sample.py"), "GiB per rank")
    edit_latest_manifest(copy, lambda m: m["tensors"]["ln_f.weight"].update(shape=[10**12], full_shape=[10**12]))
    before = snapshot(copy)
    one_line(train(data_dir, copy, "--max-iters", "6", "--resume", nprocs=2), "ln_f.weight")
    one_line(run(sample, script="sample.py"), "ln_f.weight")
    assert snapshot(copy) == before


@pytest.mark.parametrize("script, flags, fragment", [
    ("train_shakespeare.py", ["--blas-threads", "0"], "--blas-threads must be positive"),
    ("train_shakespeare.py", ["--blas-threads", "-3"], "--blas-threads must be positive"),
    ("train_shakespeare.py", ["--collective-timeout", "nan"], "--collective-timeout must be"),
    ("train_shakespeare.py", ["--collective-timeout", "0.001"], "or a finite number of seconds >= 1, got 0.001"),
    ("sample.py", ["--collective-timeout", "0.5"], "--collective-timeout must be 0 (wait forever) or"),
    ("train_shakespeare.py", ["--eval-iters", str(10**9)], "distinct ones the smaller split holds"),
    ("sample.py", ["--temperature", "nan"], "--temperature must be a finite number"),
    ("sample.py", ["--seed", "-1"], "--seed must not be negative"),
], ids=["blas-0", "blas-negative", "timeout-nan", "timeout-tiny", "sample-timeout-tiny", "eval-iters", "temperature-nan", "sample-seed"])
def test_flags_that_make_no_sense_are_one_line(data_dir, copy, script, flags, fragment):
    before = snapshot(copy)
    args = (TINY + ["--data-dir", str(data_dir), "--max-iters", "6", "--resume"] if script == "train_shakespeare.py"
            else []) + ["--out-dir", str(copy), *flags]
    one_line(run(args, script=script), fragment)
    assert snapshot(copy) == before


@pytest.mark.parametrize("flags, fragment", [
    (["--devices", "-4"], "--devices must be positive, got -4"),
    (["--devices", "0"], "--devices must be positive, got 0"),
    (["--device", "../../tests/x"], "unknown device '../../tests/x'"),
])
def test_the_planner_refuses_impossible_devices_in_one_line(flags, fragment):
    result = subprocess.run([PYTHON, "-m", "numpitron.plan", *flags], capture_output=True, text=True, cwd=REPO,
                            timeout=60)
    one_line(result, fragment)


def test_a_checkpoint_field_is_named_as_the_manifest_names_it(copy):
    edit_latest_manifest(copy, lambda m: m["model_config"].update(n_heads=0))
    one_line(run(["--out-dir", str(copy)], script="sample.py"), "model_config.n_heads must be positive")


def test_resuming_says_when_the_batch_changes_and_when_there_is_nothing_to_train(data_dir, copy):
    before = snapshot(copy)
    past = train(data_dir, copy, "--max-iters", "3", "--resume", nprocs=2)
    one_line(past, "past --max-iters 3")
    done = train(data_dir, copy, "--max-iters", "4", "--resume")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.strip().splitlines() == [f"nothing to train: {copy}/checkpoints/iter_000004 is at "
                                                f"iteration 4 = --max-iters"]
    assert snapshot(copy) == before
    wider = train(data_dir, copy, "--max-iters", "5", "--resume", "--data-parallel-size", "2", nprocs=2)
    assert wider.returncode == 0, wider.stderr
    notes = [line for line in wider.stdout.splitlines() if "global batch" in line]
    assert notes == ["note: the global batch is now 8 sequences, the checkpoint trained with 4: "
                     "pass --global-batch-size 4 to continue its trajectory"], wider.stdout


def test_resuming_with_another_seed_is_refused_unless_asked_for(data_dir, copy):
    """The seed draws every batch: resumed with another one (a flag, or an edited
    config.toml), the run went on with other data than the checkpoint's, without a word."""
    before = snapshot(copy)
    one_line(train(data_dir, copy, "--max-iters", "6", "--resume", "--seed", "99"),
             "iter_000004 was trained with --seed 1337, and --seed 99 would draw other batches from here on: "
             "pass --seed 1337, or --reseed to change them")
    edited = copy / "edited.toml"
    edited.write_text((copy / "config.toml").read_text().replace("seed = 1337", "seed = 5"))
    before[edited.name] = snapshot(copy)[edited.name]
    one_line(run(["--config", str(edited), "--out-dir", str(copy), "--max-iters", "6", "--resume"]),
             "was trained with --seed 1337")
    assert snapshot(copy) == before
    asked = train(data_dir, copy, "--max-iters", "6", "--resume", "--seed", "99", "--reseed")
    assert asked.returncode == 0 and asked.stderr == "", asked.stderr
    config = (copy / "config.toml").read_text()
    assert "seed = 99" in config and "reseed" not in config


def test_a_second_job_in_a_used_directory_is_refused_naming_the_first(data_dir, copy):
    leftover = copy / ".metrics.jsonl.4242.tmp"           # a kill during a metrics rewrite left it
    leftover.write_text("x" * 1000)
    first = subprocess.Popen([PYTHON, str(REPO / "train_shakespeare.py"), *TINY, "--data-dir", str(data_dir),
                              "--out-dir", str(copy), "--max-iters", "100000", "--resume"],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        lock = copy / ".numpitron-lock"         # the copied run's own lock names its old pid
        while time.monotonic() < deadline and f"pid {first.pid} " not in (lock.read_text() if lock.exists() else ""):
            time.sleep(0.05)
        second = train(data_dir, copy, "--max-iters", "100000", "--resume", nprocs=2)
        one_line(second, f"is in use by another run (pid {first.pid} on ")
    finally:
        first.kill()
        first.wait()
    assert not alive(first.pid) and not leftover.exists()
    iters = [json.loads(line)["iter"] for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert len(iters) == len(set(iters))
    reached = latest_checkpoint(copy / "checkpoints").name.removeprefix("iter_")
    again = train(data_dir, copy, "--max-iters", str(int(reached)), "--resume")        # the kill freed the lock
    assert again.returncode == 0 and "nothing to train" in again.stdout, again.stderr


@pytest.mark.parametrize("planted, what", [
    ("directory", "a directory"), ("symlink", "a symbolic link"), ("dangling", "a symbolic link"),
    ("hardlink", "a hard link to another file"), ("text", "text numpitron did not write"),
    ("fifo", "not a regular file")])
def test_a_lock_file_that_is_not_ours_is_refused_and_left_alone(data_dir, tmp_path, planted, what):
    import os
    out, mine = tmp_path / "run", tmp_path / "mine.txt"
    out.mkdir()
    mine.write_bytes(b"my notes\n")
    lock = out / ".numpitron-lock"
    {"directory": lambda: (lock.mkdir(), (lock / "keep").write_text("k")),
     "symlink": lambda: lock.symlink_to(mine), "dangling": lambda: lock.symlink_to(tmp_path / "nowhere"),
     "hardlink": lambda: os.link(mine, lock), "text": lambda: lock.write_bytes(b"my notes\n"),
     "fifo": lambda: os.mkfifo(lock)}[planted]()
    before = snapshot(tmp_path)
    one_line(train(data_dir, out, "--max-iters", "1"), f"{lock} is {what}, not the lock file numpitron writes")
    assert snapshot(tmp_path) == before and mine.read_bytes() == b"my notes\n"
    assert planted != "text" or lock.read_bytes() == b"my notes\n"
    assert sorted(p.name for p in out.iterdir()) == [".numpitron-lock"] and not (tmp_path / "nowhere").exists()
