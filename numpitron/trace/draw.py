"""`python -m numpitron.trace draw FILE.json OUT.svg`: one traced step of every rank as a
figure for the book (matplotlib, the `docs` extra). A row per rank's computation, its
operations coloured by kind (forward, whole backward, input half, weight half, the
optimizer), and under it a row per communicator group: solid where the rank waits in
it, pale where a non-blocking collective of the group is in flight."""

from numpitron.trace.summary import spans_by_rank

COLOURS = {"F": "#4c72b0", "BW": "#55a868", "B": "#8fbf6a", "W": "#c4a000", "optimizer": "#8172b2",
           "finalize grads": "#999999"}
GROUP_COLOUR, FLYING_COLOUR = "#dd8452", "#f6d5bd"     # waiting in a collective; one in flight


def step_window(events: list, iteration: int | None) -> tuple[int, float, float]:
    steps = sorted((e for e in events if e["name"] == "step" and e.get("cat") == "step"), key=lambda e: e["ts"])
    if not steps:
        raise ValueError("the trace holds no traced step")
    step = next((s for s in steps if s["args"]["iteration"] == iteration), None) if iteration else steps[0]
    if step is None:
        raise ValueError(f"iteration {iteration} is not in the trace ({[s['args']['iteration'] for s in steps]})")
    return step["args"]["iteration"], step["ts"], step["ts"] + step["dur"]


def rows_of(trace: dict, iteration: int | None):
    """[(label, [(start_ms, length_ms, colour, alpha)])] top to bottom, and the iteration."""
    ranks = spans_by_rank(trace)
    it, start, end = step_window(ranks[min(ranks)], iteration)
    for events in ranks.values():             # the step of the same iteration on every rank
        _, s, e = step_window(events, it)
        start, end = min(start, s), max(end, e)
    rows = []
    for rank, events in sorted(ranks.items()):
        inside = [e for e in events if e["ts"] < end and e["ts"] + e["dur"] > start]
        compute = [((e["ts"] - start) / 1e3, e["dur"] / 1e3,
                    COLOURS["optimizer"] if e.get("cat") == "optimizer" else
                    COLOURS.get(e["args"].get("op"), COLOURS["finalize grads"]), 1.0)
                   for e in inside if e.get("cat") in ("compute", "optimizer")]
        rows.append((f"rank {rank}", compute))
        groups = {}
        for e in inside:
            if e.get("cat") in ("comm", "wait"):
                flying = e.get("cat") == "comm" and not e["args"].get("blocking")
                groups.setdefault(e["args"]["group"], []).append(
                    ((e["ts"] - start) / 1e3, e["dur"] / 1e3, FLYING_COLOUR if flying else GROUP_COLOUR, 1.0))
        # in flight first, the waits drawn over them
        rows += [(f"  {group}", sorted(bars, key=lambda bar: bar[2] == GROUP_COLOUR))
                 for group, bars in sorted(groups.items())]
    return rows, it, (end - start) / 1e3


def draw_on(ax, trace: dict, iteration: int | None = None, title: str | None = None,
            length: float | None = None, legend: bool = True) -> float:
    """One step on matplotlib axes `ax`; returns its length in ms (`length`: the x axis's,
    to set two steps on one scale)."""
    from matplotlib.patches import Patch

    rows, it, step = rows_of(trace, iteration)
    for y, (_, bars) in enumerate(rows):
        for x, width, colour, alpha in bars:
            ax.broken_barh([(x, max(width, step * 1e-4))], (y - 0.4, 0.8), facecolors=colour, alpha=alpha)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, length or step)
    ax.set_xlabel("ms from the step's start")
    ax.set_title(title or f"iteration {it}")
    if legend:
        handles = [Patch(color=c, label=k) for k, c in COLOURS.items()]
        handles += [Patch(color=GROUP_COLOUR, label="waiting in a collective"),
                    Patch(color=FLYING_COLOUR, label="collective in flight")]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    return step


def draw(trace: dict, out: str, iteration: int | None = None, title: str | None = None) -> None:
    import matplotlib
    matplotlib.use("svg" if str(out).endswith(".svg") else "Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.35 * len(rows_of(trace, iteration)[0]) + 1.4))
    draw_on(ax, trace, iteration, title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
