"""The planner's predicted step time against the measured one on this machine.

    mpiexec -n 2 python benchmarks/calibrate.py          # once
    python benchmarks/plan_vs_measured.py
    python benchmarks/plan_vs_measured.py --calibrate   # calibrate afresh at every round

For each layout: `benchmarks/benchmark.py` (median ms per iteration, one rank per
core, more ranks oversubscribe the cores) and `python -m numpitron.plan` with the
same flags and --device this-machine. Prints a Markdown table.

This machine's speed drifts by tens of percent from one minute to the next, so each
round runs every layout once, in turn, and the table gives the median over rounds
(--rounds), with the spread of the measured times beside it. With --calibrate each
round first measures the machine again (benchmarks/calibrate.py, which rewrites the
profile) and predicts from that, so that prediction and measurement see the machine
in the same state; the predicted column is then a median over rounds too.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LAYOUTS = [(1, []), (2, ["--data-parallel-size", "2"]), (2, ["--tensor-parallel-size", "2"]),
           (2, ["--pipeline-parallel-size", "2", "--global-batch-size", "96"]),
           (2, ["--context-parallel-size", "2"]), (2, ["--data-parallel-size", "2", "--zero-stage", "1"]),
           (4, ["--tensor-parallel-size", "2", "--data-parallel-size", "2"])]


def measure(ranks: int, flags: list, iters: int) -> float:
    launch = [str(BIN / "mpiexec"), "-n", str(ranks)] if ranks > 1 else []
    out = subprocess.run(launch + [str(BIN / "python"), "benchmarks/benchmark.py", "--iters", str(iters), *flags],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    return json.loads(out.strip().splitlines()[-1])["ms_per_iter_median"]


def predict(ranks: int, flags: list) -> float:
    planned = subprocess.run([str(BIN / "python"), "-m", "numpitron.plan", "--json", "--devices", str(ranks),
                              *flags], capture_output=True, text=True, check=True, cwd=REPO).stdout
    return 1e3 * json.loads(planned)["step_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--calibrate", action="store_true", help="run benchmarks/calibrate.py at the start of every round")
    args = p.parse_args()
    times, predicted = ({i: [] for i in range(len(LAYOUTS))} for _ in range(2))
    for _ in range(args.rounds):
        if args.calibrate:
            subprocess.run([str(BIN / "mpiexec"), "-n", "2", str(BIN / "python"), "benchmarks/calibrate.py"],
                           capture_output=True, check=True, cwd=REPO)
        for i, (ranks, flags) in enumerate(LAYOUTS):
            times[i].append(measure(ranks, flags, args.iters))
            predicted[i].append(predict(ranks, flags))
    print(f"medians of {args.rounds} rounds x {args.iters} iterations")
    print("| ranks | flags | measured ms (min-max) | predicted ms | predicted / measured |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for i, (ranks, flags) in enumerate(LAYOUTS):
        measured, planned = statistics.median(times[i]), statistics.median(predicted[i])
        print(f"| {ranks} | {' '.join(flags) or '(one process)'} | {measured:.1f} ({min(times[i]):.0f}-"
              f"{max(times[i]):.0f}) | {planned:.1f} | {planned / measured:.2f} |", flush=True)


if __name__ == "__main__":
    main()
