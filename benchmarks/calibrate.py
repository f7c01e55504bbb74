"""Measure this machine for the planner and write numpitron/plan/profiles/this-machine.json.

    mpiexec -n 2 python benchmarks/calibrate.py

Per rank, all ranks at once and one BLAS thread each: float32 sgemm (the matmul peak),
the bandwidth NumPy's element-wise kernels reach (c = a * b on arrays far larger than
the caches: 3 arrays' bytes per pass), and between two ranks the latency (an 8-byte
all-reduce) and bandwidth (a 16 MiB send) of MPI. Medians of repeated runs.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(sys.argv)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from numpitron.plan.devices import PROFILES_DIR  # noqa: E402


def median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    world = MPI.COMM_WORLD
    a, b = (np.random.default_rng(i).standard_normal((1024, 1024)).astype(np.float32) for i in range(2))
    out = np.empty_like(a)
    world.Barrier()
    sgemm = 2 * 1024 ** 3 / median_s(lambda: np.matmul(a, b, out=out), 20)
    x, y = (np.random.default_rng(i).standard_normal(8 << 20).astype(np.float32) for i in range(2))
    z = np.empty_like(x)
    world.Barrier()
    bandwidth = 3 * x.nbytes / median_s(lambda: np.multiply(x, y, out=z), 20)
    latency = bw = None
    if world.Get_size() >= 2:
        tiny = np.zeros(1)
        world.Barrier()
        latency = median_s(lambda: world.Allreduce(MPI.IN_PLACE, tiny), 200) / 2
        big = np.zeros(4 << 20, np.float32)
        def ping():
            if world.rank == 0:
                world.Send(big, dest=1)
                world.Recv(big, source=1)
            elif world.rank == 1:
                world.Recv(big, source=0)
                world.Send(big, dest=0)
        world.Barrier()
        bw = 2 * big.nbytes / median_s(ping, 10)
    sgemms = world.gather(sgemm, root=0)
    bandwidths = world.gather(bandwidth, root=0)
    if world.rank != 0:
        return
    profile = {"name": "this-machine", "peak_flops": float(np.median(sgemms)),
               "memory_bandwidth": float(np.median(bandwidths)),
               "memory_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
               "devices_per_node": len(os.sched_getaffinity(0)),
               "intra_latency": latency or 4e-6, "intra_bandwidth": bw or 6e9,
               "inter_latency": latency or 4e-6, "inter_bandwidth": bw or 6e9, "bytes_per_parameter": 0}
    PROFILES_DIR.mkdir(exist_ok=True)
    (PROFILES_DIR / "this-machine.json").write_text(json.dumps(profile, indent=1) + "\n")
    print(json.dumps(profile))


if __name__ == "__main__":
    main()
