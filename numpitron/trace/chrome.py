"""Every rank's recording merged into one Chrome Trace Event Format object (the JSON
object form Perfetto and chrome://tracing open):

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

A process per rank ("pid": the world rank), named with its mesh coordinates and host;
a thread per track: "compute" first, then each communicator group, each followed by its
"in flight" tracks (non-blocking collectives, laid out so that no two on one track
overlap). Spans are complete events ("ph": "X", "ts" and "dur" in microseconds on rank
0's clock); each message is an arrow from the span that sent it to the span that
received it (flow events "s" and "f")."""

from numpitron.trace.comm_probe import IN_FLIGHT
from numpitron.trace.recorder import COMPUTE

GROUP_ORDER = ("world", "tp", "cp", "cp_ulysses", "cp_ring", "ep", "dp", "dp_cp", "dp_shard", "dp_replica",
               "expert_dp", "expert_dp_shard", "pp", "embedding", "model", "expert_model", "dp_shard_model",
               "diloco", "diloco_metrics")


def microseconds(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def lanes(spans: list) -> dict:
    """{id(span): lane}: in-flight spans of one group, each on the first lane free at its
    start, so no two on one lane overlap."""
    ends, lane_of = [], {}
    for span in sorted(spans, key=lambda s: (s[3], s[4])):
        lane = next((i for i, end in enumerate(ends) if end <= span[3]), len(ends))
        if lane < len(ends):
            ends[lane] = span[4]
        else:
            ends.append(span[4])
        lane_of[id(span)] = lane
    return lane_of


def rank_events(record: dict, clock, zero: float) -> tuple[list, dict]:
    """This rank's metadata and complete events; {span index: (tid, ts, end)} for arrows."""
    pid, spans = record["rank"], record["spans"]
    flying = {}
    for span in spans:
        if span[2].endswith(IN_FLIGHT):
            flying.setdefault(span[2], []).append(span)
    lane_of = {k: v for group in flying.values() for k, v in lanes(group).items()}

    def track(span):
        return span[2] if id(span) not in lane_of else f"{span[2]} {lane_of[id(span)] + 1}"
    names = {track(s) for s in spans}
    order = [COMPUTE] + [name for group in GROUP_ORDER for name in sorted(
        (n for n in names if n == group or n.startswith(group + IN_FLIGHT + " ")), key=lambda n: (len(n), n))]
    order += sorted(names - set(order))
    tid = {name: i for i, name in enumerate(order)}
    coords = record["coords"]
    label = f"rank {pid} (" + ", ".join(f"{k} {v}" for k, v in coords.items()) + f") on {record['host']}"
    events = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "ts": 0, "args": {"name": label}},
              {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "ts": 0, "args": {"sort_index": pid}}]
    for name, i in tid.items():
        events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": i, "ts": 0, "args": {"name": name}},
                   {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": i, "ts": 0, "args": {"sort_index": i}}]
    where = {}
    for index, (name, category, _, start, end, args) in enumerate(spans):
        ts, stop = microseconds(clock(start) - zero), microseconds(clock(end) - zero)
        t = tid[track(spans[index])]
        events.append({"name": name, "cat": category, "ph": "X", "ts": ts, "dur": round(stop - ts, 3), "pid": pid,
                       "tid": t, "args": args})
        where[index] = (t, ts, stop)
    return events, where


def arrows(records: list, places: list) -> list:
    """Flow events for every message whose both ends were recorded."""
    ends = {}
    for record, where in zip(records, places):
        for end, key, index in record["flows"]:
            ends.setdefault(tuple(key), {})[end] = (record["rank"], *where[index])
    events = []
    for number, (key, both) in enumerate(sorted(ends.items(), key=lambda kv: str(kv[0]))):
        if len(both) < 2:
            continue
        (src, s_tid, s_ts, _), (dst, r_tid, r_ts, r_end) = both["out"], both["in"]
        name = f"{key[0]} message"
        events += [{"name": name, "cat": "message", "ph": "s", "id": number, "pid": src, "tid": s_tid, "ts": s_ts},
                   {"name": name, "cat": "message", "ph": "f", "bp": "e", "id": number, "pid": dst, "tid": r_tid,
                    "ts": round(max(r_ts, r_end - 0.5), 3)}]
    return events


def merge(records: list, clocks: list, zero: float, other: dict) -> dict:
    """records: every rank's {"rank", "coords", "host", "spans", "flows"}; clocks: each
    rank's function to rank 0's clock; zero: the trace's time 0 on rank 0's clock."""
    events, places = [], []
    for record, clock in zip(records, clocks):
        rank_list, where = rank_events(record, clock, zero)
        events += rank_list
        places.append(where)
    events += arrows(records, places)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
