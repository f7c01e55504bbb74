"""The simulated hosts and their links: Linux network namespaces, veth pairs, bridges
and `tc` token buckets, all created by the `ip` and `tc` commands.

Every name starts with the cluster's prefix (default `npt-`) and every address lies in
10.211.0.0/16 inside the cluster's own namespaces: the machine's own namespace gets
no interface, address or route.

    namespace PREFIXnet (the switch; mpiexec runs here)
        core   bridge, 10.211.0.254/16: the network between hosts
        up<h>  veth, a port of core      <-->  hup<h>, a port of host h's bridge hb<h>
        hb<h>  bridge: host h's own switch
        r<h>-<s> veth, a port of hb<h>    <-->  eth0 in namespace PREFIXh<h> (or PREFIXh<h>s<s>)

The pair up<h>/hup<h> is host h's link to the others: a token bucket on each end
shapes both directions at the inter-host rate, and its counters are the bytes that
crossed hosts. A host is one namespace holding all its ranks, which talk through
shared memory as on a real node and share the host's link like one network card,
unless an intra-host rate is given: then each rank has its own namespace ("slot"),
its veth r<h>-<s> is shaped at that rate, so both tiers of the hierarchy are links
the kernel meters, and the host link is split into a card per rank (shape_per_rank).
"""

import os
import re
import subprocess
from dataclasses import asdict, dataclass

from numpitron.errors import UserError

SUBNET = "10.211"                  # the private /16 every address comes from
SWITCH_ADDRESS = f"{SUBNET}.0.254"
# Frames. Every frame costs the kernel the same work whatever its size, and that work
# runs on the cores that stand for the accelerators (a GPU's network card does it on
# its own): measured here (benchmarks/cluster_frames.py), moving a byte between two
# hosts cost about 15 ns of CPU in 1500-byte frames, 2.5 in 9000 and 0.8 in 65000.
# But a token bucket must hold a whole frame to send it, so a link banks up to two
# frames while it is idle and then sends them at once: large frames on a slow link
# let a message that follows a pause cross for free. The cluster therefore sizes its
# frames to about 1 ms of its slowest link (the bucket's burst, see shape), within
# Ethernet's 1500 and a veth's 65000; --mtu sets it by hand.
MTU, MTU_CEILING = 1500, 65000
MTU_RANGE = (576, 65535)          # what --mtu accepts
# The token buckets queue rather than drop: a dropped segment would be sent again,
# and the bytes a link counts would no longer be the bytes the job sent.
QUEUE_LIMIT_BYTES = 16 * 2**20
# Every frame on a link carries Ethernet (14 bytes; a veth counts no preamble or
# checksum), IPv4 (20) and TCP with the timestamp option (20 + 12) headers: a
# segment holds at most MTU - 52 bytes of what the job sent (1448 at Ethernet's 1500).
FRAME_HEADER_BYTES = 14 + 20 + 32


class ClusterError(UserError):
    """A command the cluster needs failed; the message is one line."""


@dataclass(frozen=True)
class ClusterSpec:
    prefix: str
    hosts: int
    ranks_per_host: int
    inter_host_rate: str            # tc syntax: 200mbit, 1gbit, 25mbps (bytes)
    intra_host_rate: str | None = None
    mtu: int | None = None          # None: about 1 ms of the slowest link (frame_bytes)

    @property
    def switch(self) -> str:
        return f"{self.prefix}net"

    @property
    def frame_bytes(self) -> int:
        """The links' MTU: as given, or 1 ms of the slowest link within 1500..65000."""
        if self.mtu:
            return self.mtu
        slowest = min(parse_rate(r) for r in (self.inter_host_rate, self.intra_host_rate) if r)
        return int(min(MTU_CEILING, max(MTU, slowest / 1000)))

    @property
    def slots_per_host(self) -> int:
        """Namespaces per host: one shared by its ranks, or one per rank."""
        return self.ranks_per_host if self.intra_host_rate else 1

    def slot_namespace(self, host: int, slot: int) -> str:
        return f"{self.prefix}h{host}" + (f"s{slot}" if self.intra_host_rate else "")

    def slot_address(self, host: int, slot: int) -> str:
        return f"{SUBNET}.{host + 1}.{slot + 1}"

    def hostname(self, host: int) -> str:
        return f"{self.prefix}host{host}"

    def namespaces(self) -> list[str]:
        return [self.switch] + [self.slot_namespace(h, s) for h in range(self.hosts)
                                for s in range(self.slots_per_host)]

    def to_dict(self) -> dict:
        return asdict(self)


