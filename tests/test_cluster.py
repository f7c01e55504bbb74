"""The simulated cluster (numpitron/cluster, docs/17-many-hosts.md): its life cycle, each
rank on its own host, every strategy exact across hosts, the bytes a host's link counts
against the formula, and a job whose host loses its link ending with one line.

Needs root and iproute2 (CI and the development machines run as root). Each test
drives `python -m numpitron.cluster` as a user would; the cluster's prefix is the
tests' own, so a cluster a user has up is never touched.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from numpitron.cluster import control, network
from numpitron.cluster.network import FRAME_HEADER_BYTES, ClusterError, ClusterSpec, set_host_link
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                reason="the simulated cluster needs root and iproute2 (ip, tc)")

PREFIX = "npt-test-"
SCRIPT = str(REPO / "tests/scripts/on_cluster.py")


def cluster(*args, prefix=PREFIX, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "numpitron.cluster", "--prefix", prefix, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def on_cluster(n, *args, per_host=None):
    extra = ["--per-host", str(per_host)] if per_host else []
    done = cluster("run", "-n", str(n), *extra, "--", sys.executable, SCRIPT, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def two_by_two():
    """2 hosts x 2 ranks sharing memory, 200 Mbit/s between the hosts."""
    cluster("down")
    up = cluster("up", "--hosts", "2", "--ranks-per-host", "2", "--inter-host-rate", "200mbit")
    assert up.returncode == 0, up.stderr
    yield control.load(PREFIX)
    assert cluster("down").returncode == 0


def test_up_status_stale_and_down_are_clean_and_idempotent():
    prefix = "npt-life-"
    cluster("down", prefix=prefix)
    up = cluster("up", "--hosts", "2", "--ranks-per-host", "1", "--inter-host-rate", "50mbit",
                 "--intra-host-rate", "1gbit", prefix=prefix)
    assert up.returncode == 0, up.stderr
    assert up.stdout.startswith("up: 2 hosts x 1 ranks") and "frames of 6250 B" in up.stdout, up.stdout
    mtu = subprocess.run(["ip", "netns", "exec", f"{prefix}h1s0", "cat", "/sys/class/net/eth0/mtu"],
                         capture_output=True, text=True).stdout
    assert mtu.strip() == "6250"                  # 1 ms of the slowest link, 50 Mbit/s
    again = cluster("up", "--hosts", "1", "--ranks-per-host", "1", "--inter-host-rate", "1mbit", prefix=prefix)
    assert again.returncode == 1 and again.stderr.count("\n") == 1 and "already up" in again.stderr
    subprocess.run(["ip", "netns", "delete", f"{prefix}h1s0"], check=True)      # half a crash
    status = cluster("status", prefix=prefix)
    assert status.stdout.startswith("stale: ") and f"{prefix}h1s0" in status.stdout, status.stdout
    refused = cluster("run", "-n", "1", "--", "true", prefix=prefix)
    assert refused.returncode == 1 and "stale" in refused.stderr and refused.stderr.count("\n") == 1
    assert cluster("down", prefix=prefix).returncode == 0
    assert cluster("down", prefix=prefix).stdout.strip() == "nothing to remove"
    assert cluster("status", prefix=prefix).stdout.strip() == "down"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in listed


def nothing_left(prefix):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return prefix not in listed and not control.state_dir(prefix).exists()


@pytest.mark.parametrize("rates", [["--inter-host-rate", ""], ["--inter-host-rate", "1.2.3mbit"],
                                   ["--inter-host-rate", "0mbit"], ["--inter-host-rate", "1mbit", "--intra-host-rate", ""]])
def test_a_bad_rate_is_refused_in_one_line_before_anything_is_made(rates):
    prefix = "npt-bad-"
    cluster("down", prefix=prefix)
    done = cluster("up", "--hosts", "2", "--ranks-per-host", "1", *rates, prefix=prefix)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "cannot read the rate" in done.stderr, done.stderr
    assert nothing_left(prefix)


def test_a_failure_halfway_through_up_leaves_nothing_behind(monkeypatch, tmp_path):
    prefix, real, calls = "npt-half-", network.run_ip, []
    cluster("down", prefix=prefix)

    def fails_once_halfway(*args, check=True):
        calls.append(args)
        if len(calls) == 20:
            raise RuntimeError("a failure halfway")
        return real(*args, check=check)
    monkeypatch.setattr(network, "run_ip", fails_once_halfway)
    with pytest.raises(RuntimeError, match="halfway"):
        control.up(ClusterSpec(prefix, 2, 1, "1mbit"))
    monkeypatch.undo()
    assert len(calls) > 20 and nothing_left(prefix)
    (tmp_path / "file").write_text("")                 # the record cannot be written under a file
    env = {**os.environ, "PYTHONPATH": str(REPO), "NUMPITRON_CLUSTER_STATE": str(tmp_path / "file/state")}
    done = subprocess.run([sys.executable, "-m", "numpitron.cluster", "--prefix", prefix, "up", "--hosts", "1",
                           "--ranks-per-host", "1", "--inter-host-rate", "1mbit"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "cannot write the cluster record" in done.stderr
    assert nothing_left(prefix), done.stderr


@pytest.mark.parametrize("rates, mtu, frame", [(("200mbit", None), None, 25000), (("50mbit", "1gbit"), None, 6250),
                                               (("1mbit", None), None, 1500), (("100gbit", "1tbit"), None, 65000),
                                               (("200mbit", None), 9000, 9000)])
def test_frames_are_a_millisecond_of_the_slowest_link(rates, mtu, frame):
    """Small enough that a token bucket banks no more than ~1 ms of a link while it
    idles, large enough that the kernel's work per frame stays off the cores."""
    assert ClusterSpec("npt-x-", 2, 2, *rates, mtu=mtu).frame_bytes == frame


