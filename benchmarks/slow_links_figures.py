"""Chapter 18's two figures from what benchmarks/slow_links.py measured (its JSON):
validation loss against the bytes over host 0's link, and against projected wall time
at each rate. `python benchmarks/slow_links_figures.py` redraws them (make figures does),
running nothing.

Both figures name the CPU the sweep ran on; the loss curves are the full runs' own."""

import json
import sys
from pathlib import Path

FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures"


def figures(data: dict, path: Path) -> None:
    if not data["loss_runs"]:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        print("matplotlib is not installed: no figures", file=sys.stderr)
        return
    curves, windows = data["loss_runs"], data["windows"]
    top = {w["method"]: w for w in windows if w["rate"] == data["rates"][0]}
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for name, curve in curves.items():
        if name in top:
            ax.plot([i * top[name]["link_payload_bytes_per_iter"] for i, _ in curve], [v for _, v in curve],
                    marker=".", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("bytes over host 0's link (measured per iteration x iterations)")
    ax.set_ylabel("validation loss")
    ax.set_title(data.get("cpu", ""), fontsize=8)
    ax.legend(fontsize=7)
    fig.savefig(path / "slow_links_bytes.svg", bbox_inches="tight")
    plt.close(fig)
    fig, axes = plt.subplots(1, len(data["rates"]), figsize=(4.5 * len(data["rates"]), 3.6), squeeze=False,
                             sharey=True)
    for ax, rate in zip(axes[0], data["rates"]):
        timed = {w["method"]: w for w in windows if w["rate"] == rate}
        for name, curve in curves.items():
            if name in timed:
                ax.plot([i * timed[name]["seconds_per_iter"] / 3600 for i, _ in curve], [v for _, v in curve],
                        marker=".", label=name)
        ax.set_title(f"inter-host link x {rate}")
        ax.set_xlabel("projected hours (timed window x iterations)")
    axes[0][0].set_ylabel("validation loss")
    fig.suptitle(f"two hosts of two ranks, dp = 4, on {data.get('cpu', 'this machine')}", fontsize=9)
    axes[0][-1].legend(fontsize=7)
    fig.savefig(path / "slow_links_time.svg", bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    figures(json.loads((FIGURES / "slow_links.json").read_text()), FIGURES)
