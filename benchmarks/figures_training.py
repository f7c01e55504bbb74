"""The figures of the core chapters, each from runs of train_shakespeare.py or
benchmark.py on this machine: the same loss on every layout, the pipeline's bubble,
throughput per layout and ZeRO's memory. benchmarks/figures.py calls them."""

import json
import subprocess
import tempfile
from pathlib import Path

from figures_common import BIN, FIGURES, LAYOUTS, REPO, caption, launch, run_json


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
    """The bubble of a 2-stage pipeline against m, measured and by formula: the figure and
    chapter 5's table (`--tables`) both come from this one sweep."""
    sweep = {}
    for schedule in ("1f1b", "gpipe"):
        for m in (1, 2, 4, 8, 16):
            result = run_json(launch(2, "benchmarks/benchmark.py", [
                "--pipeline-parallel-size", "2", "--pipeline-schedule", schedule, "--micro-batch-size", "4",
                "--global-batch-size", str(4 * m), "--iters", str(iters), "--warmup", "3"]))
            sweep.setdefault(schedule, []).append((m, result["pipeline_bubble_measured_median"],
                                                   result["pipeline_bubble_formula"],
                                                   result["peak_activation_bytes_per_rank"][0], result["tokens_per_s"]))
    draw_bubble(plt, sweep, iters)
    return sweep


def draw_bubble(plt, sweep: dict, iters: int, where: str | None = None) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for schedule, points in sweep.items():
        ms, measured = [p[0] for p in points], [p[1] for p in points]
        ax.plot(ms, measured, "o-", label=f"{schedule}, measured")
    ax.plot(ms, [p[2] for p in points], "k--", label="(p-1)/(m+p-1)")
    ax.set(xscale="log", xlabel="micro-batches m", ylabel="bubble (idle share)", title="The bubble of a 2-stage pipeline")
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.legend()
    caption(ax, f"mpiexec -n 2 python benchmarks/benchmark.py --pipeline-parallel-size 2 --micro-batch-size 4 "
                f"--global-batch-size 4m, medians of {iters} iterations", where)
    fig.savefig(FIGURES / "bubble.svg", bbox_inches="tight")


def bubble_table(sweep: dict) -> list[str]:
    """Chapter 5's table, from the sweep that drew bubble.svg."""
    rows = ["| m | formula | 1F1B measured | GPipe measured | peak activations, stage 0 (1F1B / GPipe) |",
            "| ---: | ---: | ---: | ---: | --- |"]
    for one, gpipe in zip(sweep["1f1b"], sweep["gpipe"]):
        rows.append(f"| {one[0]} | {one[2]:.3f} | {one[1]:.3f} | {gpipe[1]:.3f} | "
                    f"{one[3] / 2**20:.1f} / {gpipe[3] / 2**20:.1f} MiB |")
    return rows


# Chapter 14's table: (ranks, layout, flags, global batch); "x one process" compares each
# row with the one-process row of the same global batch.
THROUGHPUT_ROWS = [(1, "one process", [], 12), (1, "one process", [], 24),
                   (2, "dp = 2", ["--data-parallel-size", "2"], 24),
                   (2, "dp = 2, ZeRO-1", ["--data-parallel-size", "2", "--zero-stage", "1"], 24),
                   (2, "tp = 2", ["--tensor-parallel-size", "2"], 12),
                   (2, "tp = 2, sequence parallel", ["--tensor-parallel-size", "2", "--sequence-parallel"], 12),
                   (2, "cp = 2", ["--context-parallel-size", "2"], 12),
                   (1, "one process", [], 96),
                   (2, "pp = 2, 1F1B, m = 8", ["--pipeline-parallel-size", "2"], 96),
                   (4, "tp = 2 x dp = 2", ["--tensor-parallel-size", "2", "--data-parallel-size", "2"], 24),
                   (4, "pp = 2 x dp = 2, m = 4", ["--pipeline-parallel-size", "2", "--data-parallel-size", "2"], 96)]


def layouts(plt, iters: int) -> dict:
    """Throughput per layout (the figure and chapter 14's table, from one sweep), and bytes
    per collective kind against the planner's formula."""
    results = {}
    for ranks, label, flags, batch in THROUGHPUT_ROWS:
        args = flags + ["--global-batch-size", str(batch), "--micro-batch-size", "12"]
        measured = run_json(launch(ranks, "benchmarks/benchmark.py", args + ["--iters", str(iters), "--warmup", "3"]))
        planned = run_json([str(BIN / "python"), "-m", "numpitron.plan", "--json", "--devices", str(ranks), *args])
        results[f"{label}, batch {batch}"] = {
            "ranks": ranks, "layout": label, "tokens_per_s": measured["tokens_per_s"], "global_batch": batch,
            "mfu": measured["mfu"], "comm_bytes_per_iter": measured["comm_bytes_per_iter"],
            "bytes": measured["comm_bytes_per_iter_by_kind"], "planned_bytes": planned["stages"][0]["comm_bytes"]}
    draw_layouts(plt, results, iters)
    return results


