"""The book's timelines drawn from traces of real runs, each above the planner's
predicted trace of the same step (docs/19-traces.md): `make figures` runs it.

    python benchmarks/trace_figures.py [--data-dir data] [--only NAME ...]

For every figure below: train_shakespeare.py on a small model and 2 ranks, three
iterations traced (`--trace`) after two that warm up, of which the median step is
drawn, then `python -m numpitron.plan` with the same model and layout flags and
`--trace`, drawn measured above predicted on one time axis (numpitron/trace/draw.py) into docs/figures/NAME.svg. The summaries of
both (`trace summary`) go to docs/figures/trace_figures.json, which the chapters quote.

    trace_schedules.svg    1F1B, interleaved and DualPipeV on 2 stages   chapter 11
    trace_buckets.svg      dp = 2, the buckets' all-reduces               chapter 3
    trace_zero3.svg        ZeRO-3's prefetched gathers                    chapter 9
    trace_tp_overlap.svg   tp = 2, the backward's sums in flight          chapter 4
    trace_ring.svg         cp = 2, ring attention's transfers             chapter 12
    trace_slow_link.svg    plain dp and DiLoCo across a 100 Mbit/s link   chapter 18
                           (on the simulated cluster: root and iproute2)
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import FIGURES, REPO, launch, machine  # noqa: E402  (benchmarks/ is a folder of scripts)

# Small enough for seconds a run on two busy cores, big enough that a layer's compute
# is not all call overhead.
MODEL = ["--n-layers", "4", "--n-heads", "4", "--d-model", "64", "--seq-len", "64", "--micro-batch-size", "4"]
PP = ["--pipeline-parallel-size", "2"]
# Three iterations traced after two that warm up; the figure draws the one whose step (on
# rank 0) is the median of the three, so that one moment of a busy machine does not make it.
TRACED = range(3, 6)
# name -> (chapter, title, [(panel label, ranks, layout flags, the iterations traced)])
CASES = {
    "trace_schedules": ("11-pipeline-schedules.md", "Pipeline schedules, 2 stages, 8 micro-batches", [
        ("1F1B", 2, PP + ["--global-batch-size", "32", "--pipeline-schedule", "1f1b"], TRACED),
        ("interleaved, 2 chunks a stage", 2, PP + ["--global-batch-size", "32", "--pipeline-schedule", "interleaved",
                                                   "--virtual-stages", "2"], TRACED),
        ("DualPipeV", 2, PP + ["--global-batch-size", "32", "--pipeline-schedule", "dualpipev"], TRACED)]),
    "trace_buckets": ("03-data-parallelism.md", "Gradient buckets: dp = 2, all-reduces started in the backward", [
        ("dp = 2, buckets of 20,000 values", 2, ["--data-parallel-size", "2", "--global-batch-size", "16",
                                                 "--bucket-size", "20000"], TRACED)]),
    "trace_zero3": ("09-zero-2-and-3.md", "ZeRO-3: each layer's parameters gathered while the one before runs", [
        ("dp = 2, ZeRO-3", 2, ["--data-parallel-size", "2", "--global-batch-size", "16", "--zero-stage", "3"],
         TRACED)]),
    "trace_tp_overlap": ("04-tensor-parallelism.md", "Tensor parallelism: the backward's all-reduces in flight", [
        ("tp = 2, overlap on", 2, ["--tensor-parallel-size", "2", "--global-batch-size", "8", "--tp-comm-overlap"],
         TRACED)]),
    "trace_ring": ("12-context-parallelism.md", "Ring attention: each block's transfer behind the block before", [
        ("cp = 2, ring, 128 tokens a rank", 2, ["--context-parallel-size", "2", "--global-batch-size", "8",
                                                "--seq-len", "256"], TRACED)]),
    "trace_slow_link": ("18-across-slow-links.md", "Across a 100 Mbit/s link: two simulated hosts, a rank each", [
        ("plain dp = 2, buckets of 20,000 values", 2, ["--data-parallel-size", "2", "--global-batch-size", "16",
                                                       "--bucket-size", "20000"], TRACED),
        ("DiLoCo, 2 replicas, H = 2: a round's last step", 2, [
            "--data-parallel-size", "2", "--global-batch-size", "16", "--diloco-replicas", "2",
            "--diloco-inner-steps", "2"], range(4, 9, 2))]),
}


# Figures run on the simulated cluster (numpitron.cluster: root, network namespaces), one
# rank a host, the hosts joined by a link shaped to this rate; the planner is given this
# machine's profile with that link between hosts.
CLUSTER = {"trace_slow_link": 100e6}
PREFIX = "npt-fig-"


def cluster(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numpitron.cluster", "--prefix", PREFIX, *args], cwd=REPO,
                          capture_output=True, text=True, check=True)


def cluster_device(rate: float, path: Path) -> Path:
    """This machine's profile, its ranks one a host and the hosts' link `rate` bits/s."""
    profile = json.loads((REPO / "numpitron/plan/profiles/this-machine.json").read_text())
    path.write_text(json.dumps({**profile, "name": f"cluster-{rate / 1e6:.0f}mbit", "ranks_per_host": 1,
                                "inter_bandwidth": rate / 8}))
    return path


def with_model(flags: list) -> list:
    """MODEL's flags but those `flags` set again, then `flags`."""
    pairs = [MODEL[i:i + 2] for i in range(0, len(MODEL), 2)]
    return [word for pair in pairs if pair[0] not in flags for word in pair] + flags


