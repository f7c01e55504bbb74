"""The supervisor (`run --max-restarts`, numpitron/cluster/supervisor.py,
docs/17-many-hosts.md "Surviving a lost host"): its re-planned mesh and command, and on
the simulated cluster a host taken down mid-run, after which the job finishes on the
other host with the trajectory of a run resumed by hand from the same checkpoint.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from numpitron.cluster import control
from numpitron.cluster.network import ClusterError
from numpitron.cluster.supervisor import Job, read_job, replan, restart_command
from tests.conftest import REPO
from tests.harness import TINY_FLAGS, logged_losses, run_script

needs_cluster = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                   reason="the simulated cluster needs root and iproute2 (ip, tc)")
PREFIX = "npt-tsup-"
SLOW_STEPS = str(REPO / "tests/scripts/train_slow_steps.py")


def test_the_mesh_is_planned_again_for_the_ranks_left_with_the_same_global_batch():
    job = read_job(["python", "train.py", "--micro-batch-size", "2", "--tensor-parallel-size", "2"], 8)
    assert (job.model_parallel, job.data, job.global_batch) == (2, 4, 8)
    assert replan(job, 4, "host 1 lost") == 2                  # 2 x dp 2, micro-batches of 2: 8
    assert replan(job, 6, "host 2 lost") == 2                  # dp 3 would not split 8 into micro-batches of 2
    with pytest.raises(ClusterError, match=r"^host 1 lost: cannot restart, the 1 ranks left fit no mesh with tensor x context x pipeline = 2"):
        replan(job, 1, "host 1 lost")
    assert replan(Job(1, 2, 6, 1, 6, Path("out"), False), 3, "") == 2     # dp 3 splits 6, but ep = 2 must divide dp


def test_the_restarted_command_resumes_with_the_batch_explicit():
    command = ["python", "t.py", "--data-parallel-size", "4", "--overwrite", "--global-batch-size=16", "--lr", "1"]
    assert restart_command(command, 2, 16, resume=True) == [
        "python", "t.py", "--lr", "1", "--data-parallel-size", "2", "--global-batch-size", "16", "--resume"]
    assert restart_command(["python", "t.py", "--resume"], 1, 4, resume=False)[-1] == "--overwrite"


def cluster(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "OPENBLAS_NUM_THREADS": "1",
           "SLOW_STEP_S": "0.3"}
    return subprocess.Popen([sys.executable, "-m", "numpitron.cluster", "--prefix", PREFIX, *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@needs_cluster
def test_a_lost_host_is_survived_with_the_trajectory_of_a_resume_by_hand(data_dir, tmp_path):
    """2 hosts x 2 ranks, dp = 4, global batch 16 in float64, a checkpoint every 2 of 8
    iterations; every step sleeps 0.3 s so that host 1 goes down between checkpoints."""
    assert cluster("down").wait() == 0
    assert cluster("up", "--hosts", "2", "--ranks-per-host", "2", "--inter-host-rate", "200mbit").wait() == 0
    out = tmp_path / "run"
    flags = [*TINY_FLAGS, "--data-dir", str(data_dir), "--eval-interval", "100", "--save-interval", "2",
             "--max-iters", "8", "--keep-checkpoints", "10"]
    try:
        job = cluster("run", "--max-restarts", "1", "-n", "4", "--", sys.executable, SLOW_STEPS, *flags,
                      "--out-dir", str(out))
        deadline = time.monotonic() + 60
        while not (out / "checkpoints/iter_000002/manifest.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        control.kill_host(1, PREFIX)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
        cluster("down").wait()
    assert job.returncode == 0, stderr
    said = re.fullmatch(rf"restart 1 of 1: host 1 \({PREFIX}host1\) lost; from iter_(\d+) \(iteration \d+\) "
                        r"on host 0 with 2 ranks, data-parallel 4 -> 2, global batch 16", stderr.strip())
    assert said, stderr                     # one line: no traceback, none of the launcher's own lines
    resumed_at = int(said.group(1))
    assert "mesh: tp=1 x cp=1 x dp=2 x pp=1 (2 ranks)" in stdout and "done: 8 iterations" in stdout

    by_hand = tmp_path / "by_hand"
    checkpoint = f"checkpoints/iter_{resumed_at:06d}"
    shutil.copytree(out / checkpoint, by_hand / checkpoint)
    done = run_script(flags + ["--out-dir", str(by_hand), "--data-parallel-size", "2", "--global-batch-size", "16",
                               "--resume"], nprocs=2)
    assert done.returncode == 0, done.stderr
    supervised, reference = logged_losses(out), logged_losses(by_hand)
    after = list(range(resumed_at + 1, 9))
    assert after and [reference[i] for i in after] == pytest.approx([supervised[i] for i in after], rel=1e-10, abs=0)
    print(f"resumed at {resumed_at}; losses after it: {[supervised[i] for i in after]}")


@needs_cluster
def test_ctrl_c_stops_a_supervised_job_and_restarts_nothing():
    """SIGINT (Ctrl-C) reaches the supervisor only (mpiexec runs in its own session):
    it ends the job and stops, one line, exit 130; no "restart", nothing left running."""
    from numpitron.cluster.network import namespace_pids
    assert cluster("down").wait() == 0
    assert cluster("up", "--hosts", "2", "--ranks-per-host", "1", "--inter-host-rate", "200mbit").wait() == 0
    try:
        job = cluster("run", "--max-restarts", "2", "-n", "2", "--", sys.executable,
                      str(REPO / "tests/scripts/on_cluster.py"), "loop")
        assert job.stdout.readline().strip() == "training"
        job.send_signal(signal.SIGINT)
        _, stderr = job.communicate(timeout=60)
        left = namespace_pids(f"{PREFIX}h0") + namespace_pids(f"{PREFIX}h1")
    finally:
        job.kill()
        cluster("down").wait()
    assert job.returncode == 130 and stderr.strip() == "error: interrupted; ended the job", (job.returncode, stderr)
    assert left == []
