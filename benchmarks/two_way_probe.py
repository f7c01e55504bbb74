"""Does a card deliver its shaped rate when it sends and receives at once? Needs root.

    python benchmarks/two_way_probe.py                   # 1, 1/8 and 1/64 of the scaled rate

Two hosts of two ranks, as benchmarks/slow_links.py. Each rank on host 0 sends n bytes to
its partner on host 1 (rank r to r + 2), first one way only, then both ways at once
(Sendrecv: what every step of MPICH's recursive-halving all-reduce does across hosts).
The α-β model of docs/18-across-slow-links.md prices both at n / β per card. TCP needs
its acknowledgements back to keep sending; one way, they return on an idle direction,
both ways they queue behind the other direction's data in the same shaped card. Prints,
per rate and size, the seconds of each (median of --reps) and their ratio, the two-way
efficiency e = t_one_way / t_two_way; writes --out. benchmarks/slow_links.py calls `probe`
at the messages its methods swap, before it predicts.
"""

import argparse
import json
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from cluster_layouts import cluster, scaled_cluster, scaled_rates  # noqa: E402

SIZES = [810_000, 3_240_000]        # a quarter of the default model's gradients (one halving step), all of them


def worker(sizes: list, reps: int, one_way_too: bool, pause: float = 0.0) -> None:
    import numpy as np
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    partner = (world.rank + 2) % 4

    def timed(work):
        times = []
        for _ in range(reps):
            time.sleep(pause)                # the card idles as between two steps' exchanges
            world.Barrier()
            start = time.perf_counter()
            work()
            times.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
        return statistics.median(times)

    for size in sizes:
        send, recv = np.ones(size, np.uint8), np.empty(size, np.uint8)
        row = {"bytes": size, "two_way_s": timed(lambda: world.Sendrecv(send, partner, recvbuf=recv, source=partner))}
        if one_way_too:
            row["one_way_s"] = timed(lambda: world.Send(send, partner) if world.rank < 2 else world.Recv(recv, partner))
            row["efficiency"] = row["one_way_s"] / row["two_way_s"]
        if world.rank == 0:
            print(json.dumps(row), flush=True)


def probe(sizes: list, reps: int, prefix: str, one_way_too: bool = True, pause: float = 0.0) -> list:
    """On the cluster already up under `prefix`: one row per message size."""
    out = cluster("run", "-n", "4", "--", sys.executable, __file__, "--worker", ",".join(map(str, sizes)),
                  "--reps", str(reps), "--pause", str(pause), *(["--one-way"] if one_way_too else []), prefix=prefix)
    return [json.loads(line) for line in out.strip().splitlines() if line.startswith("{")]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=["1", "1/8", "1/64"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--one-way", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pause", type=float, default=0.0, help="seconds each card idles before each exchange")
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    p.add_argument("--prefix", default="npt-probe-")
    p.add_argument("--out", type=Path, default=Path("two_way_probe.json"))
    args = p.parse_args()
    if args.worker:
        return worker([int(n) for n in args.worker.split(",")], args.reps, args.one_way, args.pause)
    from numpitron.plan.devices import load_device
    intra, inter = scaled_rates(load_device("this-machine").peak_flops)
    rows = []
    try:
        for rate in args.rates:
            scaled_cluster(2, 2, inter * float(Fraction(rate)), intra, prefix=args.prefix)
            for row in probe(args.sizes, args.reps, args.prefix, pause=args.pause):
                row = {"rate": rate, "beta_bytes_per_s": inter * float(Fraction(rate)), **row}
                row["model_s"] = row["bytes"] / row["beta_bytes_per_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        cluster("down", prefix=args.prefix, check=False)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
