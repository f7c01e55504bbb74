"""Bring a cluster up, describe it, take a host off it, tear it down: functions other
code (tests, benchmarks, fault experiments) calls directly; the command line is a thin
layer over them (__main__.py).

A cluster's record lives in STATE_ROOT/<prefix>/cluster.json beside the launcher
script mpiexec uses to reach its hosts (`hop`). The record and the kernel's list of
namespaces are compared on every call: a record whose namespaces are gone, or
namespaces with the prefix and no record (a crash during `up`, a reboot of one half),
is a stale cluster, reported as such and removed by `down`.
"""

import json
import os
import shutil
import stat
from pathlib import Path

from numpitron.cluster.network import (MTU_RANGE, ClusterError, ClusterSpec, create, destroy, existing_namespaces,
                                       kill_namespace_processes, link_counters, parse_rate, set_host_link)

STATE_ROOT = Path(os.environ.get("NUMPITRON_CLUSTER_STATE", "/run/numpitron-cluster"))
DEFAULT_PREFIX = "npt-"


def state_dir(prefix: str) -> Path:
    return STATE_ROOT / prefix.rstrip("-")


def check_privilege() -> None:
    """Creating namespaces needs root (or CAP_NET_ADMIN with CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        raise ClusterError("the cluster needs root (network namespaces, veth links and tc): "
                           "run it with sudo, or as root in CI")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise ClusterError(f"the cluster needs the `{tool}` command (iproute2, util-linux)")


def load(prefix: str = DEFAULT_PREFIX) -> ClusterSpec | None:
    path = state_dir(prefix) / "cluster.json"
    if not path.is_file():
        return None
    try:
        return ClusterSpec(**json.loads(path.read_text()))
    except (ValueError, TypeError) as error:
        raise ClusterError(f"unreadable cluster record {path}: {error}; run `down` to remove it") from None


def stale_reason(prefix: str = DEFAULT_PREFIX) -> str | None:
    """Why the record and the kernel disagree, or None when they agree."""
    spec, present = load(prefix), set(existing_namespaces(prefix))
    if spec is None:
        return f"namespaces {', '.join(sorted(present))} exist without a cluster record" if present else None
    missing = [n for n in spec.namespaces() if n not in present]
    if missing:
        return f"the record lists namespaces that are gone: {', '.join(missing)}"
    extra = present - set(spec.namespaces())
    return f"namespaces not in the record: {', '.join(sorted(extra))}" if extra else None


def up(spec: ClusterSpec) -> ClusterSpec:
    check_privilege()
    if spec.hosts < 1 or spec.ranks_per_host < 1:
        raise ClusterError("--hosts and --ranks-per-host must be positive")
    if spec.hosts > 250 or spec.ranks_per_host > 250:
        raise ClusterError("at most 250 hosts and 250 ranks per host (one address byte each)")
    for rate in (spec.inter_host_rate, spec.intra_host_rate):
        if rate is not None:                # '' too: a rate that reads as none is still refused
            parse_rate(rate)
    if spec.mtu is not None and not MTU_RANGE[0] <= spec.mtu <= MTU_RANGE[1]:
        raise ClusterError(f"--mtu must lie in {MTU_RANGE[0]}..{MTU_RANGE[1]} bytes, got {spec.mtu}")
    reason = stale_reason(spec.prefix)
    if reason:
        raise ClusterError(f"a stale cluster with prefix {spec.prefix!r}: {reason}; run `down` first")
    if load(spec.prefix):
        raise ClusterError(f"a cluster with prefix {spec.prefix!r} is already up; run `down` first")
    create(spec)
    directory = state_dir(spec.prefix)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_hop(spec, directory / "hop")
        (directory / "cluster.json").write_text(json.dumps(spec.to_dict(), indent=1) + "\n")
    except BaseException as error:          # no half cluster: namespaces without a record
        down(spec.prefix)
        if isinstance(error, OSError):
            raise ClusterError(f"cannot write the cluster record in {directory}: {error.strerror or error}") from None
        raise
    return spec


def down(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove the cluster (processes, namespaces, record); safe to call twice."""
    check_privilege()
    removed = destroy(prefix)
    shutil.rmtree(state_dir(prefix), ignore_errors=True)
    return removed


def require(prefix: str = DEFAULT_PREFIX) -> ClusterSpec:
    """The running cluster, or a one-line error saying why there is none."""
    reason = stale_reason(prefix)
    if reason:
        raise ClusterError(f"the cluster with prefix {prefix!r} is stale: {reason}; run `down`, then `up`")
    spec = load(prefix)
    if spec is None:
        raise ClusterError(f"no cluster with prefix {prefix!r} is up; run `python -m numpitron.cluster up` first")
    return spec


def status(prefix: str = DEFAULT_PREFIX) -> str:
    reason, spec = stale_reason(prefix), load(prefix)
    if reason:
        return f"stale: {reason}"
    if spec is None:
        return "down"
    lines = [f"up: {spec.hosts} hosts x {spec.ranks_per_host} ranks, inter-host {spec.inter_host_rate}, frames of {spec.frame_bytes} B, "
             + (f"intra-host {spec.intra_host_rate} (a namespace per rank)" if spec.intra_host_rate
                else "intra-host shared memory (a namespace per host)")]
    for h in range(spec.hosts):
        counters = link_counters(spec, h)
        lines.append(f"  {spec.hostname(h)}: {', '.join(spec.slot_address(h, s) for s in range(spec.slots_per_host))}"
                     f"; link sent {counters['tx_bytes']:,} B, received {counters['rx_bytes']:,} B")
    return "\n".join(lines)


def kill_host(host: int, prefix: str = DEFAULT_PREFIX) -> None:
    """Host `host` fails: its link goes down and its processes are killed."""
    spec = require(prefix)
    if not 0 <= host < spec.hosts:
        raise ClusterError(f"no host {host}: the cluster has hosts 0 to {spec.hosts - 1}")
    set_host_link(spec, host, up=False)
    for slot in range(spec.slots_per_host):
        kill_namespace_processes(spec.slot_namespace(host, slot))


def _write_hop(spec: ClusterSpec, path: Path) -> None:
    """The launcher Hydra calls in place of ssh: `hop [options] HOST COMMAND...` runs
    COMMAND (one shell string, as ssh would) in HOST's namespace under its hostname."""
    cases = "\n".join(f"  {spec.slot_address(h, s)}) ns={spec.slot_namespace(h, s)}; name={spec.hostname(h)};;"
                      for h in range(spec.hosts) for s in range(spec.slots_per_host))
    path.write_text(f"""#!/bin/sh
# Hydra's ssh launcher calls: hop [ssh options] HOST COMMAND...
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
case "$1" in
{cases}
  *) echo "hop: $1 is not a host of this cluster" >&2; exit 255;;
esac
shift
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$*"' "$name" "$@"
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
