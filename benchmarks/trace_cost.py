"""What --trace costs a step (docs/19-traces.md).

    mpiexec -n 2 python benchmarks/trace_cost.py --pipeline-parallel-size 2 --iters 30

One trainer; each round runs three steps: untraced (no wrapper installed), traced (the
wrappers installed and recording), untraced again. A step's time is the slowest rank's,
every step started by a barrier. The cost of a round is the traced step over the mean
of the two untraced ones around it, minus 1; the noise band is the same ratio between
the two untraced steps (an A/A comparison: what the machine's noise alone gives).
Prints one JSON object: medians and quartiles over the rounds, and what one span costs
measured alone (a wrapper around a call that does nothing), times the spans of a step:
a bound the paired steps cannot resolve on a loaded machine. The flags are
benchmarks/benchmark.py's (--iters: rounds).
"""

import json
import os
import time

import benchmark  # first: it sets one BLAS thread before NumPy loads
import numpy as np
from mpi4py import MPI

from numpitron.trace.tracer import Tracer


def recording_us(tracer, n: int = 20000) -> dict:
    """Microseconds one wrapper adds to a call, measured on a call that does nothing:
    a layer's pass, and a blocking collective's (with its counters' bytes)."""
    class Quiet:
        name, rank = "tp", 0

    def nothing(*args, **kwargs):
        tracer.topo.stats.add("tp.all_reduce", 8.0)
    wrapped = {"layer": tracer.stage._layer("blocks.0 F", nothing),
               "collective": tracer.comm._wrap(Quiet(), "tp", "all_reduce", nothing, [0])}
    rec, out = tracer.rec, {}
    rec.active = True
    for kind, call in wrapped.items():
        best = []
        for f in (nothing, call):
            start = time.perf_counter()
            for _ in range(n):
                f()
            best.append(time.perf_counter() - start)
        out[kind] = round((best[1] - best[0]) / n * 1e6, 3)
    rec.active = False
    rec.spans.clear()
    return out


def quartiles(values) -> list[float]:
    return [round(float(q) * 100, 2) for q in np.percentile(values, [25, 50, 75])]


def main():
    args = benchmark.parse_args()
    world = MPI.COMM_WORLD
    trainer = benchmark.trainer_from_args(args)
    tokens = np.random.default_rng(0).integers(0, benchmark.VOCAB, benchmark.N_TOKENS).astype(np.uint16)
    tracer = Tracer(os.devnull, (1, 1 << 30), trainer)      # every iteration traced that begins as one
    spans_per_step = []

    def step(traced: bool) -> float:
        tracer.begin_iteration(trainer.iteration + 1 if traced else 0)     # installs the wrappers when traced
        world.Barrier()
        start = time.perf_counter()
        with tracer.span("step"):
            trainer.train_step(tokens)
        seconds = time.perf_counter() - start
        tracer.end_iteration()
        tracer.uninstall()
        if traced:
            spans_per_step.append(len(tracer.rec.spans))
            tracer.rec.spans.clear()
            tracer.rec.flows.clear()
        return world.allreduce(seconds, op=MPI.MAX)

    for _ in range(args.warmup):
        step(False)
        step(True)
    rounds = np.array([(step(False), step(True), step(False)) for _ in range(args.iters)])
    cost = rounds[:, 1] / rounds[:, [0, 2]].mean(axis=1) - 1
    noise = rounds[:, 2] / rounds[:, 0] - 1
    per_span = recording_us(tracer)
    if world.Get_rank() == 0:
        print(json.dumps({
            "recording_us_per_span": per_span,
            "recording_ms_per_step_bound": round(max(per_span.values()) * np.median(spans_per_step) / 1e3, 3),
            "ranks": world.Get_size(), "mesh": dict(trainer.topo.mesh._asdict()), "rounds": args.iters,
            "loadavg_1min": round(os.getloadavg()[0], 2),
            "untraced_ms_per_step_median": round(float(np.median(rounds[:, [0, 2]])) * 1e3, 2),
            "traced_ms_per_step_median": round(float(np.median(rounds[:, 1])) * 1e3, 2),
            "spans_per_step_rank0": int(np.median(spans_per_step)),
            "cost_percent_quartiles": quartiles(cost),
            "untraced_vs_untraced_percent_quartiles": quartiles(noise)}, indent=1))


if __name__ == "__main__":
    main()
