"""Every figure of the book, from real runs on this machine: `make figures`.

    pip install -e ".[docs]"         # matplotlib
    python benchmarks/figures.py [--data-dir data] [--quick]

Writes docs/figures/*.svg and docs/figures/figures.json (the numbers behind them). Each
figure names the command that made it and the machine it ran on. --quick runs fewer
iterations (for trying the script; the committed figures are full runs).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

# the figure functions live in benchmarks/figures_common.py, benchmarks/figures_training.py
# and benchmarks/figures_features.py
from figures_common import FIGURES, REPO, launch, machine  # noqa: F401  (trace_figures.py imports these here)
from figures_features import (cluster_rates, context_parallel_blocks, experts_compare, hsdp_rates,  # noqa: F401
                              precision_drift, race, routing, traced_pipeline)
from figures_training import (bubble, bubble_table, draw_bubble, draw_layouts, draw_memory, layouts,  # noqa: F401
                              loss_curves, memory, throughput_table)


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
    subprocess.run([sys.executable, "benchmarks/slow_links_figures.py"], check=True, cwd=REPO)


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
