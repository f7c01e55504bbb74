"""Every figure of the book, from real runs on this machine: `make figures`.

    pip install -e ".[docs]"         # matplotlib
    python benchmarks/figures.py [--data-dir data] [--quick]

Writes docs/figures/*.svg and docs/figures/figures.json (the numbers behind them). Each
figure names the command that made it and the machine it ran on. --quick runs fewer
iterations (for trying the script; the committed figures are full runs).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FIGURES = REPO / "docs" / "figures"
LAYOUTS = [("one process", 1, []), ("dp = 2", 2, ["--data-parallel-size", "2"]),
           ("tp = 2", 2, ["--tensor-parallel-size", "2"]),
           ("pp = 2", 2, ["--pipeline-parallel-size", "2"]),
           ("cp = 2", 2, ["--context-parallel-size", "2"]),
           ("dp = 2, ZeRO-1", 2, ["--data-parallel-size", "2", "--zero-stage", "1"]),
           ("tp = 2, sp", 2, ["--tensor-parallel-size", "2", "--sequence-parallel"])]


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return f"{cpu}, {os.cpu_count()} cores"


def launch(ranks: int, script: str, args: list) -> list:
    prefix = [str(BIN / "mpiexec"), "-n", str(ranks)] if ranks > 1 else []
    return prefix + [str(BIN / "python"), script, *args]


def run_json(cmd: list) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
    return json.loads(out.strip().splitlines()[-1])


def caption(ax, text: str) -> None:
    ax.figure.text(0.01, 0.005, f"{text}\n{machine()}", fontsize=6, color="#555555", va="bottom")


def loss_curves(plt, data_dir: Path, iters: int) -> dict:
    """The same training on several layouts: the curves lie on each other."""
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, ranks, flags in LAYOUTS[:5]:
            out = Path(tmp) / label.replace(" ", "")
            subprocess.run(launch(ranks, "train_shakespeare.py", flags + [
                "--max-iters", str(iters), "--log-interval", "5", "--eval-interval", str(iters), "--eval-iters", "5",
                "--global-batch-size", "12", "--micro-batch-size", "6" if "--data-parallel-size" in flags else "12",
                "--data-dir", str(data_dir), "--out-dir", str(out), "--no-progress"]),
                check=True, cwd=REPO, capture_output=True)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            curves[label] = [(r["iter"], r["train_loss"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, points in curves.items():
        ax.plot(*zip(*points), label=label, lw=1.2)
    ax.set(xlabel="iteration", ylabel="training loss", title="Every layout trains the same model")
    ax.legend()
    caption(ax, f"python benchmarks/figures.py: train_shakespeare.py, default model, float32, batch 12, {iters} iterations")
    fig.savefig(FIGURES / "loss_curves.svg", bbox_inches="tight")
    return curves


def bubble(plt, iters: int) -> dict:
    sweep = {}
    for schedule in ("1f1b", "gpipe"):
        for m in (1, 2, 4, 8, 16):
            result = run_json(launch(2, "benchmarks/benchmark.py", [
                "--pipeline-parallel-size", "2", "--pipeline-schedule", schedule, "--micro-batch-size", "4",
                "--global-batch-size", str(4 * m), "--iters", str(iters), "--warmup", "3"]))
            sweep.setdefault(schedule, []).append((m, result["pipeline_bubble_measured_median"],
                                                   result["pipeline_bubble_formula"]))
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for schedule, points in sweep.items():
        ms, measured, formula = zip(*points)
        ax.plot(ms, measured, "o-", label=f"{schedule}, measured")
    ax.plot(ms, formula, "k--", label="(p-1)/(m+p-1)")
    ax.set(xscale="log", xlabel="micro-batches m", ylabel="bubble (idle share)", title="The bubble of a 2-stage pipeline")
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.legend()
    caption(ax, "mpiexec -n 2 python benchmarks/benchmark.py --pipeline-parallel-size 2 --micro-batch-size 4 "
                "--global-batch-size 4m")
    fig.savefig(FIGURES / "bubble.svg", bbox_inches="tight")
    return sweep


def layouts(plt, iters: int) -> dict:
    """Throughput per layout, and bytes per collective kind against the planner's formula."""
    results = {}
    for label, ranks, flags in LAYOUTS:
        args = flags + ["--iters", str(iters), "--warmup", "3"]
        if "--pipeline-parallel-size" in flags:
            args += ["--global-batch-size", "96"]
        measured = run_json(launch(ranks, "benchmarks/benchmark.py", args))
        planned = run_json([str(BIN / "python"), "-m", "numpitron.plan", "--json", "--devices", str(ranks),
                            *[a for a in args if a not in ("--iters", "--warmup", str(iters), "3")]])
        results[label] = {"tokens_per_s": measured["tokens_per_s"], "global_batch": measured["mesh"]["global_batch"],
                          "bytes": measured["comm_bytes_per_iter_by_kind"],
                          "planned_bytes": planned["stages"][0]["comm_bytes"]}
    fig, ax = plt.subplots(figsize=(6.4, 4))
    labels = list(results)
    ax.barh(labels, [results[k]["tokens_per_s"] for k in labels], color="#4c78a8")
    ax.set(xlabel="tokens/s", title="Throughput per layout, default model")
    caption(ax, "python benchmarks/benchmark.py under mpiexec -n 1 or 2; pp = 2 at global batch 96 (m = 8)")
    fig.savefig(FIGURES / "throughput.svg", bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(6.4, 4.5))
    rows = [(f"{label}: {kind}", data["bytes"][kind], data["planned_bytes"].get(kind, 0))
            for label, data in results.items() for kind in sorted(data["bytes"]) if data["bytes"][kind] > 100]
    names, measured, planned = zip(*rows)
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [m / 1e6 for m in measured], height=0.4, label="measured (CommStats)")
    ax.barh([i - 0.2 for i in y], [p / 1e6 for p in planned], height=0.4, label="formula (planner)")
    ax.set_yticks(list(y), names, fontsize=7)
    ax.set(xlabel="MB per iteration (stage 0)", title="Bytes per collective: measured and formula")
    ax.legend()
    caption(ax, "benchmarks/benchmark.py against python -m numpitron.plan with the same flags")
    fig.savefig(FIGURES / "bytes.svg", bbox_inches="tight")
    return results


