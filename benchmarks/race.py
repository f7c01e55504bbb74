"""The race to validation loss 1.80 on two cores: numpitron's recipe against PyTorch.

    python benchmarks/race.py --torch-python PATH/TO/python-with-torch [--rounds 1]
    python benchmarks/race.py --torch-python ... --iters 40 --eval-interval 20   (a smoke run)

numpitron runs as a user runs it, `mpiexec -n 2 python train_shakespeare.py --config
configs/race.toml`; PyTorch runs `race_pytorch.py` (eager, 2 threads, AdamW, the
baseline recipe: same model size, data, iterations and evaluations). Each clock starts
when the program is launched, so start-up, data loading and every evaluation count.
The wall time to the target is the moment the first evaluation line with a validation
loss at or below it is printed. A round runs both, one after the other, alternating
which goes first; on a shared machine only a pair from the same session compares.
Prints one JSON object: per program and round, the evaluations (iteration, seconds
since launch, val loss), the time to the target, the final val loss and the total wall
time; and the median ratio numpitron / PyTorch of the times to the target.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EVAL_LINE = re.compile(r"^iter (\d+): train ([0-9.]+), val ([0-9.]+)")


def run_clocked(cmd: list[str], target: float, env: dict) -> dict:
    """Launch `cmd`, timestamp every evaluation line it prints, wait for it."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    evals, reached, tail = [], None, []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        match = EVAL_LINE.match(line.strip())
        if match:
            seconds, val = time.perf_counter() - start, float(match.group(3))
            evals.append({"iter": int(match.group(1)), "seconds": round(seconds, 2), "val": val})
            if reached is None and val <= target:
                reached = seconds
    proc.wait()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + "\n".join(tail))
    return {"evals": evals, "seconds_to_target": None if reached is None else round(reached, 2),
            "final_val": evals[-1]["val"] if evals else None, "wall_s": round(time.perf_counter() - start, 2)}


def commands(args, out_dir: Path) -> dict:
    shorter = ["--max-iters", str(args.iters), "--lr-decay-iters", str(args.iters)] if args.iters else []
    every = ["--eval-interval", str(args.eval_interval)] if args.eval_interval else []
    ours = [str(BIN / "mpiexec"), "-n", "2", str(BIN / "python"), "train_shakespeare.py", "--config", args.config,
            "--data-dir", args.data_dir, "--out-dir", str(out_dir), "--overwrite", "--no-progress", *shorter, *every]
    theirs = [args.torch_python, "benchmarks/race_pytorch.py", "--threads", "2", "--data-dir", args.data_dir,
              *(["--iters", str(args.iters)] if args.iters else []), *every]
    return {"numpitron": ours, "pytorch": theirs}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torch-python", required=True, help="a Python with torch installed (PyTorch's side)")
    p.add_argument("--config", default="configs/race.toml", help="numpitron's recipe")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--target", type=float, default=1.80, help="the validation loss to reach")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--iters", type=int, default=0, help="override both runs' iterations (0: the recipes')")
    p.add_argument("--eval-interval", type=int, default=0, help="override both runs' evaluation interval")
    args = p.parse_args()
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    results = {"numpitron": [], "pytorch": []}
    with tempfile.TemporaryDirectory(prefix="race-") as tmp:
        cmds = commands(args, Path(tmp) / "numpitron")
        for round_ in range(args.rounds):
            order = ["numpitron", "pytorch"] if round_ % 2 == 0 else ["pytorch", "numpitron"]
            for name in order:
                results[name].append(run_clocked(cmds[name], args.target, env))
                print(f"round {round_ + 1}, {name}: {results[name][-1]['seconds_to_target']} s to "
                      f"val <= {args.target}, final val {results[name][-1]['final_val']}", file=sys.stderr, flush=True)
    ratios = [ours["seconds_to_target"] / theirs["seconds_to_target"]
              for ours, theirs in zip(results["numpitron"], results["pytorch"])
              if ours["seconds_to_target"] and theirs["seconds_to_target"]]
    print(json.dumps({"target": args.target, "config": args.config, "commands": cmds, **results,
                      "ratio_to_target_median": round(statistics.median(ratios), 3) if ratios else None}, indent=1))


if __name__ == "__main__":
    main()
