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


def caption(ax, text: str, where: str | None = None) -> None:
    """The command and the machine, under the x-axis label (anchored to it, so it never
    overlaps the tick labels however tall they are; bbox_inches="tight" keeps it in)."""
    ax.annotate(f"{text}\n{where or machine()}", xy=(0, 0), xycoords=("axes fraction", ax.xaxis.label),
                xytext=(0, -6), textcoords="offset points", fontsize=6, color="#555555", va="top", ha="left")


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
    optimizers' `memory_bytes`; tests/test_plan.py checks the planner against them)."""
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


def hsdp_rates(plt) -> dict:
    """ZeRO-3, HSDP and plain dp against the inter-host rate (docs/09-zero-2-and-3.md),
    drawn from what benchmarks/hsdp.py measured on the simulated cluster (it needs root,
    so `make figures` redraws from its JSON, docs/figures/hsdp.json, and does not rerun it)."""
    import statistics
    data = json.loads((FIGURES / "hsdp.json").read_text())
    rates = sorted(data["rates"], key=lambda r: r["inter_mbit"])
    x = [r["inter_mbit"] for r in rates]
    styles = {"ZeRO-3": "o-", "HSDP (S=2)": "s-", "dp": "^-", "dp, two-level": "v--"}
    fig, (time_ax, bytes_ax, link_ax) = plt.subplots(1, 3, figsize=(12, 3.8))
    for name, style in styles.items():
        runs = [r["layouts"][name]["ms"] for r in rates]
        mid = [statistics.median(ms) for ms in runs]
        time_ax.errorbar(x, mid, yerr=[[m - min(ms) for m, ms in zip(mid, runs)], [max(ms) - m for m, ms in zip(mid, runs)]],
                         fmt=style, capsize=2, label=name, lw=1.2, ms=4)
        bytes_ax.plot(x, [statistics.median(r["layouts"][name]["sent_bytes"]) / 2**20 for r in rates], style, label=name, ms=4)
    planned = data["crossover_mbit"]["with_alpha"]
    if planned:
        time_ax.axvline(planned, color="k", ls=":", lw=1, label="planned crossover")
    link_ax.plot(x, [r["fitted_inter_mbit"] for r in rates], "o-", label="across hosts")
    link_ax.plot(x, [r["fitted_intra_mbit"] for r in rates], "s-", label="inside a host (shaped 701)")
    link_ax.plot(x, x, "k:", lw=1, label="the shaped rate")
    time_ax.set(xscale="log", yscale="log", xlabel="inter-host rate, Mbit/s per rank (shaped)", ylabel="ms per step",
                title="Step time (median, range over rounds)")
    bytes_ax.set(xscale="log", xlabel="inter-host rate, Mbit/s per rank (shaped)", ylabel="MiB per step",
                 title="Bytes host 0 sent to the other host", ylim=(0, None))
    link_ax.set(xscale="log", yscale="log", xlabel="inter-host rate, Mbit/s per rank (shaped)", ylabel="Mbit/s",
                title="Rate an all-reduce sweep got (last run)")
    link_ax.legend(fontsize=7)
    time_ax.legend(fontsize=7)
    load = statistics.median(load for r in rates for load in r["load"])
    caption(time_ax, f"python benchmarks/hsdp.py: 2 simulated hosts x 2 ranks, dp = 4, default model, float32, batch 12; "
                     f"{len(rates[0]['layouts']['dp']['ms'])} paired rounds, load average {load:.0f}")
    fig.subplots_adjust(bottom=0.24, wspace=0.35)
    fig.savefig(FIGURES / "hsdp_rates.svg", bbox_inches="tight")
    return {"from": "docs/figures/hsdp.json"}


def context_parallel_blocks() -> dict:
    """Which chunk pairs each rank computes, zigzag against a plain split (docs/12-context-parallelism.md)."""
    return run_json(launch(4, "benchmarks/context_parallel.py", ["--seq-len", "1024"]))


