"""The measurements of docs/13-experts.md, on this machine.

    python benchmarks/experts.py throughput              # tokens/s and all-to-all share, 2 and 4 ranks
    python benchmarks/experts.py routing out/metrics.jsonl   # the routing figure from a training run
    python benchmarks/experts.py balance AUX/metrics.jsonl BIAS/metrics.jsonl   # aux loss against bias
    python benchmarks/experts.py compare [--iters 300] [--seeds 0 1]   # dense and MoE, equal active parameters

`throughput` runs benchmarks/benchmark.py (the default model, random tokens) for the
dense model and for E = 4 and 8 experts with top-1 routing (the same active parameters
per token as the dense model), each on 2 and 4 ranks with the experts split over all
of them (ep = dp), and prints one JSON line per run and a table. `routing` draws the
assignments per expert of every MoE block at each logged iteration, and the dropped
share, into docs/figures/routing.svg (matplotlib). `balance` takes two runs that differ
only in --moe-load-balancing (aux-loss, then bias) and prints the balance, max load /
mean load over the experts of each MoE block, as medians over the first and the last
third of the iterations, and draws it into docs/figures/balance.svg. `compare` trains
the runs of the chapter's two tables on one process, the same tokens and iterations
(COMPARE: a small model; the MoE runs have the dense model's active parameters per
token), then runs `balance` on the two runs of 8 half-width experts, prints each run's
validation loss, and ends with one JSON line of all of it.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def benchmark(ranks: int, experts: int, iters: int) -> dict:
    moe = ["--num-experts", str(experts), "--moe-top-k", "1", "--expert-parallel-size", str(ranks)] if experts else []
    cmd = [str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "python"), "benchmarks/benchmark.py",
           "--iters", str(iters), "--warmup", "3", *moe]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout.splitlines()[-1])
    a2a = sum(v for k, v in out["comm_bytes_per_iter_by_kind"].items() if k.startswith("ep."))
    return {"ranks": ranks, "experts": experts, "tokens_per_s": out["tokens_per_s"],
            "ms_per_iter": out["ms_per_iter_median"], "all_to_all_fraction": out["all_to_all_fraction"],
            "comm_fraction": out["comm_fraction"], "all_to_all_bytes_per_iter_rank0": a2a,
            "loadavg": out["loadavg_1min_at_start"]}


def throughput(iters: int) -> None:
    rows = []
    for ranks in (2, 4):
        for experts in (0, 4, 8):
            rows.append(benchmark(ranks, experts, iters))
            print(json.dumps(rows[-1]), flush=True)
    print("| ranks | model | tokens/s | all-to-all share of a step | all-to-all MB per iteration (rank 0) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        name = f"E = {r['experts']}, top-1, ep = {r['ranks']}" if r["experts"] else "dense"
        print(f"| {r['ranks']} | {name} | {r['tokens_per_s']:,.0f} | {r['all_to_all_fraction']:.0%} | "
              f"{r['all_to_all_bytes_per_iter_rank0'] / 1e6:.2f} |")


def routing(metrics: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r for r in rows if "moe_tokens_per_expert" in r]
    rows = rows[::max(1, len(rows) // 50)]          # about 50 points: a light SVG
    iters = np.array([r["iter"] for r in rows])
    counts = np.array([r["moe_tokens_per_expert"] for r in rows], float)       # (logged, blocks, E)
    share = counts / counts.sum(axis=2, keepdims=True)
    blocks, E = counts.shape[1:]
    fig, axes = plt.subplots(1, blocks + 1, figsize=(3 * (blocks + 1), 2.8), sharex=True)
    for b in range(blocks):
        axes[b].stackplot(iters, share[:, b].T, labels=[f"expert {e}" for e in range(E)])
        axes[b].set_title(f"MoE block {b}: share of tokens", fontsize=8)
        axes[b].set_ylim(0, 1)
    axes[-1].plot(iters, [r["moe_dropped_fraction"] for r in rows], color="black")
    axes[-1].set_title("dropped share of assignments", fontsize=8)
    axes[0].legend(fontsize=6, loc="lower left")
    for ax in axes:
        ax.set_xlabel("iteration", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(REPO / "docs" / "figures" / "routing.svg", bbox_inches="tight")
    last = rows[-1]
    print(json.dumps({"iter": last["iter"], "tokens_per_expert": last["moe_tokens_per_expert"],
                      "dropped_fraction": last["moe_dropped_fraction"],
                      "mean_dropped_fraction": float(np.mean([r["moe_dropped_fraction"] for r in rows]))}))


def max_over_mean(rows) -> np.ndarray:
    """(iterations, blocks): the busiest expert's assignments over the mean."""
    counts = np.array([r["moe_tokens_per_expert"] for r in rows], float)
    return counts.max(axis=2) / counts.mean(axis=2)


SMALL = ["--n-layers", "2", "--n-heads", "4", "--d-model", "64", "--seq-len", "64", "--micro-batch-size", "8",
         "--global-batch-size", "8", "--log-interval", "1", "--eval-iters", "20", "--no-progress"]
# name: flags. Active MLP parameters per token: the dense 4C; k experts of width h, k h = 4C.
COMPARE = {"dense": [],
           "E = 4, k = 1, h = 4C, aux loss": ["--num-experts", "4", "--moe-top-k", "1"],
           "E = 8, k = 2, h = 2C, aux loss": ["--num-experts", "8", "--moe-top-k", "2", "--moe-expert-hidden", "128"],
           "E = 8, k = 2, h = 2C, bias": ["--num-experts", "8", "--moe-top-k", "2", "--moe-expert-hidden", "128",
                                          "--moe-load-balancing", "bias", "--moe-bias-update-rate", "0.001"]}


def compare(data_dir: Path, iters: int, seeds: list[int]) -> None:
    """Every run of COMPARE once per seed (the seed draws the initial weights and the
    batches); the balance figure from the first seed's two runs of 8 experts."""
    import tempfile
    val, metrics = {name: [] for name in COMPARE}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for index, (name, flags) in enumerate(COMPARE.items()):
                run = Path(tmp) / f"seed{seed}-run{index}"
                subprocess.run([str(BIN / "python"), "train_shakespeare.py", *SMALL, *flags, "--seed", str(seed),
                                "--max-iters", str(iters), "--eval-interval", str(iters), "--data-dir", str(data_dir),
                                "--out-dir", str(run)], check=True, cwd=REPO, capture_output=True)
                rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                val[name].append([r["val_loss"] for r in rows if "val_loss" in r][-1])
                metrics.setdefault(name, run / "metrics.jsonl")
                print(json.dumps({"run": name, "seed": seed, "val_loss": val[name][-1]}), flush=True)
        names = list(COMPARE)
        balanced = balance(metrics[names[2]], metrics[names[3]])
    print(f"| run (validation loss after {iters} iterations) | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |")
    print("| --- |" + " ---: |" * (len(seeds) + 1))
    for name, losses in val.items():
        print(f"| {name} | " + " | ".join(f"{v:.4f}" for v in losses) + f" | {np.mean(losses):.4f} |")
    print(json.dumps({"iterations": iters, "seeds": seeds, "val_loss": val, "balance": balanced}))


def balance(aux: Path, bias: Path) -> dict:
    import numpy as np
    curves, summary = {}, {}
    for name, metrics in (("aux loss", aux), ("bias", bias)):
        rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "moe_tokens_per_expert" in r]
        ratio = max_over_mean(rows)
        third = len(rows) // 3
        summary[name] = {"iterations": len(rows), "max_over_mean_first_third": float(np.median(ratio[:third])),
                         "max_over_mean_last_third": float(np.median(ratio[-third:])),
                         "final_train_loss": rows[-1]["train_loss"] - rows[-1].get("moe_aux_loss", 0.0)}
        print(json.dumps({"balancing": name, **summary[name]}))
        curves[name] = ([r["iter"] for r in rows], ratio.mean(axis=1))
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no figure", file=sys.stderr)
        return summary
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 2.8))
    for name, (iters, ratio) in curves.items():
        ax.plot(iters, ratio, label=name, linewidth=0.8)
    ax.axhline(1.0, color="gray", linewidth=0.5)
    ax.set_title("busiest expert's load over the mean, per iteration (mean of the MoE blocks)", fontsize=8)
    ax.set_xlabel("iteration", fontsize=8)
    ax.set_ylabel("max load / mean load", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(REPO / "docs" / "figures" / "balance.svg", bbox_inches="tight")
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--iters", type=int, default=20)
    r = sub.add_parser("routing")
    r.add_argument("metrics", type=Path)
    b = sub.add_parser("balance")
    b.add_argument("aux", type=Path)
    b.add_argument("bias", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("--iters", type=int, default=300)
    c.add_argument("--data-dir", type=Path, default=REPO / "data")
    c.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = p.parse_args()
    if args.what == "throughput":
        throughput(args.iters)
    elif args.what == "routing":
        routing(args.metrics)
    elif args.what == "compare":
        compare(args.data_dir.resolve(), args.iters, args.seeds)
    else:
        balance(args.aux, args.bias)


if __name__ == "__main__":
    main()
