"""Pipeline schedules in time: each stage runs its list (pipeline_parallel/schedules.py) in
order, every operation as soon as what it depends on has finished.

`simulate` runs a schedule's dependencies with unit costs: it proves a schedule
complete and deadlock-free (the executor blocks only on receives, which is what it
models) and gives its ideal bubble. With real costs and a transfer time per message it
is the planner's pipeline on links (plan/links.py).
"""

from fractions import Fraction
from functools import lru_cache

from numpitron.pipeline_parallel.placement import StagePlacement
from numpitron.pipeline_parallel.schedules import (BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Op, make_schedule,
                                          placement_of)

# Relative costs for the ideal timeline: the input and the weight halves each cost
# about a forward (two matmuls of the same size per linear layer).
UNIT_COST = {FORWARD: 1, INPUT_GRAD: 1, WEIGHT_GRAD: 1, BACKWARD: 2}


def dependencies(op: Op, rank: int, placement: StagePlacement) -> list[tuple[Op, int]]:
    """(operation, pp rank) pairs that must finish before `op` can start on `rank`."""
    stage = placement.stage(rank, op.chunk)
    if op.action == FORWARD:
        if stage == 0:
            return []
        before, chunk = placement.holder(stage - 1)
        return [(Op(FORWARD, op.microbatch, chunk), before)]
    if op.action == WEIGHT_GRAD:
        return [(Op(INPUT_GRAD, op.microbatch, op.chunk), rank)]
    needs = [(Op(FORWARD, op.microbatch, op.chunk), rank)]
    if stage < placement.stages - 1:                   # the gradient from the next virtual stage
        after, chunk = placement.holder(stage + 1)
        needs.append((Op(INPUT_GRAD, op.microbatch, chunk), after))
    return needs


class ScheduleError(ValueError):
    pass


def simulate(schedules: list[list[Op]], m: int, v: int = 1, cost=None, v_shape: bool = False,
             events: dict | None = None, paired: bool = False, transfer=None) -> list[Fraction]:
    """Run every stage's list in order, each operation as soon as what it depends on
    has finished (cost: time per action, divided by v per chunk, or a list of such, one
    per stage; v_shape: the V placement). Returns the time each stage finishes;
    `events`, when given, receives {(op, rank): (start, end)}. Raises ScheduleError if
    an operation is missing, repeated, or waits forever (the executor would deadlock).
    paired: an F followed by a BW starts only when both inputs are in, as DualPipe's
    overlapped pair does (this executor starts the F alone, as soon as it can).
    transfer(from_rank, to_rank): seconds a message between two stages takes; each
    link carries one message at a time, in the order they are sent (the planner's
    pipeline on links, docs/15-planning-a-run.md)."""
    p, cost = len(schedules), cost or UNIT_COST
    costs = cost if isinstance(cost, list) else [cost] * p
    placement = StagePlacement(p, v, v_shape)
    for rank, ops in enumerate(schedules):
        check_complete(ops, m, v, rank)
    finished, clock, position = {}, [Fraction(0)] * p, [0] * p
    arrival, link_free = {}, {}

    def ready(dep, rank):
        """When a dependency's result is on `rank`: at once on its own rank, else after
        its message has waited for the link and crossed it."""
        op, source = dep
        if transfer is None or source == rank:
            return finished[dep]
        if (dep, rank) not in arrival:
            start = max(finished[dep], link_free.get((source, rank), 0))
            arrival[(dep, rank)] = link_free[(source, rank)] = start + transfer(source, rank)
        return arrival[(dep, rank)]
    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(schedules):
            while position[rank] < len(ops):
                op = ops[position[rank]]
                needs = dependencies(op, rank, placement)
                following = ops[position[rank] + 1] if position[rank] + 1 < len(ops) else None
                if paired and op.action == FORWARD and following and following.action == BACKWARD:
                    needs = needs + [dep for dep in dependencies(following, rank, placement)
                                     if dep != (following._replace(action=FORWARD), rank)]
                if not all(dep in finished for dep in needs):
                    break
                begin = max([clock[rank]] + [ready(dep, rank) for dep in needs])
                each = costs[rank][op.action]
                clock[rank] = begin + (Fraction(each, v) if isinstance(each, (int, Fraction)) else each / v)
                if events is not None:
                    events[(op, rank)] = (begin, clock[rank])
                finished[(op, rank)] = clock[rank]
                if op.action == BACKWARD:               # a whole backward includes the input half
                    finished[(op._replace(action=INPUT_GRAD), rank)] = clock[rank]
                position[rank] += 1
                progress = True
    stuck = {rank: str(ops[position[rank]]) for rank, ops in enumerate(schedules) if position[rank] < len(ops)}
    if stuck:
        raise ScheduleError(f"deadlock: stages wait forever at {stuck}")
    return clock


def check_complete(ops: list[Op], m: int, v: int, rank: int = 0) -> None:
    """Every (micro-batch, chunk) once forward and once backward (BW, or B and W),
    nothing else, nothing twice."""
    present, expected = set(ops), set()
    for i in range(m):
        for c in range(v):
            backward = {BACKWARD} if Op(BACKWARD, i, c) in present else {INPUT_GRAD, WEIGHT_GRAD}
            expected |= {Op(action, i, c) for action in {FORWARD} | backward}
    if len(ops) != len(present) or present != expected:
        missing, extra = expected - present, present - expected
        twice = {op for op in ops if ops.count(op) > 1}
        raise ScheduleError(f"stage {rank}: missing {sorted(map(str, missing))}, unexpected "
                            f"{sorted(map(str, extra))}, repeated {sorted(map(str, twice))}")


@lru_cache(maxsize=256)
def ideal_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The bubble of the schedule's unit-cost timeline: 1 - busy / (p * makespan)."""
    placement = placement_of(name, p, v)
    schedules = [make_schedule(name, m, p, stage, placement.v) for stage in range(p)]
    makespan = max(simulate(schedules, m, placement.v, v_shape=placement.v_shape))
    busy = sum(Fraction(UNIT_COST[op.action], placement.v) for ops in schedules for op in ops)
    return float(1 - busy / (p * makespan))


def peak_in_flight(ops: list[Op]) -> int:
    """The most (micro-batch, chunk) pairs whose caches are alive at once: from their
    forward until their whole backward or their weight half."""
    alive = peak = 0
    for op in ops:
        alive += {FORWARD: 1, BACKWARD: -1, WEIGHT_GRAD: -1}.get(op.action, 0)
        peak = max(peak, alive)
    return peak