def routing(data_dir: Path, iters: int) -> dict:
    """Tokens per expert and the dropped share over a mixture-of-experts run (docs/13-experts.md)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(launch(1, "train_shakespeare.py", [
            "--num-experts", "4", "--moe-top-k", "1", "--moe-capacity-factor", "1.25", "--max-iters", str(iters),
            "--data-dir", str(data_dir), "--out-dir", tmp, "--no-progress"]), check=True, cwd=REPO, capture_output=True)
        return run_json(launch(1, "benchmarks/experts.py", ["routing", str(Path(tmp) / "metrics.jsonl")]))


def experts_compare(data_dir: Path, iters: int) -> dict:
    """Dense against MoE at equal active parameters, and aux loss against bias balancing:
    the validation losses and docs/figures/balance.svg (docs/13-experts.md)."""
    return run_json(launch(1, "benchmarks/experts.py", ["compare", "--iters", str(iters), "--data-dir", str(data_dir)]))


def cluster_rates(plt) -> dict:
    """Step time per layout against the inter-host rate on the simulated cluster, with tp
    inside a host (2 ranks a host) and across hosts (1 a host), measured and planned:
    drawn from what benchmarks/cluster_layouts.py wrote (it needs root and a quiet
    hour, so `make figures` draws its saved output rather than running it)."""
    rows = [r for r in json.loads((FIGURES / "cluster_layouts.json").read_text())["rows"] if r["model"] == "default"]
    meshes = [m for m in ([4, 1, 1, 1], [2, 1, 2, 1], [1, 2, 2, 1], [1, 1, 4, 1])
              if len({r["inter_mbit_s"] for r in rows if r["mesh"] == m}) >= 3]
    fig, axes = plt.subplots(1, 2, figsize=(8, 4.2), sharey=True)
    fig.subplots_adjust(bottom=0.22)
    for ax, per_host, title in ((axes[0], 2, "2 ranks a host (tp = 2 inside one)"),
                                (axes[1], 1, "1 rank a host (every group crosses)")):
        for color, mesh in zip(("#e45756", "#4c78a8", "#54a24b", "#b279a2"), meshes):
            points = sorted((r["inter_mbit_s"], r["measured_ms"], r["predicted_ms"]) for r in rows
                            if r["mesh"] == mesh and r["per_host"] == per_host)
            if points:
                rate, measured, planned = zip(*points)
                ax.plot(rate, measured, "o-", color=color, label="tp pp dp cp = " + " ".join(map(str, mesh)))
                ax.plot(rate, planned, "--", color=color, lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="inter-host Mbit/s per rank", title=title)
        ax.minorticks_off()
        ax.set_xticks(rate, [f"{r:.0f}" for r in rate])
        ax.set_yticks([100, 300, 1000, 3000, 8000], ["100", "300", "1,000", "3,000", "8,000"])
    axes[0].set_ylabel("ms per step: measured (solid), planned (dashed)")
    axes[0].legend(fontsize=7)
    caption(axes[0], "python benchmarks/cluster_layouts.py --rates 0.25,1,4 (58 Mbit/s: InfiniBand scaled); default model, "
                     "micro-batch 3, batch 12, 4 ranks on 2 shared cores; docs/figures/cluster_layouts.json")
    fig.savefig(FIGURES / "cluster_rates.svg", bbox_inches="tight")
    return {"meshes": meshes}


def precision_drift(plt, data_dir: Path, iters: int) -> dict:
    """Each precision's training loss against float64's over the same run (docs/07-numbers.md)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "drift.json"
        subprocess.run(launch(1, "benchmarks/precision_drift.py", ["--iters", str(iters), "--data-dir", str(data_dir),
                                                                   "--out", str(out)]),
                       check=True, cwd=REPO, capture_output=True)
        results = json.loads(out.read_text())
    draw_precision_drift(plt, results)
    return results["summary"]


