"""A trace on the simulated cluster (numpitron/cluster, docs/19-traces.md): each process
is named with the host it ran on, the clocks' offsets are measured across the link and
bounded, and the bytes a rank's collectives carried over it are its counters'.

Needs root and iproute2, as tests/test_cluster.py; its own prefix, so no cluster of that
file or of a user is touched."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.harness import TINY_FLAGS, assert_valid_trace

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                reason="the simulated cluster needs root and iproute2 (ip, tc)")

PREFIX = "npt-trace-"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "OPENBLAS_NUM_THREADS": "1"}


def cluster(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "numpitron.cluster", "--prefix", PREFIX, *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def two_hosts():
    cluster("down")
    up = cluster("up", "--hosts", "2", "--ranks-per-host", "1", "--inter-host-rate", "200mbit")
    assert up.returncode == 0, up.stderr
    yield
    assert cluster("down").returncode == 0


def test_a_trace_on_the_cluster_names_each_rank_with_its_host(two_hosts, data_dir, tmp_path):
    path = tmp_path / "trace.json"
    done = cluster("run", "-n", "2", "--", sys.executable, str(REPO / "train_shakespeare.py"), *TINY_FLAGS,
                   "--data-parallel-size", "2", "--global-batch-size", "16", "--max-iters", "3",
                   "--data-dir", str(data_dir), "--out-dir", str(tmp_path / "out"), "--trace", str(path),
                   "--trace-iters", "2:4")
    assert done.returncode == 0, done.stderr
    trace = json.loads(path.read_text())
    assert_valid_trace(trace)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"
             and e["name"] == "process_name"}
    assert [names[r].rsplit(" on ", 1)[1] for r in (0, 1)] == [f"{PREFIX}host0", f"{PREFIX}host1"], names
    clock = trace["otherData"]["clock"]          # rank 1's offset measured over the link, bounded
    assert clock["error_us"][1][0] > 0 and all(abs(o) <= e + 1.0 for o, e in zip(clock["offset_us"][1],
                                                                                  clock["error_us"][1]))
    rows = {r["iter"]: r for r in map(json.loads, (tmp_path / "out/metrics.jsonl").read_text().splitlines())}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == 0 and e["name"] == "step" and e["cat"] == "step":
            inside = [c["args"]["bytes"] for c in trace["traceEvents"] if c["ph"] == "X" and c["pid"] == 0
                      and c.get("cat") == "comm" and e["ts"] <= c["ts"] <= e["ts"] + e["dur"]]
            assert sum(inside) == rows[e["args"]["iteration"]]["comm_bytes"] > 0