def memory(plt) -> dict:
    """Bytes per rank for ZeRO stages 0-3 at dp = 2 and 4, measured by real runs (the
    optimizers' `memory_bytes`; tests/test_plan.py checks the planner against them)."""
    sizes = {}
    for dp in (2, 4):
        for zero in (0, 1, 2, 3):
            result = run_json(launch(dp, "benchmarks/benchmark.py", ["--data-parallel-size", str(dp), "--zero-stage",
                                                                     str(zero), "--iters", "2"]))
            sizes[f"ZeRO-{zero}, dp = {dp}"] = result["memory_bytes_per_rank"][0]
    parts = {"params": "parameters", "grads": "gradients", "optimizer_state": "Adam m and v",
             "gathered_params_peak": "gathered layers (peak)", "backward_grads_peak": "whole gradients (peak)"}
    fig, ax = plt.subplots(figsize=(6.4, 4))
    labels, bottom = list(sizes), [0.0] * len(sizes)
    for part, label in parts.items():
        values = [sizes[k][part] / 1e6 for k in labels]
        ax.barh(labels, values, left=bottom, label=label, hatch="//" if "peak" in part else None)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.invert_yaxis()
    ax.set(xlabel="MB per rank (hatched: only during a pass)", title="What each rank stores, by ZeRO stage")
    ax.legend(fontsize=7)
    caption(ax, "mpiexec -n dp python benchmarks/benchmark.py --data-parallel-size dp --zero-stage z "
                "(default model, float32): memory_bytes_per_rank")
    fig.savefig(FIGURES / "memory_zero.svg", bbox_inches="tight")
    return sizes


