"""Training across a slow link, measured on the simulated cluster (docs/18-across-slow-links.md).
Needs root (network namespaces).

    python benchmarks/slow_links.py                                   # the full sweep
    python benchmarks/slow_links.py --iters 20 --eval-interval 10 --rates 1 --methods dp diloco-10   # a smoke run

Two hosts of two ranks (dp = 4; DiLoCo's two replicas are the two hosts), the
inter-host link at the scaled InfiniBand rate of benchmarks/cluster_layouts.py times
each of --rates (default 1, 1/8, 1/64), the intra-host links at scaled NVLink. For
each method (plain dp, int8 and PowerSGD r = 4 gradients, DiLoCo H in {10, 50, 200},
streaming DiLoCo with F = 5, τ = 2 of H = 50) it trains the default model to the same
number of tokens and records: validation losses, the bytes host 0's link carried
(its counters, against the formula's bytes from metrics.jsonl), the run's wall time,
and the link's busiest rate (counters sampled every --sample seconds), over one sample
and over a window of one step's time.

A curve's bytes are the link's total times the iteration's share of the run (each
method's traffic repeats every round, so this is exact at round boundaries); its wall
time is metrics.jsonl's elapsed_s (seconds since training began: no start-up).
Writes --out (JSON) and, with matplotlib, docs/figures/slow_links_bytes.svg and
slow_links_time.svg.
"""

import argparse
import json
import sys
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from cluster_layouts import cluster, scaled_cluster, scaled_rates  # noqa: E402

from numpitron.cluster import control  # noqa: E402
from numpitron.cluster.network import link_counters  # noqa: E402
from numpitron.plan.devices import load_device  # noqa: E402

PREFIX = "npt-slow-"
DILOCO = ["--diloco-replicas", "2"]
METHODS = {
    "dp": [],
    "int8": ["--grad-compression", "int8"],
    "powersgd": ["--grad-compression", "powersgd", "--powersgd-rank", "4"],
    "diloco-10": DILOCO + ["--diloco-inner-steps", "10"],
    "diloco-50": DILOCO + ["--diloco-inner-steps", "50"],
    "diloco-200": DILOCO + ["--diloco-inner-steps", "200"],
    "streaming": DILOCO + ["--diloco-inner-steps", "50", "--diloco-fragments", "5", "--diloco-overlap-steps", "2"],
}


def host_bytes(spec) -> int:
    """What host 0's link has carried both ways so far (every byte between the two hosts)."""
    counters = link_counters(spec, 0)
    return counters["tx_bytes"] + counters["rx_bytes"]


class Sampler(threading.Thread):
    """The link's counters every `period` seconds while a run trains: its busiest rate."""

    def __init__(self, spec, period: float):
        super().__init__(daemon=True)
        self.spec, self.period, self.samples, self.stop = spec, period, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.samples.append((time.perf_counter(), host_bytes(self.spec)))
            self.stop.wait(self.period)

    def peak(self, window: float) -> float:
        """The most bytes the link carried in any `window` seconds, over `window`. On a
        shaped link every exchange runs at the link's rate while it lasts, so the peak
        demand shows over a window of about one step: there, DiLoCo's whole-stage exchange
        and a streaming fragment differ by F until the link is the bottleneck."""
        best, j = 0.0, 0
        for i, (t1, b1) in enumerate(self.samples[1:], 1):
            while j < i - 1 and self.samples[j + 1][0] <= t1 - window:    # the latest start a window back
                j += 1
            best = max(best, (b1 - self.samples[j][1]) / (t1 - self.samples[j][0]))
        return best


def train_once(name: str, flags: list, args, spec) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix=f"slow-{name}-"))
    train = [sys.executable, "train_shakespeare.py", "--data-dir", str(args.data_dir), "--out-dir", str(out_dir),
             "--data-parallel-size", "4", "--max-iters", str(args.iters), "--eval-interval", str(args.eval_interval),
             "--eval-iters", str(args.eval_iters), "--log-interval", "1", "--no-progress", "--overwrite", *flags]
    sampler = Sampler(spec, args.sample)
    before = host_bytes(spec)
    sampler.start()
    start = time.perf_counter()
    cluster("run", "-n", "4", "--", *train, prefix=args.prefix)
    wall = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    link = host_bytes(spec) - before
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train_loss" in r]
    curve, elapsed = [], 0.0
    for r in steps:
        elapsed = r.get("elapsed_s", elapsed)                    # seconds since training began
        if "val_loss" in r:
            curve.append({"iter": r["iter"], "val_loss": r["val_loss"], "train_seconds": elapsed,
                          "link_bytes": link * r["iter"] / args.iters})
    counted = sum(r.get("comm_bytes", 0.0) for r in steps)        # rank 0's bytes, every group
    return {"method": name, "flags": flags, "wall_s": wall, "train_s": elapsed, "link_bytes": link,
            "rank0_comm_bytes": counted, "rank0_diloco_bytes": sum(r.get("diloco_bytes", 0) for r in steps),
            "peak_link_bytes_per_s": sampler.peak(args.sample),
            "peak_link_bytes_per_step_window": sampler.peak(max(elapsed / args.iters, args.sample)), "val": curve,
            "final_val_loss": curve[-1]["val_loss"] if curve else None}


def figures(results: list, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        print("matplotlib is not installed: no figures", file=sys.stderr)
        return
    for x, label, name in (("link_bytes", "bytes over the inter-host link", "slow_links_bytes.svg"),
                           ("train_seconds", "training seconds", "slow_links_time.svg")):
        rates = sorted({r["rate"] for r in results}, reverse=True)
        fig, axes = plt.subplots(1, len(rates), figsize=(4.5 * len(rates), 3.6), squeeze=False, sharey=True)
        for ax, rate in zip(axes[0], rates):
            for r in (r for r in results if r["rate"] == rate):
                ax.plot([p[x] for p in r["val"]], [p["val_loss"] for p in r["val"]], marker=".", label=r["method"])
            ax.set_xscale("log" if x == "link_bytes" else "linear")
            ax.set_title(f"inter-host link x {rate}")
            ax.set_xlabel(label)
        axes[0][0].set_ylabel("validation loss")
        axes[0][-1].legend(fontsize=7)
        fig.savefig(path / name, bbox_inches="tight")
        plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=50)
    p.add_argument("--rates", nargs="+", default=["1", "1/8", "1/64"], help="fractions of the scaled InfiniBand rate")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--sample", type=float, default=0.25, help="seconds between link counter samples")
    p.add_argument("--data-dir", type=Path, default=REPO / "data")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "figures" / "slow_links.json")
    p.add_argument("--figures", type=Path, default=REPO / "docs" / "figures")
    p.add_argument("--prefix", default=PREFIX)
    args = p.parse_args()
    intra, inter = scaled_rates(load_device("this-machine").peak_flops)
    results = []
    try:
        for rate in args.rates:
            scaled_cluster(2, 2, inter * float(Fraction(rate)), intra, prefix=args.prefix)
            spec = control.load(args.prefix)
            for name in args.methods:
                row = {"rate": rate, "inter_bytes_per_s": inter * float(Fraction(rate)),
                       **train_once(name, METHODS[name], args, spec)}
                results.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "val"}), flush=True)
    finally:
        cluster("down", prefix=args.prefix, check=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1) + "\n")
    figures(results, args.figures)


if __name__ == "__main__":
    main()
