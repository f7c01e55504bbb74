"""The race to validation loss 1.80 on two cores: numpitron's recipe against PyTorch.

    python benchmarks/race.py --torch-python PATH/TO/python-with-torch [--rounds 1]
    python benchmarks/race.py --torch-python ... --iters 40 --eval-interval 20   (a smoke run)
    python benchmarks/race.py --torch-python ... --rounds 4 --stop-at-target --out race.json

numpitron runs as a user runs it, `mpiexec -n 2 python train_shakespeare.py --config
configs/race.toml`; PyTorch runs `race_pytorch.py` (eager, 2 threads, AdamW, the
baseline recipe: same model size, data, iterations and evaluations). Each clock starts
when the program is launched, so start-up, data loading and every evaluation count.
The wall time to the target is the moment the first evaluation line with a validation
loss at or below it is printed. A round runs both, one after the other, alternating
which goes first; on a shared machine only a pair from the same session compares.
With --stop-at-target each program is stopped at its first evaluation at or below the
target (the race's end; its final val loss is then that evaluation's), which on a busy
machine halves the time a round takes. Prints one JSON object (and rewrites it to `--out` after every run, so a long race
stopped early keeps what it measured): per program and round, the evaluations
(iteration, seconds since launch, val loss, 1-minute load average), the time to the target, the final val loss,
the total wall time and the machine's 1-minute load average before and after the run
(on a shared machine it says how much else was running); and the median ratio
numpitron / PyTorch of the times to the target.
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EVAL_LINE = re.compile(r"^iter (\d+): train ([0-9.]+), val ([0-9.]+)")


def run_clocked(cmd: list[str], target: float, env: dict, stop_at_target: bool = False, progress=None) -> dict:
    """Launch `cmd`, timestamp every evaluation line it prints, wait for it (or stop it,
    all its processes, at the target). `progress(evals)` is called after each evaluation."""
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    evals, reached, tail = [], None, []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        match = EVAL_LINE.match(line.strip())
        if match:
            seconds, val = time.perf_counter() - start, float(match.group(3))
            evals.append({"iter": int(match.group(1)), "seconds": round(seconds, 2), "val": val,
                          "load": round(os.getloadavg()[0], 2)})
            if progress:
                progress(evals)
            if reached is None and val <= target:
                reached = seconds
                if stop_at_target:
                    os.killpg(proc.pid, signal.SIGTERM)
                    break
    proc.wait()
    if proc.returncode and reached is None:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + "\n".join(tail))
    return {"evals": evals, "seconds_to_target": None if reached is None else round(reached, 2),
            "final_val": evals[-1]["val"] if evals else None, "wall_s": round(time.perf_counter() - start, 2),
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}


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
    p.add_argument("--out", help="also write the JSON here, after every run")
    p.add_argument("--first", choices=["numpitron", "pytorch"], default="numpitron", help="who runs first in round 1")
    p.add_argument("--stop-at-target", action="store_true", help="stop each program when it reaches the target")
    args = p.parse_args()
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    results = {"numpitron": [], "pytorch": []}
    with tempfile.TemporaryDirectory(prefix="race-") as tmp:
        cmds = commands(args, Path(tmp) / "numpitron")
        for round_ in range(args.rounds):
            order = ["numpitron", "pytorch"] if (round_ + (args.first == "pytorch")) % 2 == 0 else ["pytorch", "numpitron"]
            for name in order:
                def progress(evals, name=name):        # a run cut short still leaves its curve
                    if args.out:
                        running = {**results, name: results[name] + [{"evals": evals, "running": True}]}
                        Path(args.out).write_text(summary(args, cmds, running) + "\n")
                results[name].append(run_clocked(cmds[name], args.target, env, args.stop_at_target, progress))
                run = results[name][-1]
                print(f"round {round_ + 1}, {name}: {run['seconds_to_target']} s to val <= {args.target}, "
                      f"final val {run['final_val']}, load {run['load_before']} -> {run['load_after']}",
                      file=sys.stderr, flush=True)
                report = summary(args, cmds, results)
                if args.out:
                    Path(args.out).write_text(report + "\n")
    print(report)


def summary(args, cmds: dict, results: dict) -> str:
    """The race's JSON: every run, and the median over rounds of numpitron's time to the
    target divided by PyTorch's in the same round."""
    ratios = [ours["seconds_to_target"] / theirs["seconds_to_target"]
              for ours, theirs in zip(results["numpitron"], results["pytorch"])
              if ours.get("seconds_to_target") and theirs.get("seconds_to_target")]
    return json.dumps({"target": args.target, "config": args.config, "commands": cmds, **results,
                       "ratio_to_target_median": round(statistics.median(ratios), 3) if ratios else None}, indent=1)


if __name__ == "__main__":
    main()
