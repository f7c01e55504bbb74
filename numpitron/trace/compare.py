"""`python -m numpitron.trace compare MEASURED PREDICTED`: where a measured step and the
planner's prediction of it part, rank by rank (the ranks both traces hold: the
prediction has the first rank of each stage): the step, the shares of the summary,
each kind of operation's mean time, and the operations whose ends part the most, each
time taken from its step's start."""

from numpitron.trace.summary import spans_by_rank, summarize

KINDS = ("F", "BW", "B", "W")


def step_of(events: list, iteration: int | None):
    steps = sorted((e for e in events if e["name"] == "step" and e.get("cat") == "step"), key=lambda e: e["ts"])
    return next((s for s in steps if iteration is None or s["args"]["iteration"] == iteration), None)


def operations(events: list, step: dict) -> dict:
    """{"F 3" (and the chunk when there are several): (start_ms, end_ms)} of the step's
    training operations, from the step's start."""
    out, end = {}, step["ts"] + step["dur"]
    for e in events:
        if e.get("cat") == "compute" and "op" in e["args"] and step["ts"] <= e["ts"] <= end:
            key = e["name"] + (f" chunk {e['args']['chunk']}" if e["args"].get("chunk") else "")
            out[key] = ((e["ts"] - step["ts"]) / 1e3, (e["ts"] + e["dur"] - step["ts"]) / 1e3)
    return out


def compare(measured: dict, predicted: dict, iteration: int | None = None, worst: int = 5) -> list[dict]:
    rows_m = {(r["rank"], r["iteration"]): r for r in summarize(measured)}
    rows_p = {r["rank"]: r for r in summarize(predicted)}
    ranks_m, ranks_p = spans_by_rank(measured), spans_by_rank(predicted)
    out = []
    for rank in sorted(set(ranks_m) & set(ranks_p)):
        step_m, step_p = step_of(ranks_m[rank], iteration), step_of(ranks_p[rank], None)
        if step_m is None or step_p is None:
            continue
        ops_m, ops_p = operations(ranks_m[rank], step_m), operations(ranks_p[rank], step_p)
        kinds = {}
        for kind in KINDS:
            pair = [[end - start for name, (start, end) in ops.items() if name.split()[0] == kind]
                    for ops in (ops_m, ops_p)]
            if pair[0] and pair[1]:
                kinds[kind] = {"measured_ms": sum(pair[0]) / len(pair[0]), "predicted_ms": sum(pair[1]) / len(pair[1])}
        parted = sorted(((name, ops_m[name][1], ops_p[name][1]) for name in ops_m.keys() & ops_p.keys()),
                        key=lambda item: -abs(item[1] - item[2]))[:worst]
        row_m, row_p = rows_m[(rank, step_m["args"]["iteration"])], rows_p[rank]
        out.append({"rank": rank, "iteration": step_m["args"]["iteration"],
                    "step_ms": {"measured": step_m["dur"] / 1e3, "predicted": step_p["dur"] / 1e3},
                    "shares": {key: {"measured": share(row_m, key), "predicted": share(row_p, key)}
                               for key in ("compute", "exposed", "hidden", "idle", "bubble")},
                    "operations": kinds,
                    "parted_most": [{"operation": name, "measured_end_ms": a, "predicted_end_ms": b}
                                    for name, a, b in parted]})
    return out


def share(row: dict, key: str):
    value = row[key]
    return sum(value.values()) if isinstance(value, dict) else value


def text(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        s = r["step_ms"]
        lines.append(f"rank {r['rank']} iter {r['iteration']}: step measured {s['measured']:.2f} ms, predicted "
                     f"{s['predicted']:.2f} ms (x{s['measured'] / s['predicted']:.2f})")
        lines.append("    shares measured / predicted: " + ", ".join(
            f"{k} {100 * v['measured']:.1f}% / {100 * v['predicted']:.1f}%" for k, v in r["shares"].items()
            if v["measured"] is not None and v["predicted"] is not None))
        lines.append("    mean operation measured / predicted: " + ", ".join(
            f"{k} {v['measured_ms']:.2f} / {v['predicted_ms']:.2f} ms" for k, v in r["operations"].items()))
        lines.append("    ends that part most: " + ", ".join(
            f"{p['operation']} {p['measured_end_ms']:.1f} / {p['predicted_end_ms']:.1f} ms" for p in r["parted_most"]))
    return "\n".join(lines)