def run_ip(*args: str, check: bool = True) -> str:
    """Run `ip ...` or `tc ...` (args[0]); a failure is a ClusterError with its stderr."""
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode:
        raise ClusterError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def existing_namespaces(prefix: str) -> list[str]:
    """The namespaces a cluster with this prefix creates (its switch and hosts), and
    no other: the prefix npt- does not claim npt-b-net."""
    names = [line.split()[0] for line in run_ip("ip", "netns", "list").splitlines() if line.strip()]
    mine = re.compile(re.escape(prefix) + r"(net|h[0-9]+(s[0-9]+)?)")
    return sorted(n for n in names if mine.fullmatch(n))


def parse_rate(rate: str) -> float:
    """Bytes per second of a tc rate: bit, kbit, mbit, gbit (bits) or bps, kbps, mbps,
    gbps (bytes), with SI prefixes as tc reads them."""
    match = re.fullmatch(r"([0-9]+(\.[0-9]*)?|\.[0-9]+)\s*([kmgt]?)(bit|bps)", str(rate).strip().lower())
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(3)] if match else 0
    if value < 1:
        raise ClusterError(f"cannot read the rate {rate!r}: write a positive rate, e.g. 200mbit, 1gbit or 25mbps")
    return value / 8 if match.group(4) == "bit" else value


def shape(namespace: str, device: str, rate: str, mtu: int) -> None:
    """A token bucket on the device's egress. Its burst is 1 ms of traffic, and at least
    two frames (a bucket smaller than a frame never sends it), so the rate holds on
    every time scale a step can see."""
    burst = max(2 * (mtu + 14), int(parse_rate(rate) / 1000))
    run_ip("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
           "rate", rate, "burst", str(burst), "limit", str(QUEUE_LIMIT_BYTES))