def traced_pair(data_dir: Path, ranks: int, flags: list, iterations: range, tmp: Path,
                rate: float | None = None) -> tuple[int, dict, dict]:
    """(the iteration drawn, measured, predicted) traces of one layout's step (on the
    cluster when `rate`)."""
    measured, predicted = tmp / "measured.json", tmp / "predicted.json"
    where = ([sys.executable, "-m", "numpitron.cluster", "--prefix", PREFIX, "run", "-n", str(ranks), "--per-host",
              "1", "--"] if rate else [])
    device = ["--device", str(cluster_device(rate, tmp / "device.json"))] if rate else []
    subprocess.run(where + launch(ranks if not rate else 1, "train_shakespeare.py", with_model(flags) + [
        "--max-iters", str(iterations[-1] + 1), "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1",
        "--data-dir", str(data_dir), "--out-dir", str(tmp / "out"), "--no-progress", "--trace", str(measured),
        "--trace-iters", f"{iterations[0]}:{iterations[-1] + 1}"]), check=True, cwd=REPO, capture_output=True)
    subprocess.run(launch(1, "-m", ["numpitron.plan", *with_model(flags), *device, "--trace", str(predicted)]),
                   check=True, cwd=REPO, capture_output=True)
    trace = json.loads(measured.read_text())
    steps = sorted((e["dur"], e["args"]["iteration"]) for e in trace["traceEvents"] if e["ph"] == "X"
                   and e["pid"] == 0 and e["name"] == "step" and e["cat"] == "step"
                   and e["args"]["iteration"] in iterations)
    return steps[len(steps) // 2][1], trace, json.loads(predicted.read_text())


def footer(flags: list, rate: float | None, panels: int) -> str:
    return "\n".join(textwrap.fill(line, 160, subsequent_indent="    ", break_on_hyphens=False) for line in
                     footer_lines(flags, rate, panels).splitlines())


def footer_lines(flags: list, rate: float | None, panels: int) -> str:
    where = (f"python -m numpitron.cluster run -n 2 --per-host 1 -- (2 hosts, {rate / 1e6:.0f} Mbit/s between them) "
             if rate else "mpiexec -n 2 ")
    return (f"measured: {where}python train_shakespeare.py {' '.join(with_model(flags))} --trace FILE.json"
            f"{' (the first panel; the others as their titles say)' if panels > 1 else ''}\n"
            f"predicted: the same flags to python -m numpitron.plan --trace FILE.json"
            f"{' --device (this machine, the link above between hosts)' if rate else ''}\n"
            f"CPU: {machine()}, load average {os.getloadavg()[0]:.1f} (a shared machine)")


def draw_figure(plt, name: str, data_dir: Path, out_dir: Path = FIGURES) -> dict:
    """One figure: a measured panel above a predicted one for each of its runs."""
    from numpitron.trace.draw import draw_on, rows_of
    from numpitron.trace.summary import summarize
    _, title, runs = CASES[name]
    rate, pairs = CLUSTER.get(name), []
    if rate:
        cluster("down")
        cluster("up", "--hosts", "2", "--ranks-per-host", "1", "--inter-host-rate", f"{rate / 1e6:.0f}mbit")
    try:
        for label, ranks, flags, iterations in runs:
            with tempfile.TemporaryDirectory() as tmp:
                pairs.append((label, flags, *traced_pair(data_dir, ranks, flags, iterations, Path(tmp), rate)))
    finally:
        if rate:
            cluster("down")
    heights = [len(rows_of(trace, it if kind == 0 else None)[0]) + 1.5
               for _, _, it, *traces in pairs for kind, trace in enumerate(traces)]
    fig, axes = plt.subplots(len(heights), 1, figsize=(11, 0.32 * sum(heights) + 1.6),
                             gridspec_kw={"height_ratios": heights})
    out = {}
    for i, (label, flags, iteration, measured, predicted) in enumerate(pairs):
        top, bottom = axes[2 * i], axes[2 * i + 1]
        length = draw_on(top, measured, iteration, f"{label}: measured, iteration {iteration}", legend=i == 0)
        planned = draw_on(bottom, predicted, None, f"{label}: predicted by the planner", legend=False)
        for ax in (top, bottom):
            ax.set_xlim(0, max(length, planned))
            ax.set_xlabel("ms from the step's start")
        out[label] = {"measured": [r for r in summarize(measured) if r["iteration"] == iteration],
                      "predicted": summarize(predicted),
                      "planner_step_ms": predicted["otherData"]["planner_step_ms"]}
    fig.suptitle(title)
    footer_text = footer(runs[0][2], rate, len(runs))
    fig.text(0.01, 0.002, footer_text, fontsize=7, color="#555555", va="bottom")
    height = fig.get_figheight()           # inches: room for the footer's three lines and the title
    fig.tight_layout(rect=(0, (0.25 + 0.12 * footer_text.count("\n")) / height, 1, 1 - 0.15 / height))
    fig.savefig(out_dir / f"{name}.svg", bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="data")
    p.add_argument("--only", nargs="+", choices=sorted(CASES), help="these figures alone (the json keeps the rest)")
    p.add_argument("--out-dir", default=str(FIGURES))
    args = p.parse_args(argv)
    import matplotlib
    matplotlib.use("svg")
    import matplotlib.pyplot as plt
    out_dir = Path(args.out_dir)
    numbers = out_dir / "trace_figures.json"
    data = json.loads(numbers.read_text()) if numbers.exists() else {}
    for name in args.only or CASES:
        if name in CLUSTER and (os.geteuid() != 0 or shutil.which("tc") is None):
            print(f"kept {name}.svg: the simulated cluster needs root and iproute2", flush=True)
            continue
        data[name] = draw_figure(plt, name, Path(args.data_dir).resolve(), out_dir)
        print(f"wrote {out_dir / name}.svg", flush=True)
    data["machine"] = machine()
    numbers.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
