"""The race to validation loss 1.80 on two cores: numpitron against PyTorch, first with
the same recipe, then each with its own.

    python benchmarks/race.py --torch-python PATH/TO/python-with-torch [--rounds 3]
    python benchmarks/race.py --torch-python ... --iters 40 --eval-interval 20       (a smoke run)
    python benchmarks/race.py --torch-python ... --rounds 3 --blas numpy mkl --stop-at-target --out race.json

numpitron runs as a user runs it, `mpiexec -n 2 python train_shakespeare.py --config
configs/race.toml` (with each --blas asked for). PyTorch (`race_pytorch.py`, eager, two
threads, the same GPT, data and evaluations) runs twice:

* equal recipe, the engine against the engine: the recipe of configs/race.toml, read from
  the file (Muon on the blocks' matrices as numpitron's --optimizer muon, AdamW on the
  rest, its learning rates, warm-up, cosine, clipping, batch and evaluations);
* nanoGPT's recipe, what a nanoGPT user would gain: AdamW at 1e-3, cosine over 5,000.

Each clock starts when the program is launched, so start-up, data loading and every
evaluation count. The time to the target is the moment the first evaluation line with a
validation loss at or below it is printed. A round runs every program once, in an order
reversed each round; on a shared machine only runs of the same round compare, so each
ratio (numpitron's time over PyTorch's) is taken within a round, and the JSON gives their
median and range. With --stop-at-target each program is stopped at its first evaluation
at or below the target. The JSON (rewritten to --out after every run, so a long race
stopped early keeps what it measured) holds, per program and round, the evaluations
(iteration, seconds since launch, val loss, 1-minute load average), the time to the
target, the final val loss, the wall time and the load average before and after.
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
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))
from numpitron.runtime import launch_env  # noqa: E402
EVAL_LINE = re.compile(r"^iter (\d+): train ([0-9.]+), val ([0-9.]+)")
RECIPES = ("equal", "nanogpt")


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


def equal_recipe(config: str) -> dict:
    """configs/race.toml's recipe as race_pytorch.py's flags: its [model] and [training]
    values, numpitron's defaults (config.py) for what the file leaves out."""
    sys.path.insert(0, str(REPO))
    from numpitron.config import ModelConfig, TrainConfig
    with open(REPO / config, "rb") as f:
        spec = tomllib.load(f)
    model, train = {**vars(ModelConfig()), **spec.get("model", {})}, {**vars(TrainConfig()), **spec.get("training", {})}
    if train["optimizer"] not in ("adamw", "muon") or train["muon_lr"] not in (0, train["lr"]):
        raise SystemExit(f"{config}: race_pytorch.py takes AdamW or Muon at --lr, not {train['optimizer']} "
                         f"with muon_lr {train['muon_lr']}")
    return {"n-layers": model["n_layers"], "n-heads": model["n_heads"], "d-model": model["d_model"],
            "seq-len": model["seq_len"], "batch": train["global_batch_size"] or train["micro_batch_size"] * 2,
            "iters": train["max_iters"], "warmup": train["warmup_iters"],
            "lr-decay-iters": train["lr_decay_iters"] or train["max_iters"], "lr": train["lr"],
            "min-lr": train["min_lr"], "weight-decay": train["weight_decay"], "beta1": train["beta1"],
            "beta2": train["beta2"], "grad-clip": train["grad_clip"], "muon-momentum": train["muon_momentum"],
            "optimizer": train["optimizer"], "eval-interval": train["eval_interval"],
            "eval-iters": train["eval_iters"], "seed": train["seed"]}


