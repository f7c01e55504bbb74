"""When does a non-blocking all-to-all finish, if another one starts before its wait? Needs root.

    python benchmarks/a2a_completion_probe.py            # the scaled rate

Two hosts of one rank (benchmarks/a2a_overlap.py's pp1 layout), the all-to-all a pair's
dispatch makes at its wide shape: --bytes each way. Each rank starts all-to-all X,
computes --compute ms with no MPI call (NumPy products: the bytes cross meanwhile), then
waits for X ("alone"); or starts a second all-to-all Y just before that wait, as the
other chunk of a pair does when it hands the turn back ("followed"); or tests X first
and then starts Y ("tested"). Alone, the wait is short: the rows crossed during the
computation. Followed, X's wait lasts about as long as Y's rows take: X is not finished
until Y's bytes have crossed, although its own crossed long before. So in a pair a
chunk that resumes to wait for its rows also waits for the rows the other chunk just
sent, which the planner (plan/a2a_overlap.py) does not price. Prints the median waits
(ms) over --reps and the link's time for the bytes; writes --out.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from cluster_layouts import cluster, link_fit, scaled_cluster, scaled_rates  # noqa: E402

CASES = ("alone", "followed", "tested")


def worker(nbytes: int, compute_ms: float, reps: int) -> None:
    import numpy as np
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rows = nbytes // (4 * 128)
    counts, displs = [rows * 128] * 2, [0, rows * 128]
    a = np.random.default_rng(0).random((256, 256))

    def compute(ms: float) -> None:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            a @ a

    def start():
        send, recv = np.ones((2 * rows, 128), np.float32), np.empty((2 * rows, 128), np.float32)
        return world.Ialltoallv([send, counts, displs, MPI.FLOAT], [recv, counts, displs, MPI.FLOAT]), (send, recv)

    out = {}
    for case in CASES:
        waits = []
        for _ in range(reps + 1):                     # the first is a warm-up
            world.Barrier()
            x, kept = start()
            compute(compute_ms)
            if case == "tested":
                x.Test()                              # MPI hears what arrived before Y's rows go out
            y = start() if case != "alone" else None
            begin = time.perf_counter()
            x.Wait()
            waits.append(1e3 * (time.perf_counter() - begin))
            if y:
                y[0].Wait()
        out[case] = statistics.median(waits[1:])
    if world.rank == 0:
        print(json.dumps({"bytes_each_way": rows * 128 * 4, "compute_ms": compute_ms, "wait_ms": out}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=128_000, help="bytes each rank sends the other")
    p.add_argument("--compute", type=float, default=40.0, help="ms of computation between the start and the wait")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rate", type=float, default=1.0, help="multiple of the scaled inter-host rate")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prefix", default="npt-done-")
    p.add_argument("--out", type=Path, default=Path("a2a_completion_probe.json"))
    args = p.parse_args()
    if args.worker:
        return worker(args.bytes, args.compute, args.reps)
    from numpitron.plan.devices import load_device
    intra, inter = scaled_rates(load_device("this-machine").peak_flops)
    try:
        scaled_cluster(2, 1, inter * args.rate, intra, prefix=args.prefix)
        alpha, beta = link_fit(1, args.prefix)
        out = cluster("run", "-n", "2", "--", sys.executable, __file__, "--worker", "--bytes", str(args.bytes),
                      "--compute", str(args.compute), "--reps", str(args.reps), prefix=args.prefix)
    finally:
        cluster("down", prefix=args.prefix, check=False)
    row = {**json.loads(out.strip().splitlines()[-1]), "rate": args.rate, "alpha_s": alpha, "beta_bytes_s": beta}
    row["link_ms"] = 1e3 * (alpha + row["bytes_each_way"] / beta)
    print(json.dumps(row))
    args.out.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
