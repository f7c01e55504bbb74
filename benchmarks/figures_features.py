"""The figures of the later chapters: hybrid sharding and the cluster's rates (redrawn
from the cluster runs' JSON), context parallelism's blocks, the experts, precision's
drift, the race and the traced pipeline. benchmarks/figures.py calls them."""

import json
import os
import subprocess
import tempfile
from pathlib import Path

from figures_common import FIGURES, REPO, caption, launch, run_json


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
