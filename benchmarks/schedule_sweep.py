"""The bubble (measured against the formula) and the peak activation memory of every
pipeline schedule, for p = 2 and 4 over several m, as a Markdown table.

    python benchmarks/schedule_sweep.py > /tmp/schedules.md

Each row is one `benchmarks/benchmark.py` run (8 layers, so interleaving with v = 2 and
the V give every chunk whole blocks; micro-batches of 4; medians over --iters
iterations) under mpiexec; m is a multiple of p, which interleaving needs, and the V
schedules run only where m >= 2p - 1. --schedules and --stages pick a part of the table.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1), ("zb-v", 2), ("dualpipev", 2))


def run(p: int, m: int, schedule: str, virtual: int, iters: int) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(p), sys.executable,
           str(REPO / "benchmarks/benchmark.py"), "--pipeline-parallel-size", str(p), "--n-layers", "8",
           "--micro-batch-size", "4", "--global-batch-size", str(4 * m), "--pipeline-schedule", schedule,
           "--virtual-stages", str(virtual), "--iters", str(iters), "--warmup", "2"]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--schedules", nargs="+", default=[name for name, _ in SCHEDULES])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print("| p | m | schedule | bubble measured | bubble formula | peak in flight per stage "
          "| peak activations, stage 0 / max | tokens/s |")
    print("| ---: | ---: | --- | ---: | ---: | --- | --- | ---: |")
    for p in args.stages:
        for m in (p, 2 * p, 4 * p):
            for schedule, virtual in SCHEDULES:
                if schedule not in args.schedules or (schedule in ("zb-v", "dualpipev") and m < 2 * p - 1):
                    continue
                r = run(p, m, schedule, virtual, args.iters)
                act = r["peak_activation_bytes_per_rank"]
                name = schedule + (f", v = {virtual}" if virtual > 1 else "")
                print(f"| {p} | {m} | {name} | {r['pipeline_bubble_measured_median']:.3f} | "
                      f"{r['pipeline_bubble_formula']:.3f} | {r['peak_in_flight_per_rank']} | "
                      f"{act[0] / 2**20:.1f} / {max(act) / 2**20:.1f} MiB | {r['tokens_per_s']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
