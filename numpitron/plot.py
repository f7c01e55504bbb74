"""python -m numpitron.plot OUT_DIR [OUT_DIR ...] [-o FILE.svg]: the train and validation
loss of one or more runs against what learners compare them by: iterations, tokens
seen, wall time and bytes communicated (matplotlib: the `docs` extra).

Read from each run's metrics.jsonl and config.toml (for the sequence length; 64, the
default, without one). Tokens and bytes are summed over the iterations: a row stands for
the iterations since the row before it (with --log-interval > 1, the iterations between
two rows are taken to move the bytes of the row that ends them, which a fixed layout
does). The bytes are the logging rank's (rank 0), as metrics.jsonl counts them."""

import argparse
import tomllib
from pathlib import Path

from numpitron.errors import UserError, exit_with_one_line
from numpitron.metrics import read_rows
from numpitron.rundir import METRICS_NAME

AXES = (("iteration", "iteration"), ("tokens", "tokens seen"), ("seconds", "wall time (s)"),
        ("bytes", "bytes communicated by rank 0"))


def curves(out_dir) -> dict:
    """{"iteration", "tokens", "seconds", "bytes": one value per row, "train_loss": per row,
    "val": [(row index, val loss)]} of one run."""
    out_dir = Path(out_dir)
    path = out_dir / METRICS_NAME
    if not path.is_file():
        raise UserError(f"{out_dir}: no {METRICS_NAME}: not a run's --out-dir")
    rows = sorted(read_rows(path)[0], key=lambda r: r["iter"])
    config = out_dir / "config.toml"
    seq_len = tomllib.loads(config.read_text()).get("model", {}).get("seq_len", 64) if config.is_file() else 64
    out = {key: [] for key, _ in AXES} | {"train_loss": [], "val": []}
    tokens = moved = 0.0
    last = 0
    for row in rows:
        steps = row["iter"] - last
        tokens += steps * row.get("global_batch_size", 0) * seq_len
        moved += steps * row.get("comm_bytes", 0.0)
        last = row["iter"]
        for key, value in zip(("iteration", "tokens", "seconds", "bytes", "train_loss"),
                              (row["iter"], tokens, row.get("elapsed_s", 0.0), moved, row["train_loss"])):
            out[key].append(value)
        if "val_loss" in row:
            out["val"].append((len(out["iteration"]) - 1, row["val_loss"]))
    return out


def plot(out_dirs: list, output: str) -> None:
    import matplotlib
    matplotlib.use("svg" if output.endswith(".svg") else "Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): curves(d) for d in out_dirs}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharey=True)
    for ax, (key, label) in zip(axes.flat, AXES):
        for (name, run), colour in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10):
            ax.plot(run[key], run["train_loss"], color=colour, lw=1, alpha=0.6, label=f"{name} train")
            if run["val"]:
                ax.plot([run[key][i] for i, _ in run["val"]], [v for _, v in run["val"]], "o-", color=colour,
                        ms=3, label=f"{name} val")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("loss")
    axes[0, 0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numpitron.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dirs", nargs="+", metavar="OUT_DIR")
    parser.add_argument("-o", "--output", default="loss.svg", metavar="FILE.svg")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install -e '.[docs]'")
    plot(args.out_dirs, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    exit_with_one_line(main)
