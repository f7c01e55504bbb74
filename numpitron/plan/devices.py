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
"""

import json
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


PAPER = {
    "a100-80gb-node": Device("a100-80gb-node", 312e12, 2.0e12, 80e9, 8, 3e-6, 300e9, 10e-6, 25e9, 16),
    "h100-80gb-node": Device("h100-80gb-node", 989e12, 3.35e12, 80e9, 8, 3e-6, 450e9, 10e-6, 50e9, 16),
}


def load_device(name: str) -> Device:
    if name in PAPER:
        return PAPER[name]
    path = PROFILES_DIR / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(PAPER) + sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise UserError(f"unknown device {name!r}; choose one of {known} (benchmarks/calibrate.py writes this-machine)")
    try:
        return Device(**json.loads(path.read_text()))
    except (ValueError, TypeError) as error:
        raise UserError(f"unreadable device profile {path}: {error}") from None
