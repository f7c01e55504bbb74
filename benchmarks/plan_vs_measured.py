"""The planner's predicted step time against the measured one on this machine.

    python benchmarks/calibrate.py          # once (mpiexec -n 2 for the MPI figures)
    python benchmarks/plan_vs_measured.py

For each layout: `benchmarks/benchmark.py` (median ms per iteration, one rank per
core, more ranks oversubscribe the cores) and `python -m numpitron.plan` with the
same flags and --device this-machine. Prints a Markdown table.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LAYOUTS = [(1, []), (2, ["--data-parallel-size", "2"]), (2, ["--tensor-parallel-size", "2"]),
           (2, ["--pipeline-parallel-size", "2", "--global-batch-size", "96"]),
           (2, ["--context-parallel-size", "2"]), (2, ["--data-parallel-size", "2", "--zero-stage", "1"]),
           (4, ["--tensor-parallel-size", "2", "--data-parallel-size", "2"])]


def main():
    print("| ranks | flags | measured ms | predicted ms | predicted / measured |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for ranks, flags in LAYOUTS:
        launch = [str(BIN / "mpiexec"), "-n", str(ranks)] if ranks > 1 else []
        out = subprocess.run(launch + [str(BIN / "python"), "benchmarks/benchmark.py", "--iters", "20", *flags],
                             capture_output=True, text=True, check=True, cwd=REPO).stdout
        measured = json.loads(out.strip().splitlines()[-1])["ms_per_iter_median"]
        planned = subprocess.run([str(BIN / "python"), "-m", "numpitron.plan", "--json", "--devices", str(ranks),
                                  *flags], capture_output=True, text=True, check=True, cwd=REPO).stdout
        predicted = 1e3 * json.loads(planned)["step_s"]
        print(f"| {ranks} | {' '.join(flags) or '(one process)'} | {measured:.1f} | {predicted:.1f} | "
              f"{predicted / measured:.2f} |", flush=True)


if __name__ == "__main__":
    main()