def shape_per_rank(namespace: str, device: str, rate: str, mtu: int, addresses: list[str], match: str) -> None:
    """The host link as one card per rank, as a DGX gives each GPU its own InfiniBand
    card: an htb class for each rank's address (`match`: src on the way out of the
    host, dst on the way in), each at rate / ranks and never borrowing from the
    others. A rank whose peers are quiet still gets only its own share, so a ring or
    a pipeline that crosses hosts from one rank of a host goes at one card's speed,
    which is what the planner charges. Frames of no rank (ARP) use the first class."""
    share = f"{int(parse_rate(rate) * 8 / len(addresses))}bit"
    burst = str(max(2 * (mtu + 14), int(parse_rate(share) / 1000)))
    tc = ("ip", "netns", "exec", namespace, "tc")
    run_ip(*tc, "qdisc", "replace", "dev", device, "root", "handle", "1:", "htb", "default", "1")
    for slot, address in enumerate(addresses, start=1):
        run_ip(*tc, "class", "add", "dev", device, "parent", "1:", "classid", f"1:{slot}", "htb", "rate", share,
               "ceil", share, "burst", burst, "cburst", burst)
        run_ip(*tc, "qdisc", "add", "dev", device, "parent", f"1:{slot}", "bfifo", "limit", str(QUEUE_LIMIT_BYTES))
        run_ip(*tc, "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "ip", match, f"{address}/32", "flowid", f"1:{slot}")


def _veth(switch: str, name: str, peer: str, peer_namespace: str, mtu: int) -> None:
    run_ip("ip", "-n", switch, "link", "add", name, "mtu", str(mtu), "type", "veth",
           "peer", "name", peer, "netns", peer_namespace, "mtu", str(mtu))
    for namespace, device in ((switch, name), (peer_namespace, peer)):
        # One TCP segment per packet, so the counters see wire-sized frames
        # (segmentation offload would hand a veth 64 KiB at once).
        run_ip("ip", "-n", namespace, "link", "set", device, "gso_max_segs", "1", "gso_max_size", str(mtu))


def _up(namespace: str, *devices: str) -> None:
    for device in devices:
        run_ip("ip", "-n", namespace, "link", "set", device, "up")


def create(spec: ClusterSpec) -> None:
    """Build the whole network of `spec`. On any failure, remove what was made."""
    try:
        for namespace in spec.namespaces():
            run_ip("ip", "netns", "add", namespace)
            # IPv6 would announce itself on every link (router solicitations, MLD):
            # bytes no job sent. The cluster speaks IPv4 only.
            for scope in ("all", "default"):
                run_ip("ip", "netns", "exec", namespace, "sysctl", "-q", "-w", f"net.ipv6.conf.{scope}.disable_ipv6=1")
            run_ip("ip", "netns", "exec", namespace, "sysctl", "-q", "-w", "net.ipv4.tcp_timestamps=1")
            _up(namespace, "lo")
        sw = spec.switch
        run_ip("ip", "-n", sw, "link", "add", "core", "mtu", str(spec.frame_bytes), "type", "bridge")
        run_ip("ip", "-n", sw, "addr", "add", f"{SWITCH_ADDRESS}/16", "dev", "core")
        _up(sw, "core")
        for h in range(spec.hosts):
            run_ip("ip", "-n", sw, "link", "add", f"hb{h}", "mtu", str(spec.frame_bytes), "type", "bridge")
            _veth(sw, f"up{h}", f"hup{h}", sw, spec.frame_bytes)
            run_ip("ip", "-n", sw, "link", "set", f"up{h}", "master", "core")
            run_ip("ip", "-n", sw, "link", "set", f"hup{h}", "master", f"hb{h}")
            _up(sw, f"hb{h}", f"up{h}", f"hup{h}")
            if spec.intra_host_rate:           # a rank per namespace: a card per rank
                addresses = [spec.slot_address(h, s) for s in range(spec.slots_per_host)]
                shape_per_rank(sw, f"up{h}", spec.inter_host_rate, spec.frame_bytes, addresses, "dst")
                shape_per_rank(sw, f"hup{h}", spec.inter_host_rate, spec.frame_bytes, addresses, "src")
            else:
                shape(sw, f"up{h}", spec.inter_host_rate, spec.frame_bytes)       # towards host h
                shape(sw, f"hup{h}", spec.inter_host_rate, spec.frame_bytes)      # from host h
            for s in range(spec.slots_per_host):
                namespace = spec.slot_namespace(h, s)
                _veth(sw, f"r{h}-{s}", "eth0", namespace, spec.frame_bytes)
                run_ip("ip", "-n", sw, "link", "set", f"r{h}-{s}", "master", f"hb{h}")
                run_ip("ip", "-n", namespace, "addr", "add", f"{spec.slot_address(h, s)}/16", "dev", "eth0")
                _up(sw, f"r{h}-{s}")
                _up(namespace, "eth0")
                if spec.intra_host_rate:
                    shape(sw, f"r{h}-{s}", spec.intra_host_rate, spec.frame_bytes)
                    shape(namespace, "eth0", spec.intra_host_rate, spec.frame_bytes)
    except BaseException:                   # a failed command, Ctrl-C, a bug: nothing stays behind
        destroy(spec.prefix)
        raise


def namespace_pids(namespace: str) -> list[int]:
    out = run_ip("ip", "netns", "pids", namespace, check=False)
    return [int(p) for p in out.split()]


def kill_namespace_processes(namespace: str, signal: int = 9) -> None:
    for pid in namespace_pids(namespace):
        try:
            os.kill(pid, signal)
        except ProcessLookupError:
            pass


def destroy(prefix: str) -> list[str]:
    """Kill the processes in every namespace named with `prefix` and delete them
    (their veths and bridges go with them). Idempotent; returns what it removed."""
    removed = existing_namespaces(prefix)
    for namespace in removed:
        kill_namespace_processes(namespace)
    for namespace in removed:
        run_ip("ip", "netns", "delete", namespace, check=False)
    return removed


def link_counters(spec: ClusterSpec, host: int) -> dict:
    """Bytes and packets host `host` sent (tx) and received (rx) over its link to
    the other hosts, read in the switch namespace (hup<h> faces the host)."""
    # hup<h> is the host bridge's port: what it transmits leaves host h (the bridge
    # forwards the host's frames out through it), what it receives arrives there.
    files = [f"/sys/class/net/hup{host}/statistics/{key}_{unit}" for key in ("tx", "rx") for unit in ("bytes", "packets")]
    values = run_ip("ip", "netns", "exec", spec.switch, "cat", *files).split()
    return dict(zip(("tx_bytes", "tx_packets", "rx_bytes", "rx_packets"), map(int, values)))


def set_host_link(spec: ClusterSpec, host: int, up: bool) -> None:
    """Plug host `host`'s cable in or out (both ends of its link)."""
    state = "up" if up else "down"
    run_ip("ip", "-n", spec.switch, "link", "set", f"up{host}", state)
    run_ip("ip", "-n", spec.switch, "link", "set", f"hup{host}", state)


def host_link_is_up(spec: ClusterSpec, host: int) -> bool:
    text = run_ip("ip", "-n", spec.switch, "-o", "link", "show", f"up{host}", check=False)
    return "state UP" in text or ",UP" in text.split(">")[0]
