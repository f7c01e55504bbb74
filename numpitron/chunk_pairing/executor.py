"""The schedule's pairs, run as pairs: where a rank's list has a forward and a whole
backward of another micro-batch side by side, the two run as one `ChunkPair` (pair.py);
every other operation runs as pipeline_parallel/executor.py runs it. DualPipeV's steady
state is such pairs, F0 BW1 and F1 BW0, and so is 1F1B's and interleaved 1F1B's (F then
BW) on every stage but the last, where a round's F and BW are of one micro-batch. With
pp = 1 every BW is followed by the next micro-batch's F: Megatron-Core's combined 1F1B
pairs those, BW then F, and so does this.

A pair receives both inputs before either computes, and sends both outputs after both
are done, as DualPipe's overlapped pair does. That is a stronger demand than running
them in turn: the second operation's input must have arrived before the first starts.
Where some rank's input waits on this rank's first operation (GPipe's one F-BW
boundary, 1F1B with fewer micro-batches than stages, BW-then-F pairs on a pipeline) the
pairs would wait for each other forever. `runnable` runs every rank's groups against
each other to find out; `choose_pairs` takes F-then-BW pairs, or both orders where
that pairs more and still runs, or none. A BW-then-F pair keeps the backward's cache
while the forward makes its own: one chunk's caches more than running them in turn
(the executor's PipelineStats counts it).
"""

import time
from functools import lru_cache

from numpitron.chunk_pairing.pair import ChunkPair
from numpitron.pipeline_parallel.executor import Executor, PipelineStats, last_weight_ops
from numpitron.pipeline_parallel.schedules import BACKWARD, FORWARD, INPUT_GRAD, make_schedule
from numpitron.pipeline_parallel.timeline import dependencies


def pairs(ops, both_orders: bool = False) -> list[tuple[int, ...]]:
    """This rank's list as groups of indices: (i, i+1) for an F followed by a BW of
    another micro-batch (or a BW followed by an F, with both_orders), (i,) otherwise."""
    groups, i = [], 0
    while i < len(ops):
        a, b = ops[i], ops[i + 1] if i + 1 < len(ops) else None
        pair = b is not None and a.microbatch != b.microbatch and (
            (a.action, b.action) == (FORWARD, BACKWARD) or both_orders and (a.action, b.action) == (BACKWARD, FORWARD))
        groups.append((i, i + 1) if pair else (i,))
        i += 2 if pair else 1
    return groups


def runnable(lists, groups, placement) -> bool:
    """Whether every rank's groups, each waiting for all its operations' inputs, finish."""
    done, position, progress = set(), [0] * len(lists), True
    while progress:
        progress = False
        for rank, (ops, mine) in enumerate(zip(lists, groups)):
            while position[rank] < len(mine):
                unit = [ops[i] for i in mine[position[rank]]]
                if not all(dep in done for op in unit for dep in dependencies(op, rank, placement)
                           if dep[1] != rank or dep[0] not in unit):
                    break
                done |= {(op, rank) for op in unit} | {(op._replace(action=INPUT_GRAD), rank)
                                                       for op in unit if op.action == BACKWARD}
                position[rank] += 1
                progress = True
    return all(p == len(mine) for p, mine in zip(position, groups))


def pairs_chunks(model_cfg, parallel_cfg) -> bool:
    """Whether a run pairs chunks: with experts and --moe-a2a-overlap, not under ZeRO-3
    (its residency hooks gather the layers in the order one pass meets them)."""
    return bool(model_cfg.num_experts) and parallel_cfg.moe_a2a_overlap and parallel_cfg.zero_stage != 3


@lru_cache(maxsize=64)
def choose_pairs(schedule: str, m: int, placement) -> tuple:
    """Every rank's groups: F-then-BW pairs, or both orders if that pairs more and runs,
    or every operation alone."""
    lists = [make_schedule(schedule, m, placement.p, rank, placement.v) for rank in range(placement.p)]
    best = tuple(tuple((i,) for i in range(len(ops))) for ops in lists)
    for both in (False, True):
        groups = tuple(tuple(pairs(ops, both)) for ops in lists)
        if len([g for r in groups for g in r]) < len([g for r in best for g in r]) and runnable(lists, groups, placement):
            best = groups
    return best


class PairedSchedule:
    """Installed on a trainer (build.py, `--moe-a2a-overlap` with experts) as its
    `run_schedule`; the experts' dispatchers hand over at its pair, and the stage's
    layer boundaries progress the all-to-alls in flight."""

    def __init__(self, model):
        self.pair = ChunkPair()
        self.pairs_run = 0
        for layer in model.experts.layers:
            layer.dispatcher.meanwhile = self.pair.meanwhile
            layer.dispatcher.before_start = self.pair.settle
        model.residency = Progressing(model.residency, self.pair)

    def __call__(self, model, topo, microbatches, schedule: str, loss_weight: float, grads_ready=None):
        """pipeline_parallel/executor.py's `run_schedule`, the pairs run as pairs."""
        m = len(microbatches)
        ops = make_schedule(schedule, m, topo.pp, topo.pp_rank, model.virtual_stages)
        final = last_weight_ops(ops)
        groups = choose_pairs(schedule, m, model.placement)[topo.pp_rank]
        executor, stats = Executor(model, topo, microbatches, loss_weight), PipelineStats()
        for group in groups:
            inputs = [executor.receive(ops[i]) for i in group]
            start = time.perf_counter()
            works = [lambda i=i, x=x: executor.compute(ops[i], x, grads_ready if i in final else None)
                     for i, x in zip(group, inputs)]
            if len(group) == 1:
                outputs, held = [works[0]()], [time.perf_counter() - start]
            else:
                key = next((ops[i].microbatch, ops[i].chunk) for i in group if ops[i].action == BACKWARD)
                kept = executor.caches[key]
                outputs, held = self.pair.run(*works)
                self.pairs_run += 1
                executor.caches[key] = kept      # alive during the pair: its peak counts both caches
            for i in sorted(group, key=lambda i: ops[i].action != FORWARD):
                if len(group) == 2 and ops[i].action == BACKWARD:
                    executor.caches.pop(key)
                stats.ran(ops[i], start, executor.caches)
                # the pair's time split by who held the turn, in the list's order
                k = group.index(i)
                action, mb, begin, _, chunk = stats.events[-1]
                stats.events[-1] = (action, mb, begin + sum(held[:k]), begin + sum(held[:k + 1]), chunk)
            for i, output in zip(group, outputs):
                executor.send(ops[i], output)
        losses = executor.finish()
        stats.finish()
        return losses, stats


class Progressing:
    """The stage's residency hooks (nn/residency.py), each followed by a test of the
    paired chunk's all-to-alls in flight: the layer boundaries are the sub-steps."""

    def __init__(self, inner, pair: ChunkPair):
        self.inner, self.pair = inner, pair

    def __getattr__(self, name):
        hook = getattr(self.inner, name)
        if not name.startswith(("before_", "after_")):
            return hook

        def progressing(index: int) -> None:
            hook(index)
            self.pair.progress()
        return progressing