def draw_precision_drift(plt, results: dict) -> None:
    runs = results["runs"]
    exact = [float(x) for x in runs["float64/fp32"]["losses"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, run in runs.items():
        if name != "float64/fp32":
            drift = [max(abs(a - b) / b, 1e-9) for a, b in zip(run["losses"], exact)]
            ax.semilogy(range(1, len(drift) + 1), drift, label=name.split("/")[1], lw=0.9)
    ax.set(xlabel="iteration", ylabel="|loss - float64 loss| / float64 loss",
           title="Each format's training loss against the float64 trajectory")
    ax.legend(fontsize=7, ncol=4)
    fig.subplots_adjust(bottom=0.2)           # room for the caption under the axis label
    caption(ax, f"python benchmarks/precision_drift.py --iters {results['iters']} "
                "(default model, Tiny Shakespeare, one process)")
    fig.savefig(FIGURES / "precision_drift.svg", bbox_inches="tight")


def race(plt) -> dict:
    """Validation loss against wall time since launch, each program and round of the
    race to 1.80 (docs/appendix-a-speed-on-a-cpu.md), from the race's own run: benchmarks/race.py writes
    docs/figures/race.json (`--out`), which takes tens of minutes on two cores, so this
    draws the stored run rather than racing again."""
    stored = json.loads((FIGURES / "race.json").read_text())
    # race.py's runs by program; a file from before the equal-recipe race has two, at its top level
    runs = stored.get("runs") or {"numpitron (Muon, dp = 2)": stored["numpitron"],
                                  "pytorch (AdamW, 2 threads)": stored["pytorch"]}
    fig, ax = plt.subplots(figsize=(6.4, 4))
    colours = ["#4c78a8", "#e45756", "#54a24b", "#f58518"]
    for colour, (name, rounds) in zip(colours, runs.items()):
        for round_, run in enumerate(rounds):
            points = [(e["seconds"], e["val"]) for e in run["evals"]]
            ax.plot(*zip(*points), "o-" if round_ == 0 else "s--", color=colour, ms=3, lw=1.2,
                    label=f"{name}, round {round_ + 1}" + (" (cut short)" if run.get("running") else ""))
    ax.axhline(stored["target"], color="k", lw=0.8, ls=":")
    ax.set(xlabel="seconds since launch (evaluations included)", ylabel="validation loss",
           title=f"The race to val {stored['target']:.2f} on two cores")
    ax.legend(fontsize=7)
    caption(ax, "python benchmarks/race.py --torch-python ... --rounds 2 --stop-at-target --out docs/figures/race.json "
                "(the load average at every evaluation is in race.json)")
    fig.savefig(FIGURES / "race.svg", bbox_inches="tight")
    return {name: [run.get("seconds_to_target") for run in rounds] for name, rounds in runs.items()}


def traced_pipeline(plt, data_dir: Path) -> dict:
    """Chapter 19's figure: one traced 1F1B step on two stages, the planner's prediction
    of the same step under it (trace_pipeline.svg), and both summaries."""
    from numpitron.trace.draw import draw_on
    from numpitron.trace.summary import summarize
    flags = ["--pipeline-parallel-size", "2", "--global-batch-size", "48"]
    with tempfile.TemporaryDirectory() as tmp:
        measured, predicted = Path(tmp) / "measured.json", Path(tmp) / "predicted.json"
        subprocess.run(launch(2, "train_shakespeare.py", flags + [
            "--max-iters", "4", "--eval-interval", "100", "--eval-iters", "1", "--data-dir", str(data_dir),
            "--out-dir", str(Path(tmp) / "out"), "--no-progress", "--trace", str(measured), "--trace-iters", "3:4"]),
            check=True, cwd=REPO, capture_output=True)
        subprocess.run(launch(1, "-m", ["numpitron.plan", *flags, "--trace", str(predicted)]), check=True, cwd=REPO,
                       capture_output=True)
        traces = [json.loads(measured.read_text()), json.loads(predicted.read_text())]
    fig, axes = plt.subplots(2, 1, figsize=(11, 6))
    length = draw_on(axes[0], traces[0], 3, f"measured: iteration 3 of train_shakespeare.py "
                                            f"(load average {os.getloadavg()[0]:.1f})")
    draw_on(axes[1], traces[1], None, "predicted: python -m numpitron.plan ... --trace", length, legend=False)
    caption(axes[1], "mpiexec -n 2 python train_shakespeare.py --pipeline-parallel-size 2 --global-batch-size 48 "
                     "--trace FILE.json --trace-iters 3:4; the same flags to python -m numpitron.plan --trace")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(FIGURES / "trace_pipeline.svg", bbox_inches="tight")
    plt.close(fig)
    return {kind: summarize(trace) for kind, trace in zip(("measured", "predicted"), traces)}


# The figures that can be made alone (`--only NAME`), each from (plt, data_dir, iters):
ALONE = {
    "memory_zero": lambda plt, data_dir, iters: memory(plt),
    "bubble": lambda plt, data_dir, iters: bubble(plt, iters),
    "layouts": lambda plt, data_dir, iters: layouts(plt, iters),
    "experts_compare": lambda plt, data_dir, iters: experts_compare(data_dir, 300),
    "cluster_rates": lambda plt, data_dir, iters: cluster_rates(plt),
    "precision_drift": lambda plt, data_dir, iters: precision_drift(plt, data_dir, 200),
    "hsdp_rates": lambda plt, data_dir, iters: hsdp_rates(plt),
    "race": lambda plt, data_dir, iters: race(plt),
    "traced_pipeline": lambda plt, data_dir, iters: traced_pipeline(plt, data_dir),
    "trace_figures": lambda plt, data_dir, iters: trace_figures(data_dir),
}


def slow_links() -> None:
    """Chapter 18's two figures, redrawn from what benchmarks/slow_links.py measured on the
    cluster (it needs root and a quiet machine, so `make figures` does not rerun it)."""
    subprocess.run([sys.executable, "benchmarks/slow_links.py", "--redraw"], check=True, cwd=REPO)


def trace_figures(data_dir: Path) -> str:
    """The chapters' traced timelines beside their predictions: benchmarks/trace_figures.py
    draws them and keeps their numbers in trace_figures.json."""
    subprocess.run([sys.executable, "benchmarks/trace_figures.py", "--data-dir", str(data_dir)], check=True, cwd=REPO)
    return "docs/figures/trace_figures.json"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="data")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=sorted(ALONE),
                   help="make this figure alone (figures.json keeps the rest)")
    p.add_argument("--redraw", action="store_true",
                   help="draw bubble, throughput, bytes, memory_zero, race, hsdp_rates, cluster_rates and slow_links again from "
                        "their saved JSON, "
                        "running nothing")
    p.add_argument("--tables", action="store_true",
                   help="print chapter 5's table and chapter 14's from figures.json (the runs that drew their figures)")
    args = p.parse_args()
    if args.tables:
        data = json.loads((FIGURES / "figures.json").read_text())
        print("\n".join(bubble_table(data["bubble"]) + [""] + throughput_table(data["layouts"])))
        return
    import matplotlib
    matplotlib.use("svg")
    matplotlib.rcParams["svg.hashsalt"] = "numpitron"          # the same ids on every redraw
    import matplotlib.pyplot as plt
    FIGURES.mkdir(parents=True, exist_ok=True)
    if args.redraw:
        data = json.loads((FIGURES / "figures.json").read_text())
        draw_bubble(plt, data["bubble"], 20, data["machine"])
        draw_layouts(plt, data["layouts"], 20, data["machine"])
        draw_memory(plt, data["memory_zero"], data["machine"])
        race(plt)
        hsdp_rates(plt)
        cluster_rates(plt)
        slow_links()
        return
    if args.only:
        data = json.loads((FIGURES / "figures.json").read_text())
        data[args.only] = ALONE[args.only](plt, Path(args.data_dir).resolve(), 5 if args.quick else 20)
        (FIGURES / "figures.json").write_text(json.dumps(data, indent=1) + "\n")
        return
    iters = 5 if args.quick else 20
    data = {"machine": machine(), "loss_curves": loss_curves(plt, Path(args.data_dir).resolve(), 40 if args.quick else 300),
            "bubble": bubble(plt, iters), "layouts": layouts(plt, iters), "memory_zero": memory(plt)}
    subprocess.run(launch(2, "benchmarks/pipeline_timeline.py", ["--out", "docs/pipeline_timeline.svg"]),
                   check=True, cwd=REPO, capture_output=True)
    subprocess.run(launch(1, "benchmarks/pipeline_timeline.py", ["--ideal", "4", "--out", "docs/pipeline_ideal.svg"]),
                   check=True, cwd=REPO, capture_output=True)
    subprocess.run(launch(1, "benchmarks/diagrams.py", []), check=True, cwd=REPO, capture_output=True)
    subprocess.run(launch(2, "benchmarks/chunk_pair_timeline.py", ["--out", "docs/figures/chunk_pair.svg"]),
                   check=True, cwd=REPO, capture_output=True)
    data["context_parallel_blocks"] = context_parallel_blocks()
    data["hsdp_rates"] = hsdp_rates(plt)
    data["routing"] = routing(Path(args.data_dir).resolve(), 200 if args.quick else 2000)
    data["experts_compare"] = experts_compare(Path(args.data_dir).resolve(), 40 if args.quick else 300)
    data["cluster_rates"] = cluster_rates(plt)
    slow_links()
    data["precision_drift"] = precision_drift(plt, Path(args.data_dir).resolve(), 20 if args.quick else 200)
    data["race"] = race(plt)
    data["traced_pipeline"] = traced_pipeline(plt, Path(args.data_dir).resolve())
    data["trace_figures"] = trace_figures(Path(args.data_dir).resolve())
    (FIGURES / "figures.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {', '.join(sorted(p.name for p in FIGURES.glob('*.svg')))} and figures.json in {FIGURES}")


if __name__ == "__main__":
    main()
