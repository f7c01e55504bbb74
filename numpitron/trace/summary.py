"""Where each rank's step went, from a trace: every instant of a step falls in exactly
one class, so the shares add up to 1.

    exposed[g]   the rank waits in a collective of group g (blocking, or the wait of a
                 non-blocking one)
    idle         the rank neither computes nor waits in a collective: the pipeline's
                 receives and its sends' waits (the bubble), and the loop's own work
    hidden[g]    the rank computes while a non-blocking collective of g is in flight
                 (when several are, the one started first). A pipeline send is left
                 out: its rank learns that it completed only at the end of the schedule
    compute      the rank computes with nothing in flight

Computing means inside a pipeline operation, the gradients' finalisation or the
optimizer step. `bubble` is the pipeline executor's statistic measured on the trace:
the share of the schedule (from its first receive or operation until the gradients'
finalisation) spent outside the operations."""

import json
from pathlib import Path

PIPELINE_WAITS = ("pp.send", "pp.recv", "pp.send wait", "pp.recv wait")


def load(path) -> dict:
    return json.loads(Path(path).read_text())


def spans_by_rank(trace: dict) -> dict:
    out = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            out.setdefault(event["pid"], []).append(event)
    return out


def classify(event) -> tuple | None:
    """What an event contributes to the sweep: (kind, group) or None."""
    cat, name = event.get("cat"), event["name"]
    if cat in ("compute", "optimizer"):
        return "compute", None
    blocking = cat == "wait" or (cat == "comm" and event["args"].get("blocking"))
    if name in PIPELINE_WAITS:
        return ("pipeline", None) if blocking else None
    if blocking:
        return "blocked", event["args"]["group"]
    if cat == "comm":
        return "flying", event["args"]["group"]
    return None


def partition(events: list, start: float, end: float) -> dict:
    """Microseconds of [start, end) in each class (the module's docstring)."""
    points = []
    for i, e in enumerate(events):
        kind = classify(e)
        if kind and e["ts"] < end and e["ts"] + e["dur"] > start and e["dur"] > 0:
            points += [(max(e["ts"], start), 1, i, kind), (min(e["ts"] + e["dur"], end), -1, i, kind)]
    points.sort(key=lambda p: (p[0], p[1]))
    counts = {"compute": 0, "pipeline": 0}
    blocked, flying, out = {}, {}, {"compute": 0.0, "idle": 0.0, "exposed": {}, "hidden": {}}
    last = start
    for t, change, i, (kind, group) in points:
        if t > last:
            share(out, last, t, counts, blocked, flying)
            last = t
        if kind in counts:
            counts[kind] += change
        elif kind == "blocked":
            blocked[group] = blocked.get(group, 0) + change
        elif change > 0:
            flying[i] = (events[i]["ts"], group)
        else:
            flying.pop(i, None)
    if end > last:
        share(out, last, end, counts, blocked, flying)
    return out


def share(out: dict, a: float, b: float, counts: dict, blocked: dict, flying: dict) -> None:
    waiting = [g for g, n in blocked.items() if n > 0]
    if waiting:
        out["exposed"][waiting[0]] = out["exposed"].get(waiting[0], 0.0) + b - a
    elif counts["pipeline"] > 0 or counts["compute"] <= 0:
        out["idle"] += b - a
    elif flying:
        group = min(flying.values())[1]
        out["hidden"][group] = out["hidden"].get(group, 0.0) + b - a
    else:
        out["compute"] += b - a


def bubble(events: list, start: float, end: float) -> float | None:
    """1 - (time in pipeline operations) / (the forward-and-backward phase until the
    gradients' finalisation): what the executor's PipelineStats reports."""
    inside = [e for e in events if start <= e["ts"] and e["ts"] + e["dur"] <= end]
    phase = next((e for e in inside if e["name"] == "forward and backward"), None)
    final = next((e for e in inside if e["name"] == "finalize grads"), None)
    if phase is None or final is None:
        return None
    schedule = [e for e in inside if phase["ts"] <= e["ts"] < final["ts"]
                and (e["name"] in PIPELINE_WAITS or (e.get("cat") == "compute" and "op" in e["args"]))]
    if not schedule:
        return None
    window = final["ts"] - min(e["ts"] for e in schedule)      # from its first receive or operation
    busy = sum(e["dur"] for e in schedule if e.get("cat") == "compute")
    return 1.0 - busy / window if window > 0 else 0.0


def summarize(trace: dict) -> list[dict]:
    """One row per rank and traced iteration: milliseconds and shares of its step (and
    the pipeline's bubble when there is a pipeline)."""
    rows, pipeline = [], trace.get("otherData", {}).get("mesh", {}).get("pp", 1) > 1
    for rank, events in sorted(spans_by_rank(trace).items()):
        steps = sorted((e for e in events if e["name"] == "step" and e.get("cat") == "step"), key=lambda e: e["ts"])
        for step in steps:
            start, end, it = step["ts"], step["ts"] + step["dur"], step["args"]["iteration"]
            parts = partition(events, start, end)
            total = end - start
            row = {"rank": rank, "iteration": it, "step_ms": total / 1e3,
                   "compute": parts["compute"] / total, "idle": parts["idle"] / total,
                   "exposed": {g: v / total for g, v in sorted(parts["exposed"].items())},
                   "hidden": {g: v / total for g, v in sorted(parts["hidden"].items())},
                   "bubble": bubble(events, start, end) if pipeline else None}
            row.update({name.replace(" ", "_") + "_ms": e["dur"] / 1e3 for e in events if e.get("cat") == "loop"
                        and e["args"].get("iteration") == it for name in [e["name"]]})
            rows.append(row)
    return rows


def share_sum(row: dict) -> float:
    return row["compute"] + row["idle"] + sum(row["exposed"].values()) + sum(row["hidden"].values())


def text(rows: list[dict]) -> str:
    def shares(d):
        return ", ".join(f"{g} {100 * v:.1f}%" for g, v in d.items()) or "none"
    lines = []
    for r in rows:
        extra = "".join(f", {k[:-3].replace('_', ' ')} {r[k]:.1f} ms" for k in ("evaluation_ms", "checkpoint_save_ms")
                        if k in r)
        bubble_text = "" if r["bubble"] is None else f" (pipeline bubble {100 * r['bubble']:.1f}%)"
        lines.append(f"rank {r['rank']} iter {r['iteration']}: step {r['step_ms']:.2f} ms{extra}\n"
                     f"    compute {100 * r['compute']:.1f}% | exposed {shares(r['exposed'])} | "
                     f"hidden {shares(r['hidden'])} | idle {100 * r['idle']:.1f}%{bubble_text}")
    return "\n".join(lines)
