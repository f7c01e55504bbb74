"""Run an MPI job on the cluster: Hydra (MPICH's mpiexec) started in the switch
namespace with an ordinary host list, `-launcher ssh` and our `hop` script in place of
ssh, and `-iface core` for its control connections. Ranks fill the hosts in order:
ranks 0..R-1 on host 0, R..2R-1 on host 1, and so on, so tensor-parallel peers (the
fastest-varying coordinate of the mesh) share a host whenever tp divides R.

While the job runs, `run` watches every host's link. A link that goes down (a cable
pulled, `kill-host`) would leave the ranks on both sides waiting forever inside a
collective, since TCP never learns that the peer is gone: the watcher ends the whole
job within WATCH_INTERVAL_S and prints one line saying which host was lost. (It watches
what the simulation knows; on real hosts the same role falls to a collective timeout.)
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from numpitron.cluster.control import DEFAULT_PREFIX, require, state_dir
from numpitron.cluster.network import ClusterError, ClusterSpec, host_link_is_up, kill_namespace_processes

WATCH_INTERVAL_S = 0.5
# What Hydra prints when a rank dies: "[mpiexec@host] file.c:123 ...", "[proxy:0@host] ...",
# and its "BAD TERMINATION" banner framed by lines of "=".
LAUNCHER_LINE = re.compile(rb"^(\[(mpiexec|proxy:[0-9]+)@[^]]*\] |=+\r?$|=   )")
# Forwarded to every rank explicitly, besides Hydra's own forwarding of the whole
# environment: what Python, BLAS and MPICH need to behave as they would on one host.
FORWARDED = ("PATH", "PYTHONPATH", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "MPIR_CVAR_ENABLE_HEAVY_YIELD", "VIRTUAL_ENV", "HOME")


def mpiexec_path() -> str:
    beside_python = Path(sys.executable).parent / "mpiexec"
    found = str(beside_python) if beside_python.exists() else shutil.which("mpiexec")
    if not found:
        raise ClusterError("no mpiexec found beside this Python or on PATH (pip install mpich)")
    return found


def placement(spec: ClusterSpec, n: int, per_host: int | None = None,
              hosts: list[int] | None = None) -> list[tuple[int, int]]:
    """(host, slot) of every rank: `per_host` ranks on each of `hosts` in order (default:
    all the host's ranks, on every host), a slot per rank when ranks have their own namespaces."""
    per_host = per_host or spec.ranks_per_host
    hosts = list(range(spec.hosts)) if hosts is None else hosts
    if not 1 <= per_host <= spec.ranks_per_host:
        raise ClusterError(f"ranks per host must be between 1 and {spec.ranks_per_host}, got {per_host}")
    if not 1 <= n <= len(hosts) * per_host:
        raise ClusterError(f"{n} ranks do not fit on {len(hosts)} hosts x {per_host} ranks")
    return [(hosts[rank // per_host], rank % per_host if spec.intra_host_rate else 0) for rank in range(n)]


def host_list(spec: ClusterSpec, places: list[tuple[int, int]]) -> str:
    """Hydra's -hosts argument: address:count for consecutive ranks in one namespace."""
    runs: list[list] = []
    for host, slot in places:
        if runs and runs[-1][0] == (host, slot):
            runs[-1][1] += 1
        else:
            runs.append([(host, slot), 1])
    return ",".join(f"{spec.slot_address(*where)}:{count}" for where, count in runs)


def rank_environment(spec: ClusterSpec) -> dict:
    """What MPICH needs to talk TCP between hosts. The PyPI wheel would otherwise pick
    UCX, which sees one machine and moves every message through shared memory: OFI's
    tcp provider puts them on the links. Ranks of one host then share memory (MPICH's
    own shm, as on a real node) unless each has its own namespace and link; then
    MPIR_CVAR_NOLOCAL sends their messages over that link too."""
    env = {"MPICH_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
    if spec.intra_host_rate:
        env["MPIR_CVAR_NOLOCAL"] = "1"
    env.update({name: os.environ[name] for name in FORWARDED if name in os.environ})
    return env


def mpiexec_command(spec: ClusterSpec, command: list[str], places: list[tuple[int, int]]) -> list[str]:
    env = [arg for name, value in rank_environment(spec).items() for arg in ("-genv", name, value)]
    return ["ip", "netns", "exec", spec.switch, mpiexec_path(), "-launcher", "ssh",
            "-launcher-exec", str(state_dir(spec.prefix) / "hop"), "-iface", "core",
            "-hosts", host_list(spec, places), "-n", str(len(places)), *env, *command]


def run(command: list[str], n: int, prefix: str = DEFAULT_PREFIX, per_host: int | None = None,
        announce=print) -> int:
    """Run `command` on n ranks of the cluster; its exit code, or 1 when a host's link
    went down during the run (after one line through `announce`)."""
    spec = require(prefix)
    code, lost = run_job(spec, command, placement(spec, n, per_host))
    if lost:
        announce(f"error: host {lost[0]} ({spec.hostname(lost[0])}) lost its link to the other hosts; ended the job")
    return code


def run_job(spec: ClusterSpec, command: list[str], places: list[tuple[int, int]],
            quiet_launcher: bool = False) -> tuple[int, list[int]]:
    """Run `command` with a rank at each of `places`, watching the links of their hosts:
    (exit code, the hosts whose link went down; the job was ended then, code 1).
    The lines Hydra itself prints (its banner, a trace of its internal asserts) are held
    back, and shown after the job only if no host was lost and not `quiet_launcher` (a
    caller that says what happened in one line). Ctrl-C ends the job, then is raised."""
    if not command:
        raise ClusterError("nothing to run: give the command after --")
    hosts = sorted({host for host, _ in places})
    down = [h for h in hosts if not host_link_is_up(spec, h)]
    if down:
        raise ClusterError(f"host {down[0]} ({spec.hostname(down[0])}) has no link; run `down`, then `up`")
    job = subprocess.Popen(mpiexec_command(spec, command, places), start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
    held: list = []
    copiers = [threading.Thread(target=_copy_without_launcher, args=(source, sink, held), daemon=True)
               for source, sink in ((job.stdout, sys.stdout), (job.stderr, sys.stderr))]
    for copier in copiers:
        copier.start()
    try:
        code, lost = _watch(job, spec, hosts)
    except BaseException:                       # Ctrl-C (KeyboardInterrupt) or anything else: nothing stays
        _end(job, spec, hosts)
        raise
    finally:
        for copier in copiers:
            copier.join()
    for sink, line in held if not (lost or quiet_launcher) else []:
        sink.buffer.write(line)
        sink.flush()
    return code, lost


def _watch(job: subprocess.Popen, spec: ClusterSpec, hosts: list[int]) -> tuple[int, list[int]]:
    """Wait for the job, polling its hosts' links; a lost link ends it. The links are
    looked at once more after a failed exit: Hydra may end (code 255) on its own, its
    proxy on the lost host gone, before a poll saw the link down."""
    while True:
        try:
            code = job.wait(timeout=WATCH_INTERVAL_S)
        except subprocess.TimeoutExpired:
            code = None
        if code == 0:
            return 0, []
        lost = [h for h in hosts if not host_link_is_up(spec, h)]
        if lost:
            _end(job, spec, hosts)              # the ranks Hydra left on the hosts still up, too
            return 1, lost
        if code is not None:
            return code, []


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies, so a
    killed `run` leaves no mpiexec behind (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)       # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _copy_without_launcher(source, sink, held: list) -> None:
    for line in iter(source.readline, b""):
        if LAUNCHER_LINE.match(line):
            held.append((sink, line))
        else:
            sink.buffer.write(line)
            sink.flush()


def _end(job: subprocess.Popen, spec: ClusterSpec, hosts: list[int]) -> None:
    """Kill mpiexec's session and every process in the job's namespaces."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for host in hosts:
        for slot in range(spec.slots_per_host):
            kill_namespace_processes(spec.slot_namespace(host, slot))
    job.wait()