def test_without_root_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="needs root"):
        control.up(ClusterSpec("npt-nope-", 1, 1, "1mbit"))


def test_each_rank_runs_on_its_host_and_tp_stays_inside_one(two_by_two):
    report = json.loads(on_cluster(4, "placement").splitlines()[-1])
    assert report["hostnames"] == [f"{PREFIX}host0"] * 2 + [f"{PREFIX}host1"] * 2
    assert report["crossing"] == ["dp"]                    # tp = 2 x dp = 2: tp inside a host
    assert f"{PREFIX}host1 [2 3]" in report["printout"]


def test_every_strategy_is_exact_across_hosts(two_by_two):
    out = on_cluster(4, "equivalence")
    assert out.count("same as one process") == 6, out


@pytest.mark.parametrize("mesh", [{"data": 2}, {"tensor": 2}], ids=["dp", "tp"])
def test_bytes_on_the_link_are_the_formula_plus_tcp_framing(two_by_two, mesh):
    """One rank per host: every collective of the step crosses host 0's link, each
    rank sending what the book's formula counts for it. The link also carries every
    frame's headers (FRAME_HEADER_BYTES: Ethernet, IPv4, TCP with timestamps), on data
    segments and acknowledgements alike, and MPICH's own message headers (left in the
    5% tolerance)."""
    report = json.loads(on_cluster(2, "bytes", json.dumps(mesh), per_host=1).splitlines()[-1])
    link, payload = report["link"], sum(report["formula"].values())
    assert payload == report["counted"]
    framing = FRAME_HEADER_BYTES * link["tx_packets"]
    mss = two_by_two.frame_bytes - 20 - 32        # TCP payload of one full segment: IPv4 and TCP-with-timestamps headers
    assert link["tx_packets"] * mss >= payload            # no segment carries more than one MSS
    assert abs(link["tx_bytes"] - framing - payload) <= 0.05 * payload, (link, payload, framing)


