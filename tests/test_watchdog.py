"""A rank that stops answering ends the job: its peers' next collective passes its
deadline (--collective-timeout), and the waiting rank says which collective it was in."""

import json
import os
import signal
import subprocess
import time

from numpitron.distributed.comm import Comm, CommStats
from numpitron.distributed.watchdog import Watchdog
from tests.conftest import REPO
from tests.processes import alive, rank_pids
from tests.harness import MPIEXEC, PYTHON, TINY_FLAGS as TINY


def test_a_collective_past_its_deadline_is_reported_once_naming_rank_and_collective():
    heard = []
    dog = Watchdog(0.2, rank=3, on_timeout=heard.append)
    dog.enter("dp.all_reduce")
    time.sleep(0.1)
    dog.leave()                                     # in time: nothing said
    time.sleep(0.4)
    assert heard == []
    dog.enter("pp.recv")
    time.sleep(0.6)
    assert len(heard) == 1 and heard[0].startswith("error: rank 3 waited") and "in pp.recv" in heard[0], heard


def test_without_a_timeout_nothing_watches_and_a_comm_of_one_never_marks():
    dog = Watchdog(None, on_timeout=lambda message: (_ for _ in ()).throw(AssertionError(message)))
    dog.enter("dp.all_reduce")
    assert dog.timeout_s is None
    comm = Comm(None, CommStats(), "dp", Watchdog(0.1, on_timeout=lambda message: None))
    comm.barrier()
    assert comm.watchdog.waiting is None


def test_a_stopped_rank_ends_a_two_rank_job_with_one_line(data_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([MPIEXEC, "-n", "2", PYTHON, str(REPO / "train_shakespeare.py"), *TINY,
                             "--data-dir", str(data_dir), "--out-dir", str(out), "--max-iters", "100000",
                             "--eval-interval", "100000", "--collective-timeout", "5"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None and len(rows(out)) < 3:
            time.sleep(0.05)
        stopped = rank_pids(proc.pid)[1]
        stopped_at = time.monotonic()
        os.kill(stopped, signal.SIGSTOP)
        proc.wait(timeout=90)
        waited = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
        if stopped is not None and alive(stopped):
            os.kill(stopped, signal.SIGKILL)
    lines = proc.stderr.read().strip().splitlines()
    assert proc.returncode != 0
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: rank 0 waited") and "(--collective-timeout 5)" in lines[0], lines
    assert waited >= 5, waited


def rows(out):
    try:
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []
