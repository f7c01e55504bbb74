"""The book's conceptual diagrams, drawn from the rules they show (no run behind them):

    python benchmarks/diagrams.py [--out docs/figures] [--png]

ring_all_reduce.svg (chapter 2), tp_column_row.svg (chapter 4), mesh_order.svg
(chapter 2), zero_partitions.svg (chapters 6 and 7), zigzag_blocks.svg (chapter 10).
Each is computed from the same rule the code follows: the ring's chunk schedule, the
mesh's rank order (numpitron/distributed/topology.py: tp fastest, then cp, dp, pp), and
the zigzag split (numpitron/context_parallel/).
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from numpitron.context_parallel.zigzag import zigzag_chunks  # noqa: E402
COLOURS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"]


def box(ax, x, y, w, h, colour, text="", fontsize=8, alpha=1.0, hatch=None):
    ax.add_patch(__import__("matplotlib.patches", fromlist=["Rectangle"]).Rectangle(
        (x, y), w, h, facecolor=colour, edgecolor="black", lw=0.6, alpha=alpha, hatch=hatch))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def ring_states(n: int):
    """Reduce-scatter then all-gather on n ranks: at step s of the reduce-scatter, rank r
    sends chunk (r - s) mod n to rank r + 1, which adds it to its own; after n - 1 steps
    rank r holds the whole sum of chunk (r + 1) mod n, and the all-gather passes the sums
    on in n - 1 more steps. Returns the states (state[rank][chunk]: the set of ranks whose
    values that chunk holds summed) and each step's (phase, step, [(sender, chunk)])."""
    held = [[{r} for _ in range(n)] for r in range(n)]     # held[rank][chunk]: ranks summed in it
    states, sends = [[[set(c) for c in row] for row in held]], []
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            moves = [(r, (r - s + (1 if phase == "all-gather" else 0)) % n) for r in range(n)]
            new = [[set(c) for c in row] for row in held]
            for r, chunk in moves:
                dst = (r + 1) % n
                new[dst][chunk] = held[dst][chunk] | held[r][chunk] if phase == "reduce-scatter" else set(held[r][chunk])
            held = new
            states.append([[set(c) for c in row] for row in held])
            sends.append((phase, s, moves))
    return states, sends


def zigzag_owner(cp: int) -> list[int]:
    """Which cp rank holds each of the 2 cp blocks of a sequence, from the library's own split."""
    owner = [0] * (2 * cp)
    for rank in range(cp):
        for chunk in zigzag_chunks(2, cp, rank):         # a local length of 2: one row per block
            owner[chunk.position] = rank
    return owner


def mesh_rank(t: int, c: int, d: int, p: int, tp: int, cp: int, dp: int) -> int:
    """Megatron's order (numpitron/distributed/topology.py): tp fastest, then cp, dp, pp."""
    return t + tp * (c + cp * (d + dp * p))


def ring_all_reduce(plt, n=4):
    """The states of `ring_states`, one panel a step; a cell lists the ranks summed in it."""
    states, sends = ring_states(n)
    fig, axes = plt.subplots(1, len(states), figsize=(2.0 * len(states), 2.9))
    for i, (ax, state) in enumerate(zip(axes, states)):
        for r in range(n):
            for c in range(n):
                whole = len(state[r][c]) == n
                box(ax, c, n - 1 - r, 1, 1, COLOURS[c] if whole else "white",
                    "all" if whole else "".join(str(k) for k in sorted(state[r][c])), fontsize=7,
                    alpha=0.9 if whole else 1)
        if i:
            ax.set_title(f"{sends[i - 1][0]}\nstep {sends[i - 1][1] + 1}", fontsize=8)
            for r, chunk in sends[i - 1][2]:
                ax.plot(chunk + 0.85, n - 1 - (r + 1) % n + 0.85, "k.", ms=4)     # at the receiver
        else:
            ax.set_title("start: rank r holds\nits own values (r)", fontsize=8)
        ax.set(xlim=(0, n), ylim=(0, n), aspect="equal")
        ax.set_xticks([c + 0.5 for c in range(n)], [f"c{c}" for c in range(n)], fontsize=7)
        ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)] if i == 0 else [],
                      fontsize=7)
        ax.tick_params(length=0)
    fig.suptitle(f"A ring all-reduce on {n} ranks: each cell lists the ranks summed in that chunk "
                 "(dot: the chunk a rank received this step)", fontsize=9)
    fig.tight_layout()
    return fig


def tp_column_row(plt):
    """Megatron's MLP over tp = 2: A split by columns (each rank a slice of the hidden
    width, no communication), B by rows (each rank a partial sum), one all-reduce after."""
    fig, ax = plt.subplots(figsize=(9, 3.2))
    box(ax, 0, 1, 1.2, 2, "#dddddd", "X\n(whole on\nboth ranks)")
    ax.text(1.45, 2, "x", fontsize=12, ha="center", va="center")
    box(ax, 1.7, 1, 1.0, 2, COLOURS[0], "A1\nrank 0")
    box(ax, 2.7, 1, 1.0, 2, COLOURS[1], "A2\nrank 1")
    ax.text(2.7, 0.7, "A: column-parallel\n(split the output width)", ha="center", va="top", fontsize=8)
    ax.text(4.0, 2, "=", fontsize=12, ha="center", va="center")
    box(ax, 4.3, 1, 0.9, 2, COLOURS[0], "GeLU\n(XA1)")
    box(ax, 5.2, 1, 0.9, 2, COLOURS[1], "GeLU\n(XA2)")
    ax.text(6.35, 2, "x", fontsize=12, ha="center", va="center")
    box(ax, 6.6, 2, 1.3, 1, COLOURS[0], "B1 rank 0")
    box(ax, 6.6, 1, 1.3, 1, COLOURS[1], "B2 rank 1")
    ax.text(7.25, 0.7, "B: row-parallel\n(split the input width)", ha="center", va="top", fontsize=8)
    ax.text(8.2, 2, "=", fontsize=12, ha="center", va="center")
    box(ax, 8.5, 2.05, 1.1, 0.9, COLOURS[0], "Y1 (partial)", alpha=0.7)
    box(ax, 8.5, 1.05, 1.1, 0.9, COLOURS[1], "Y2 (partial)", alpha=0.7)
    ax.annotate("", xy=(10.3, 2), xytext=(9.65, 2), arrowprops=dict(arrowstyle="->"))
    box(ax, 10.35, 1, 1.2, 2, "#dddddd", "Y = Y1 + Y2\nall-reduce\n(g in the\nforward)")
    ax.text(5.2, 3.35, "no communication between A and B: each rank's slice of the hidden layer stays on it",
            ha="center", fontsize=8)
    ax.set(xlim=(-0.1, 11.7), ylim=(0, 3.6))
    ax.axis("off")
    ax.set_title("Tensor parallelism, tp = 2: column then row", fontsize=10)
    return fig


def mesh_order(plt, tp=2, cp=2, dp=2, pp=2):
    """16 ranks in Megatron's order: rank = tp_rank + tp (cp_rank + cp (dp_rank + dp pp_rank)),
    so the tp group is consecutive ranks (one node's NVLink) and pp is the outermost."""
    fig, axes = plt.subplots(1, pp, figsize=(8.5, 3.6))
    for stage, ax in enumerate(axes):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    rank = mesh_rank(t, c, d, stage, tp, cp, dp)
                    x, y = t + tp * c + 0.25 * c, dp - 1 - d
                    box(ax, x, y, 0.95, 0.9, COLOURS[c + cp * d], f"{rank}\nt{t} c{c} d{d}", fontsize=7)
        for d in range(dp):
            ax.text(-0.15, dp - 1 - d + 0.45, f"dp {d}", ha="right", va="center", fontsize=7)
        ax.set(xlim=(-0.9, tp * cp + 0.4), ylim=(-0.6, dp + 0.2), title=f"pipeline stage {stage} (pp rank {stage})")
        ax.title.set_fontsize(9)
        ax.axis("off")
        ax.text(tp * cp / 2, -0.35, "tp pairs side by side; cp pairs of pairs", ha="center", fontsize=7)
    fig.suptitle(f"{tp * cp * dp * pp} ranks, tp = {tp}, cp = {cp}, dp = {dp}, pp = {pp}: "
                 "tp fastest, then cp, then dp, pp outermost", fontsize=9)
    fig.tight_layout()
    return fig


def zero_partitions(plt, dp=4):
    """What each of dp ranks holds, by ZeRO stage: 2 + 2 + 12 bytes a parameter in mixed
    precision; stage 1 shards the 12, stage 2 also the 2 of gradients, stage 3 also the
    2 of parameters. Widths are bytes a parameter."""
    parts = [("params (2)", 2, 3), ("grads (2)", 2, 2), ("optimizer (12)", 12, 1)]   # the stage that shards it
    fig, axes = plt.subplots(4, 1, figsize=(8, 5.2), sharex=True)
    for stage, ax in enumerate(axes):
        for r in range(dp):
            x = 0
            for (name, width, shard_at), colour in zip(parts, COLOURS):
                if stage >= shard_at:
                    slot = width / dp
                    for k in range(dp):
                        mine = k == r
                        box(ax, x + k * slot, dp - 1 - r, slot, 0.8, colour if mine else "white",
                            alpha=1 if mine else 0.3)
                else:
                    box(ax, x, dp - 1 - r, width, 0.8, colour, name if r == 0 else "", fontsize=7)
                x += width
            ax.text(-0.2, dp - 1 - r + 0.4, f"rank {r}", ha="right", va="center", fontsize=7)
        held = sum(w / dp if stage >= s else w for _, w, s in parts)
        ax.set_title(f"ZeRO-{stage}: {held:g} bytes a parameter per rank", fontsize=8, loc="left")
        ax.set(xlim=(-1.5, 16.2), ylim=(-0.1, dp))
        ax.axis("off")
    fig.suptitle(f"What each of dp = {dp} ranks holds (coloured: its own; white: another rank's share)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def zigzag_blocks(plt):
    """The zigzag split: the sequence in 2 cp blocks, rank r taking blocks r and 2cp - 1 - r,
    so every rank gets as much of the causal mask's lower triangle as any other."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.4))
    for ax, cp in zip(axes, (2, 4)):
        n = 2 * cp
        owner = zigzag_owner(cp)
        for q in range(n):
            for k in range(n):
                if k <= q:
                    box(ax, k, n - 1 - q, 1, 1, COLOURS[owner[q]], "½" if k == q else "", fontsize=7,
                        alpha=1 if k < q else 0.6)
        for b in range(n):
            ax.text(-0.1, n - 1 - b + 0.5, f"block {b}: rank {owner[b]}", ha="right", va="center", fontsize=7)
        work = [sum(q + 0.5 for q in range(n) if owner[q] == r) for r in range(cp)]
        ax.set(xlim=(-3.2, n + 0.1), ylim=(-1.2, n + 0.1), aspect="equal")
        ax.axis("off")
        ax.set_title(f"cp = {cp}: {n} blocks, query rows by owner", fontsize=9)
        ax.text(n / 2, -0.6, "keys -> (½: the diagonal block, half masked); "
                f"blocks of work per rank: {', '.join(f'{w:g}' for w in work)}", ha="center", fontsize=7)
    fig.suptitle("Zigzag: rank r takes blocks r and 2cp - 1 - r of every sequence", fontsize=9)
    fig.tight_layout()
    return fig


DIAGRAMS = {"ring_all_reduce": ring_all_reduce, "tp_column_row": tp_column_row, "mesh_order": mesh_order,
            "zero_partitions": zero_partitions, "zigzag_blocks": zigzag_blocks}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "docs" / "figures"))
    p.add_argument("--png", action="store_true", help="also write a PNG of each, to look at")
    args = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "numpitron"          # the same ids on every redraw
    import matplotlib.pyplot as plt
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, draw in DIAGRAMS.items():
        fig = draw(plt)
        fig.savefig(out / f"{name}.svg", bbox_inches="tight", metadata={"Date": None})   # no churn on a redraw
        if args.png:
            fig.savefig(out / f"{name}.png", bbox_inches="tight", dpi=110)
        plt.close(fig)
    print(f"wrote {', '.join(f'{n}.svg' for n in DIAGRAMS)} in {out}")


if __name__ == "__main__":
    main()
