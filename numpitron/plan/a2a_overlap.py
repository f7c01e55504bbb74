"""The experts' all-to-all time a schedule's pairs hide (chunk_pairing/, docs/11-pipeline-schedules.md and docs/13-experts.md).

A rank's all-to-alls per iteration take T (their bytes and calls on their links, as for
every collective). Unpaired, all of T is exposed: the rank waits for every dispatch and
combine. A pair runs a forward chunk F and a whole backward chunk BW of another
micro-batch, each chunk's all-to-alls travelling while the other computes, so a pair
hides

    min(a_F, c_BW) + min(a_BW, c_F)

with a_F, a_BW the all-to-all time of one chunk's forward and backward (a forward has a
dispatch and a combine per MoE block, a backward their two backwards, and under full
recomputation the two of the forward again: a_BW = forwards x a_F) and c_F, c_BW their
computation (one third and two thirds of a chunk's micro-batch, the planner's split
for the data-parallel overlap too). The exposed time is T less the hidden part of every
pair the rank runs (as many as `chunk_pairing.executor.choose_pairs` finds in its
list). The shared experts' filler inside a
layer, which hides a little even unpaired, is not priced: it is at most a few percent of
a layer's compute.
"""

from fractions import Fraction
from functools import lru_cache

from numpitron.chunk_pairing.executor import choose_pairs, pairs_chunks
from numpitron.pipeline_parallel.schedules import make_schedule, placement_of
from numpitron.pipeline_parallel.timeline import UNIT_COST, ideal_bubble, simulate


def pairs_per_iteration(parallel, m: int, pp: int, stage: int) -> int:
    """How many (F, BW) pairs this stage runs in one iteration of m micro-batches."""
    placement = placement_of(parallel.schedule, pp, parallel.virtual_stages)
    return sum(len(group) == 2 for group in choose_pairs(parallel.schedule, m, placement)[stage])


@lru_cache(maxsize=256)
def paired_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The bubble of the unit-cost timeline when each pair starts only once both its
    inputs are in (`simulate(..., paired=True)`): DualPipeV's is the README's, twice
    the unpaired idle time (docs/11-pipeline-schedules.md). The unpaired bubble where nothing pairs."""
    placement = placement_of(name, p, v)
    if p == 1 or not any(len(group) == 2 for groups in choose_pairs(name, m, placement) for group in groups):
        return ideal_bubble(name, p, m, v)
    schedules = [make_schedule(name, m, p, stage, placement.v) for stage in range(p)]
    makespan = max(simulate(schedules, m, placement.v, v_shape=placement.v_shape, paired=True))
    busy = sum(Fraction(UNIT_COST[op.action], placement.v) for ops in schedules for op in ops)
    return float(1 - busy / (p * makespan))


def a2a_exposure(t_a2a: float, compute_per_mb: float, m: int, v: int, pair_count: int, forwards: int = 1) -> dict:
    """t_a2a: the stage's all-to-all seconds per iteration; compute_per_mb: its computation
    per micro-batch (all its chunks). Returns the terms of the module's formula."""
    per_chunk = t_a2a / (m * v)                               # one (micro-batch, chunk): its F and its BW
    a_f, a_bw = per_chunk / (1 + forwards), per_chunk * forwards / (1 + forwards)
    c_f, c_bw = compute_per_mb / v / 3, compute_per_mb / v * 2 / 3
    hidden = pair_count * (min(a_f, c_bw) + min(a_bw, c_f))
    return {"all_to_all": t_a2a, "pairs": pair_count, "a_f": a_f, "a_bw": a_bw, "c_f": c_f, "c_bw": c_bw,
            "hidden": hidden, "exposed_unpaired": t_a2a, "exposed_paired": t_a2a - hidden}