def context_parallel_blocks() -> dict:
    """Which chunk pairs each rank computes, zigzag against a plain split (docs/13)."""
    return run_json(launch(4, "benchmarks/context_parallel.py", ["--seq-len", "1024"]))


def routing(data_dir: Path, iters: int) -> dict:
    """Tokens per expert and the dropped share over a mixture-of-experts run (docs/14)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(launch(1, "train_shakespeare.py", [
            "--num-experts", "4", "--moe-top-k", "1", "--moe-capacity-factor", "1.25", "--max-iters", str(iters),
            "--data-dir", str(data_dir), "--out-dir", tmp, "--no-progress"]), check=True, cwd=REPO, capture_output=True)
        return run_json(launch(1, "benchmarks/experts.py", ["routing", str(Path(tmp) / "metrics.jsonl")]))


def race(plt) -> dict:
    """Validation loss against wall time since launch, each program and round of the
    race to 1.80 (docs/16), from the race's own run: benchmarks/race.py writes
    docs/figures/race.json (`--out`), which takes tens of minutes on two cores, so this
    draws the stored run rather than racing again."""
    runs = json.loads((FIGURES / "race.json").read_text())
    fig, ax = plt.subplots(figsize=(6.4, 4))
    colours = {"numpitron": "#4c78a8", "pytorch": "#e45756"}
    for name in ("numpitron", "pytorch"):
        for round_, run in enumerate(runs[name]):
            points = [(e["seconds"], e["val"]) for e in run["evals"]]
            label = f"{name} (Muon, dp = 2)" if name == "numpitron" else f"{name} (AdamW, 2 threads)"
            ax.plot(*zip(*points), "o-" if round_ == 0 else "s--", color=colours[name], ms=3, lw=1.2,
                    label=f"{label}, round {round_ + 1}" + (" (cut short)" if run.get("running") else ""))
    ax.axhline(runs["target"], color="k", lw=0.8, ls=":")
    ax.set(xlabel="seconds since launch (evaluations included)", ylabel="validation loss",
           title=f"The race to val {runs['target']:.2f} on two cores")
    ax.legend(fontsize=7)
    caption(ax, "python benchmarks/race.py --torch-python ... --rounds 2 --stop-at-target --out docs/figures/race.json "
                "(a shared machine: see the load average in race.json)")
    fig.savefig(FIGURES / "race.svg", bbox_inches="tight")
    return {name: [run.get("seconds_to_target") for run in runs[name]] for name in ("numpitron", "pytorch")}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="data")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["memory_zero", "race"], help="make this figure alone (figures.json keeps the rest)")
    args = p.parse_args()
    import matplotlib
    matplotlib.use("svg")
    import matplotlib.pyplot as plt
    FIGURES.mkdir(parents=True, exist_ok=True)
    if args.only:
        data = json.loads((FIGURES / "figures.json").read_text())
        data[args.only] = {"memory_zero": memory, "race": race}[args.only](plt)
        (FIGURES / "figures.json").write_text(json.dumps(data, indent=1) + "\n")
        return
    iters = 5 if args.quick else 20
    data = {"machine": machine(), "loss_curves": loss_curves(plt, Path(args.data_dir).resolve(), 40 if args.quick else 300),
            "bubble": bubble(plt, iters), "layouts": layouts(plt, iters), "memory_zero": memory(plt)}
    subprocess.run(launch(2, "benchmarks/pipeline_timeline.py", ["--out", "docs/pipeline_timeline.svg"]),
                   check=True, cwd=REPO, capture_output=True)
    subprocess.run(launch(1, "benchmarks/pipeline_timeline.py", ["--ideal", "4", "--out", "docs/pipeline_ideal.svg"]),
                   check=True, cwd=REPO, capture_output=True)
    data["context_parallel_blocks"] = context_parallel_blocks()
    data["routing"] = routing(Path(args.data_dir).resolve(), 200 if args.quick else 2000)
    data["race"] = race(plt)
    (FIGURES / "figures.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {', '.join(sorted(p.name for p in FIGURES.glob('*.svg')))} and figures.json in {FIGURES}")


if __name__ == "__main__":
    main()