def test_hybrid_sharding_sends_only_the_replica_all_reduce_across_hosts(two_by_two):
    """HSDP, S = 2 of dp = 4 on 2 hosts x 2 ranks, ZeRO-3: the gathers and reduce-scatters
    stay inside each host (shared memory), and host 0's link carries its two ranks'
    all-reduces of their gradient slices over dp_replica, 2 (R-1)/R of a slice each
    (docs/09-zero-2-and-3.md): the formula plus TCP/IP framing, within 5% (the step's few small
    messages, the loss and a barrier, add MPICH headers and a few bytes)."""
    mesh = {"data": 4, "data_shard": 2, "zero_stage": 3}
    report = json.loads(on_cluster(4, "replica_bytes", json.dumps(mesh)).splitlines()[-1])
    link, payload = report["link"], report["formula"]
    assert report["ranks_on_host"] == 2 and payload == report["counted"] > 0
    framing = FRAME_HEADER_BYTES * link["tx_packets"]
    assert abs(link["tx_bytes"] - framing - payload) <= 0.05 * payload, (link, payload, framing)


def start_training_loop() -> subprocess.Popen:
    """A plain `cluster run` of two ranks, one a host, training in a loop until stopped;
    returned once it reports that training began."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "OPENBLAS_NUM_THREADS": "1"}
    job = subprocess.Popen([sys.executable, "-m", "numpitron.cluster", "--prefix", PREFIX, "run", "-n", "2",
                            "--per-host", "1", "--", sys.executable, SCRIPT, "loop"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if job.stdout.readline().strip() != "training":
        job.kill()
        raise AssertionError(f"the training loop did not start: {job.communicate()[1]}")
    return job


def test_a_host_that_loses_its_link_ends_the_job_with_one_line(two_by_two):
    """Without the watcher both ranks would wait in their all-reduce forever: TCP
    never learns that the other side is gone."""
    job = start_training_loop()
    try:
        time.sleep(1)                                       # mid-run
        set_host_link(two_by_two, 1, up=False)
        pulled = time.monotonic()
        _, stderr = job.communicate(timeout=30)
        assert job.returncode == 1 and time.monotonic() - pulled < 30
    finally:
        job.kill()
        set_host_link(two_by_two, 1, up=True)
    assert stderr.strip() == f"error: host 1 ({PREFIX}host1) lost its link to the other hosts; ended the job", stderr


def test_kill_host_during_a_plain_run_ends_the_job_with_one_line(two_by_two):
    """kill-host kills the host's processes too: Hydra then ends on its own (255, its
    asserts printed) before the watcher's next poll; the link is looked at after."""
    job = start_training_loop()
    try:
        control.kill_host(1, PREFIX)
        _, stderr = job.communicate(timeout=30)
    finally:
        job.kill()
        set_host_link(two_by_two, 1, up=True)
    assert job.returncode == 1, stderr
    assert stderr.strip() == f"error: host 1 ({PREFIX}host1) lost its link to the other hosts; ended the job", stderr
    assert network.namespace_pids(f"{PREFIX}h0") == network.namespace_pids(f"{PREFIX}h1") == []


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_a_killed_run_leaves_no_job_running(two_by_two, signal_name):
    """mpiexec runs in its own session: it must not outlive the `run` that started it
    (SIGKILL: the kernel's parent-death signal; SIGTERM: ended as Ctrl-C ends it)."""
    import signal
    job = start_training_loop()
    try:
        job.send_signal(getattr(signal, signal_name))
        _, stderr = job.communicate(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(network.namespace_pids(n) for n in two_by_two.namespaces()):
            time.sleep(0.2)
        left = {n: network.namespace_pids(n) for n in two_by_two.namespaces()}
    finally:
        job.kill()
        for namespace in two_by_two.namespaces():
            network.kill_namespace_processes(namespace)
    assert not any(left.values()), left
    if signal_name == "SIGTERM":
        assert job.returncode == 130 and stderr.strip() == "error: interrupted; ended the job", stderr
