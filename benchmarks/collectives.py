"""Latency and bandwidth of the collectives between the ranks of this machine, and the
alpha-beta model fitted to them.

    mpiexec -n 2 python benchmarks/collectives.py [--out docs/figures/collectives.json]

For message sizes from 8 bytes to 16 MiB, each collective's median time over repeated
calls (every rank starts together). The fit is t = alpha + beta x, with x the bytes one
rank moves under the ring formulas Comm counts (all-reduce 2(n-1)/n of the buffer,
reduce-scatter and all-gather (n-1)/n, send the buffer): alpha the latency, 1/beta the
bandwidth, fitted to relative errors so that small messages weigh as much as large ones.
Prints one JSON object.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(sys.argv)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

SIZES = [8 << s for s in range(0, 22, 3)]      # 8 B .. 16 MiB


def median_s(fn, reps: int) -> float:
    world = MPI.COMM_WORLD
    fn()
    times = []
    for _ in range(reps):
        world.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(world.allreduce(np.median(times), op=MPI.MAX))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    results = {}
    for size in SIZES:
        buf = np.zeros(size // 8)
        out = np.zeros(size // 8)
        part = np.zeros(size // 8 // n) if size // 8 >= n else None
        reps = 50 if size < 1 << 20 else 10
        row = {"all_reduce": median_s(lambda: world.Allreduce(MPI.IN_PLACE, buf), reps)}
        if part is not None:
            row["reduce_scatter"] = median_s(lambda: world.Reduce_scatter_block(buf[:part.size * n], part), reps)
            row["all_gather"] = median_s(lambda: world.Allgather(part, out[:part.size * n]), reps)
        if n >= 2:
            def ping():
                if rank == 0:
                    world.Send(buf, dest=1)
                elif rank == 1:
                    world.Recv(buf, source=0)
            row["send"] = median_s(ping, reps)
        results[size] = row
    moved = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n, "send": 1.0}
    fits = {}
    for kind, factor in moved.items():
        points = [(factor * size, row[kind]) for size, row in results.items() if kind in row]
        x, y = np.array(points).T
        beta, alpha = np.polyfit(x, y, 1, w=1 / y)     # relative errors: small messages count as much as large
        fits[kind] = {"alpha_us": 1e6 * alpha, "bandwidth_gb_s": 1 / beta / 1e9}
    if rank == 0:
        report = {"ranks": n, "seconds": {str(k): v for k, v in results.items()}, "fit": fits,
                  "command": f"mpiexec -n {n} python benchmarks/collectives.py"}
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report["fit"]))


if __name__ == "__main__":
    main()
