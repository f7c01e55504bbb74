"""The planner's predicted step as a trace, in the format and with the names of a
measured one, so that the two open side by side and `trace compare` can set them span
against span (`python -m numpitron.plan ... --trace FILE.json`).

What the planner predicts, laid out in time (numpitron/plan/predict.py gives the
numbers): each stage's micro-batch at its priced compute time t (a forward t/3, a whole
backward 2t/3, each half t/3, as the schedule's unit costs have it), the schedule run
by the same timeline that proves it deadlock-free (pipeline_parallel/timeline.py), a
stage's wait for its neighbour as a receive on its `pp` track, then the step's exposed
communication as one span and the optimizer step; the communication the planner
hides, as in flight during the schedule's end. A process per
pipeline stage, numbered as the stage's first global rank, as in a measured trace.

The layout is the planner's, not a measurement's: its sum is the planner's step only
where the two models coincide (one rank per core, stages of equal cost); the planner's
own step time stands in `otherData` beside it."""

import json
from pathlib import Path

from numpitron.pipeline_parallel.schedules import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, make_schedule, \
    placement_of
from numpitron.pipeline_parallel.timeline import simulate
from numpitron.trace.chrome import microseconds

COMPUTE_KINDS = ("matmul", "elementwise", "exp", "calls")


def predicted_trace(result: dict, schedule: str, virtual_stages: int, hostname: str = "predicted") -> dict:
    """result: the planner's `plan(...)` of one layout."""
    mesh, m = result["mesh"], result["microbatches"]
    pp, stride = mesh["pp"], mesh["tp"] * mesh["cp"] * mesh["dp"]
    placement = placement_of(schedule, pp, virtual_stages)
    per_mb = [sum(stage["time_s"][k] for k in COMPUTE_KINDS) / m for stage in result["stages"]]
    costs = [{FORWARD: t / 3, BACKWARD: 2 * t / 3, INPUT_GRAD: t / 3, WEIGHT_GRAD: t / 3} for t in per_mb]
    schedules = [make_schedule(schedule, m, pp, stage, placement.v) for stage in range(pp)]
    timeline = {}
    ends = simulate(schedules, m, placement.v, costs, placement.v_shape, events=timeline)
    makespan = float(max(ends))
    events = []

    def span(pid, name, cat, start, end, track=0, **args):
        ts = microseconds(start)
        events.append({"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": round(microseconds(end) - ts, 3),
                       "pid": pid, "tid": track, "args": args})
    for stage, info in enumerate(result["stages"]):
        pid, t = stage * stride, info["time_s"]
        label = f"rank {pid} (pp {stage}, dp 0, cp {mesh['cp'] - 1}, tp 0) on {hostname}"
        events += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "ts": 0, "args": {"name": label}},
                   {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "ts": 0,
                    "args": {"sort_index": pid}},
                   {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "ts": 0, "args": {"name": "compute"}},
                   {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "ts": 0,
                    "args": {"name": "exposed communication"}}]
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 2, "ts": 0, "args": {"name": "pp"}})
        free = 0.0
        for (op, rank), (start, end) in sorted(timeline.items(), key=lambda item: item[1]):
            if rank != stage:
                continue
            if float(start) > free:         # waiting for the neighbour's activations or gradient
                span(pid, "pp.recv", "comm", free, float(start), track=2, group="pp", bytes=0, blocking=True)
            span(pid, f"{op.action} {op.microbatch}", "compute", float(start), float(end), op=op.action,
                 microbatch=op.microbatch, chunk=op.chunk, virtual_stage=placement.stage(rank, op.chunk))
            free = float(end)
        exposed, optimizer = t["exposed_comm"], t["optimizer"] + t["newton_schulz"]
        step = makespan + exposed + optimizer
        # What the planner hides (its links' seconds beyond the exposed ones: the buckets
        # but the last behind the backward) as in flight until the schedule ends.
        hidden = max(0.0, sum(tier["seconds"] for tier in info["tiers"].values()) - exposed)
        if hidden > 0:
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 3, "ts": 0,
                           "args": {"name": "all in flight"}})
            span(pid, "hidden communication", "comm", max(0.0, makespan - hidden), makespan, track=3, group="all",
                 bytes=0, blocking=False)
        span(pid, "forward and backward", "step", 0.0, makespan)
        span(pid, "finalize grads", "compute", makespan, makespan)
        span(pid, "exposed communication", "wait", makespan, makespan + exposed, track=1, group="all")
        span(pid, "optimizer step", "optimizer", makespan + exposed, step)
        span(pid, "step", "step", 0.0, step, iteration=1)
    other = {"predicted": True, "iterations": [1], "mesh": {k: mesh[k] for k in ("tp", "pp", "dp", "cp", "ep")},
             "planner_step_ms": round(result["step_s"] * 1e3, 3), "planner_bubble": result["bubble"]}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_predicted(path, result: dict, schedule: str, virtual_stages: int) -> None:
    Path(path).write_text(json.dumps(predicted_trace(result, schedule, virtual_stages)))
