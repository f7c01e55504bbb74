"""The schedule's pairs, run as pairs: where a rank's list has a forward followed by a
whole backward of another micro-batch (the steady state of DualPipeV, F0 BW1 and F1
BW0, and of 1F1B and interleaved 1F1B on every stage but the last), the two run as one
`ChunkPair` (pair.py); every other operation runs as pipeline_parallel/executor.py runs it.

A pair receives both inputs before either computes, and sends both outputs after both
are done, as DualPipe's overlapped pair does. That is a stronger demand than running
them in turn: the backward's gradient must have arrived before the forward starts. Where
some rank's backward gradient waits on this rank's forward (GPipe's one F-BW boundary,
1F1B with fewer micro-batches than stages) the pairs would wait for each other forever;
`timeline.simulate(..., paired=True)` models exactly this demand, and where it finds a
deadlock the iteration runs unpaired.

On the last stage of 1F1B the forward and the backward of a round are of one
micro-batch, the backward needs the forward's loss: nothing to pair, they run in turn.
"""

import time
from functools import lru_cache

from numpitron.chunk_pairing.pair import ChunkPair
from numpitron.pipeline_parallel.executor import Executor, PipelineStats, last_weight_ops
from numpitron.pipeline_parallel.schedules import BACKWARD, FORWARD, make_schedule
from numpitron.pipeline_parallel.timeline import ScheduleError, simulate


def pairs(ops) -> list[tuple[int, ...]]:
    """This rank's list as groups of indices: (i, i+1) for an F followed by a BW of
    another micro-batch, (i,) for everything else."""
    groups, i = [], 0
    while i < len(ops):
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if ops[i].action == FORWARD and nxt and nxt.action == BACKWARD and nxt.microbatch != ops[i].microbatch:
            groups.append((i, i + 1))
            i += 2
        else:
            groups.append((i,))
            i += 1
    return groups


@lru_cache(maxsize=64)
def pairs_can_run(schedule: str, m: int, placement) -> bool:
    """Whether every rank's pairs, each waiting for both its inputs, finish (no deadlock)."""
    lists = [make_schedule(schedule, m, placement.p, rank, placement.v) for rank in range(placement.p)]
    try:
        simulate(lists, m, placement.v, v_shape=placement.v_shape, paired=True)
    except ScheduleError:
        return False
    return True


class PairedSchedule:
    """Installed on a trainer (build.py, `--moe-a2a-overlap` with experts) as its
    `run_schedule`; the experts' dispatchers hand over at its pair, and the stage's
    layer boundaries progress the all-to-alls in flight."""

    def __init__(self, model):
        self.pair = ChunkPair()
        self.pairs_run = 0
        for layer in model.experts.layers:
            layer.dispatcher.meanwhile = self.pair.meanwhile
        model.residency = Progressing(model.residency, self.pair)

    def __call__(self, model, topo, microbatches, schedule: str, loss_weight: float, grads_ready=None):
        """pipeline_parallel/executor.py's `run_schedule`, the pairs run as pairs."""
        m = len(microbatches)
        ops = make_schedule(schedule, m, topo.pp, topo.pp_rank, model.virtual_stages)
        final = last_weight_ops(ops)
        groups = pairs(ops) if pairs_can_run(schedule, m, model.placement) else [(i,) for i in range(len(ops))]
        executor, stats = Executor(model, topo, microbatches, loss_weight), PipelineStats()
        for group in groups:
            inputs = [executor.receive(ops[i]) for i in group]
            start = time.perf_counter()
            works = [lambda i=i, x=x: executor.compute(ops[i], x, grads_ready if i in final else None)
                     for i, x in zip(group, inputs)]
            if len(group) == 1:
                outputs, held = [works[0]()], [time.perf_counter() - start]
            else:
                backward_cache = executor.caches[(ops[group[1]].microbatch, ops[group[1]].chunk)]
                outputs, held = self.pair.run(*works)
                self.pairs_run += 1
                # both caches were alive during the pair: the forward's is counted with the backward's
                executor.caches[(ops[group[1]].microbatch, ops[group[1]].chunk)] = backward_cache
            for k, i in enumerate(group):
                if len(group) == 2 and k == 1:
                    executor.caches.pop((ops[i].microbatch, ops[i].chunk))
                stats.ran(ops[i], start, executor.caches)
                # the pair's time split by who held the turn: each op's event is its own share
                action, mb, begin, _, chunk = stats.events[-1]
                stats.events[-1] = (action, mb, begin, begin + held[k], chunk)
                start += held[k]
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