def draw_layouts(plt, results: dict, iters: int, where: str | None = None) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.5))
    labels = list(results)
    ax.barh(labels, [results[k]["tokens_per_s"] for k in labels], color="#4c78a8")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set(xlabel="tokens/s", title="Throughput per layout, default model")
    caption(ax, f"python benchmarks/benchmark.py under mpiexec -n 1, 2 or 4, medians of {iters} iterations", where)
    fig.savefig(FIGURES / "throughput.svg", bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(6.4, 4.5))
    rows = [(f"{data['layout']}: {kind}", data["bytes"][kind], data["planned_bytes"].get(kind, 0))
            for data in results.values() if data["ranks"] == 2 for kind in sorted(data["bytes"])
            if data["bytes"][kind] > 100]
    names, measured, planned = zip(*rows)
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [m / 2**20 for m in measured], height=0.4, label="measured (CommStats)")
    ax.barh([i - 0.2 for i in y], [p / 2**20 for p in planned], height=0.4, label="formula (planner)")
    ax.set_yticks(list(y), names, fontsize=7)
    ax.set(xlabel="MiB per iteration (stage 0)", title="Bytes per collective: measured and formula")
    ax.legend()
    caption(ax, "benchmarks/benchmark.py against python -m numpitron.plan with the same flags", where)
    fig.savefig(FIGURES / "bytes.svg", bbox_inches="tight")


def throughput_table(results: dict) -> list[str]:
    """Chapter 14's table, from the sweep that drew throughput.svg."""
    serial = {r["global_batch"]: r["tokens_per_s"] for r in results.values() if r["ranks"] == 1}
    rows = ["| ranks | layout | global batch | tokens/s | x one process | bytes per iteration | MFU |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results.values():
        speedup = "1.00" if r["ranks"] == 1 else f"{r['tokens_per_s'] / serial[r['global_batch']]:.2f}"
        sent = f"{r['comm_bytes_per_iter'] / 2**20:.2f} MiB" if r["comm_bytes_per_iter"] else "0"
        rows.append(f"| {r['ranks']} | {r['layout']} | {r['global_batch']} | {r['tokens_per_s']:,.0f} | "
                    f"{speedup} | {sent} | {r['mfu']:.2f} |")
    return rows


def memory(plt) -> dict:
    """Bytes per rank for ZeRO stages 0-3 at dp = 2 and 4, measured by real runs (the
    optimizers' `memory_bytes`; tests/test_plan_counts.py checks the planner against them)."""
    sizes = {}
    for dp in (2, 4):
        for zero in (0, 1, 2, 3):
            result = run_json(launch(dp, "benchmarks/benchmark.py", ["--data-parallel-size", str(dp), "--zero-stage",
                                                                     str(zero), "--iters", "2"]))
            sizes[f"ZeRO-{zero}, dp = {dp}"] = result["memory_bytes_per_rank"][0]
    draw_memory(plt, sizes)
    return sizes


def draw_memory(plt, sizes: dict, where: str | None = None) -> None:
    parts = {"params": "parameters", "grads": "gradients", "optimizer_state": "Adam m and v",
             "gathered_params_peak": "gathered layers (peak)", "backward_grads_peak": "whole gradients (peak)"}
    fig, ax = plt.subplots(figsize=(6.4, 4))
    labels, bottom = list(sizes), [0.0] * len(sizes)
    for part, label in parts.items():
        values = [sizes[k][part] / 2**20 for k in labels]
        ax.barh(labels, values, left=bottom, label=label, hatch="//" if "peak" in part else None)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.invert_yaxis()
    ax.set_xlim(0, 1.05 * max(bottom))         # every bar whole, ZeRO-0's the longest
    ax.set(xlabel="MiB per rank (hatched: only during a pass)", title="What each rank stores, by ZeRO stage")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))     # beside the bars, not over them
    caption(ax, "mpiexec -n dp python benchmarks/benchmark.py --data-parallel-size dp --zero-stage z "
                "(default model, float32): memory_bytes_per_rank", where)
    fig.savefig(FIGURES / "memory_zero.svg", bbox_inches="tight")
