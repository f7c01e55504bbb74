"""Small named device profiles for the planner's time model.

`this-machine` is measured here by `python benchmarks/calibrate.py`, which writes
profiles/this-machine.json (the one in the repository was measured on the 2-core
machine the book's figures come from). The GPU nodes are on paper, from public
specifications:

* A100 80 GB SXM (NVIDIA A100 datasheet): 312 TFLOP/s dense bf16, 2.0 TB/s HBM2e;
  NVLink 3, 600 GB/s per GPU in both directions together (300 GB/s each way); a DGX
  A100 node has 8 GPUs and 8 HDR InfiniBand links of 200 Gb/s, 25 GB/s per GPU.
* H100 80 GB SXM (NVIDIA H100 datasheet): 989 TFLOP/s dense bf16, 3.35 TB/s HBM3;
  NVLink 4, 900 GB/s per GPU (450 each way); DGX H100: 8 GPUs, 8 NDR links of
  400 Gb/s, 50 GB/s per GPU.
Latencies are typical orders (a few microseconds in a node, ~10 us across).

The GPUs' exponentials are folded into their element-wise bandwidth (exp_time 0): the
CUDA C++ Programming Guide's throughput table gives 16 base-2 exponentials per clock
per SM on compute capability 8.0 and 9.0, 2.4e12/s on an A100 (108 SMs at 1.41 GHz) and
4.2e12/s on an H100 (132 at 1.98), several times the elements/s HBM delivers. Their call
cost is 0 too: kernel launches are asynchronous and hide behind the previous kernel
when, as at these sizes, kernels run for longer than a launch takes (a few us). Nor
do they have a matmul curve: every matmul runs at the peak.
"""

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from numpitron.errors import UserError

PROFILES_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float          # matmul FLOP/s of one device (rank), in the training dtype
    memory_bandwidth: float    # bytes/s element-wise kernels reach
    memory_bytes: float        # per device
    devices_per_node: int
    intra_latency: float       # seconds per message within a node
    intra_bandwidth: float     # bytes/s one device sends within a node
    inter_latency: float
    inter_bandwidth: float     # bytes/s one device sends to another node
    bytes_per_parameter: int = 0   # 0: the dtype's size (x4: params, grads, m, v); 16: mixed-precision Adam
    # Measured on CPUs only (benchmarks/calibrate.py); the defaults are the GPUs'.
    matmul_curve: tuple = ()       # ((FLOPs of one call, FLOP/s), ...): BLAS by the size of a call
    exp_time: float = 0.0          # seconds per element of np.exp
    call_time: float = 0.0         # seconds per NumPy call (the interpreter's fixed cost)
    cores_per_node: int = 0        # > 0: ranks are processes sharing this many cores of one node
    time_sharing_wait: float = 0.0  # seconds a blocking collective adds when ranks outnumber cores
    slowest_rank: float = 1.0      # a synchronous step's pace on a busy node: the slowest rank's time
    #                                over a rank's own (1: a GPU, or a core no one else disturbs)
    ranks_per_host: int = 0        # > 0: ranks fill hosts of this many in order (a cluster, such as
    #                                numpitron.cluster's), and intra_* / inter_* are the two tiers

    def host_size(self) -> int:
        """Ranks that reach each other over the intra-host tier: ranks_per_host when set,
        else a GPU node's devices, else every rank (one CPU node holds them all)."""
        if self.ranks_per_host:
            return self.ranks_per_host
        return 2**62 if self.cores_per_node else self.devices_per_node

    def full_duplex(self) -> bool:
        """Whether what a rank sends and what it receives travel at once: yes over a
        network card or NVLink (a cluster's links, a GPU's), no through one CPU node's
        shared memory, where the rank's own core makes both copies in turn."""
        return bool(self.ranks_per_host) or not self.cores_per_node

    def matmul_flops(self, size: float) -> float:
        """FLOP/s of a matmul call of `size` FLOPs: the curve, interpolated linearly in
        log(size) and flat beyond its ends; the peak without one."""
        curve = sorted(self.matmul_curve)
        if not curve:
            return self.peak_flops
        if size <= curve[0][0]:
            return curve[0][1]
        for (s0, f0), (s1, f1) in itertools.pairwise(curve):
            if size <= s1:
                x = math.log(size / s0) / math.log(s1 / s0)
                return f0 + x * (f1 - f0)
        return curve[-1][1]

    def pace(self, world: int) -> float:
        """How much longer a step of `world` ranks that wait for each other takes than
        one rank's own work: ranks that lose time at random moments (another job, the
        hypervisor) each make the others wait. One rank waits for no one."""
        return self.slowest_rank if world > 1 else 1.0

    def time_sharing(self, world: int) -> float:
        """How many ranks share each core: a CPU node holds every rank, and with more
        ranks than cores each gets a fraction of one. GPUs: 1."""
        return max(1.0, world / self.cores_per_node) if self.cores_per_node else 1.0


PAPER = {
    "a100-80gb-node": Device("a100-80gb-node", 312e12, 2.0e12, 80e9, 8, 3e-6, 300e9, 10e-6, 25e9, 16),
    "h100-80gb-node": Device("h100-80gb-node", 989e12, 3.35e12, 80e9, 8, 3e-6, 450e9, 10e-6, 50e9, 16),
}


def fit_link(sizes, seconds, ranks: int = 2) -> tuple[float, float]:
    """(alpha, beta) of one tier from all-reduces of `sizes` bytes over `ranks` ranks that
    took `seconds`: least squares of T(x) = 2(n - 1) alpha + 2(n - 1)/n x / beta, each
    point weighted by 1/T so that an 8-byte message counts as much as a megabyte."""
    import numpy as np
    x, t = np.asarray(sizes, float), np.asarray(seconds, float)
    design = np.stack([np.full_like(x, 2 * (ranks - 1)), 2 * (ranks - 1) / ranks * x], axis=1) / t[:, None]
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return float(alpha), float(1 / inverse_beta)


def load_device(name: str) -> Device:
    """A profile by name (the paper ones, then profiles/NAME.json), or by path: only a
    name ending in .json is read as a path, so no name reaches outside profiles/."""
    if name in PAPER:
        return PAPER[name]
    profiles = {p.stem: p for p in PROFILES_DIR.glob("*.json")}
    path = Path(name) if name.endswith(".json") else profiles.get(name)
    if path is None or not path.is_file():
        known = ", ".join(sorted(PAPER) + sorted(profiles))
        raise UserError(f"unknown device {name!r}; choose one of {known}, or give a path ending in .json "
                        f"(benchmarks/calibrate.py writes this-machine)")
    try:
        fields = json.loads(path.read_text())
        fields["matmul_curve"] = tuple(tuple(point) for point in fields.get("matmul_curve", ()))
        return Device(**fields)
    except (ValueError, TypeError) as error:
        raise UserError(f"unreadable device profile {path}: {error}") from None