def commands(args, out_dir: Path) -> dict:
    """name -> command: numpitron per --blas, PyTorch per recipe."""
    shorter = ["--max-iters", str(args.iters), "--lr-decay-iters", str(args.iters)] if args.iters else []
    every = ["--eval-interval", str(args.eval_interval)] if args.eval_interval else []
    runs = {f"numpitron, blas {blas}": [str(BIN / "mpiexec"), "-n", "2", str(BIN / "python"), "train_shakespeare.py",
                                        "--config", args.config, "--data-dir", args.data_dir, "--out-dir",
                                        str(out_dir / blas), "--overwrite", "--no-progress", "--blas", blas,
                                        *shorter, *every]
            for blas in args.blas}
    torch = [args.torch_python, "benchmarks/race_pytorch.py", "--threads", "2", "--data-dir", args.data_dir]
    if "equal" in args.races:
        recipe = {**equal_recipe(args.config), **({"iters": args.iters, "lr-decay-iters": args.iters}
                                                   if args.iters else {}),
                  **({"eval-interval": args.eval_interval} if args.eval_interval else {})}
        runs["pytorch, equal recipe"] = torch + [f"--{k}={v}" for k, v in recipe.items()]
    if "nanogpt" in args.races:
        runs["pytorch, nanoGPT recipe"] = torch + (["--iters", str(args.iters)] if args.iters else []) + every
    return runs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torch-python", required=True, help="a Python with torch installed (PyTorch's side)")
    p.add_argument("--config", default="configs/race.toml", help="numpitron's recipe, and the equal race's")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--target", type=float, default=1.80, help="the validation loss to reach")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--races", nargs="+", choices=RECIPES, default=list(RECIPES), help="PyTorch's recipes")
    p.add_argument("--nanogpt-rounds", type=int, default=None, help="run nanoGPT's recipe in the first N rounds only")
    p.add_argument("--blas", nargs="+", choices=["numpy", "mkl", "auto"], default=["numpy"],
                   help="numpitron's --blas, one run each per round")
    p.add_argument("--iters", type=int, default=0, help="override every run's iterations (0: the recipes')")
    p.add_argument("--eval-interval", type=int, default=0, help="override every run's evaluation interval")
    p.add_argument("--out", help="also write the JSON here, after every run")
    p.add_argument("--stop-at-target", action="store_true", help="stop each program when it reaches the target")
    args = p.parse_args()
    env = {**launch_env(2), "OPENBLAS_NUM_THREADS": "1"}     # no yield a shell set: the library decides it
    with tempfile.TemporaryDirectory(prefix="race-") as tmp:
        cmds = commands(args, Path(tmp))
        results = {name: [] for name in cmds}
        for round_ in range(args.rounds):
            names = [n for n in cmds if "nanoGPT" not in n or args.nanogpt_rounds is None or round_ < args.nanogpt_rounds]
            for name in names if round_ % 2 == 0 else names[::-1]:
                def progress(evals, name=name):        # a run cut short still leaves its curve
                    if args.out:
                        running = {**results, name: results[name] + [{"round": round_, "evals": evals, "running": True}]}
                        Path(args.out).write_text(summary(args, cmds, running) + "\n")
                run = {"round": round_, **run_clocked(cmds[name], args.target, env, args.stop_at_target, progress)}
                results[name].append(run)
                print(f"round {round_ + 1}, {name}: {run['seconds_to_target']} s to val <= {args.target}, "
                      f"final val {run['final_val']}, load {run['load_before']} -> {run['load_after']}",
                      file=sys.stderr, flush=True)
                report = summary(args, cmds, results)
                if args.out:
                    Path(args.out).write_text(report + "\n")
    print(report)


def summary(args, cmds: dict, results: dict) -> str:
    """The race's JSON: every run, and per numpitron BLAS and PyTorch recipe the ratios of
    the times to the target (numpitron's over PyTorch's) of the rounds both reached it."""
    ratios = {}
    for ours in (n for n in results if n.startswith("numpitron")):
        for theirs in (n for n in results if n.startswith("pytorch")):
            by_round = {r["round"]: r.get("seconds_to_target") for r in results[theirs]}
            pairs = [r["seconds_to_target"] / by_round[r["round"]] for r in results[ours]
                     if r.get("seconds_to_target") and by_round.get(r["round"])]
            ratios[f"{ours} / {theirs}"] = ({"median": round(statistics.median(pairs), 3), "min": round(min(pairs), 3),
                                             "max": round(max(pairs), 3), "rounds": len(pairs)} if pairs else None)
    return json.dumps({"target": args.target, "config": args.config, "commands": cmds, "runs": results,
                       "ratio_to_target": ratios}, indent=1)


if __name__ == "__main__":
    main()
