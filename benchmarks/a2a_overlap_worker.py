"""One rank's part of benchmarks/a2a_overlap.py: paired, unpaired and layer-only steps of
one run, taking turns, so the CPU's drift from minute to minute falls on all alike.

    mpiexec -n 2 python benchmarks/a2a_overlap_worker.py --pipeline-parallel-size 1 \\
        --data-parallel-size 2 --expert-parallel-size 2 --num-experts 4 ... --moe-a2a-overlap

The trainer is built with --moe-a2a-overlap. An unpaired step runs the plain executor
(pipeline_parallel/executor.py) with every dispatcher blocking (`overlap = False`): what
--no-moe-a2a-overlap builds, on the same weights. A layer-only step runs the plain
executor with the dispatchers' own filler (the shared experts while the rows travel,
experts/moe.py) and no pairing. The arithmetic is the same every way
(tests/test_chunk_pairing.py), so the kinds of step may follow each other. The order
goes ABCCBA: a steady drift cancels.
Rank 0 prints one JSON line: per kind of step the slowest rank's median step and each
rank's median seconds waited by collective; then, from a trace of --traced paired steps,
each all-to-all's time in flight and the part not waited for.
"""

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from numpitron.runtime import configure_process  # noqa: E402

configure_process(sys.argv)

KINDS = ("paired", "unpaired", "layer-only")
ORDER = (0, 1, 2, 2, 1, 0)


def use(trainer, paired_schedule, kind: str) -> None:
    """Make the next steps paired (the trainer as built), unpaired (blocking all-to-alls)
    or layer-only (each layer's filler, no pair)."""
    from numpitron.pipeline_parallel.executor import run_schedule
    trainer.run_schedule = paired_schedule if kind == "paired" else run_schedule
    for layer in trainer.model.experts.layers:
        layer.dispatcher.overlap = kind != "unpaired"


def alternating_steps(trainer, paired_schedule, tokens, iters: int, world) -> dict:
    """iters steps of each kind, ABCCBA: {kind: {"step_s": [...], "waited": [{collective: s}, ...]}}."""
    out = {kind: {"step_s": [], "waited": []} for kind in KINDS}
    stats = trainer.topo.stats
    for i in range(len(KINDS) * iters):
        kind = KINDS[ORDER[i % len(ORDER)]]
        use(trainer, paired_schedule, kind)
        before = {k: v["seconds"] for k, v in stats.snapshot().items()}
        world.Barrier()                                 # every rank starts the step together
        start = time.perf_counter()
        trainer.train_step(tokens)
        out[kind]["step_s"].append(time.perf_counter() - start)
        out[kind]["waited"].append({k: v["seconds"] - before.get(k, 0.0) for k, v in stats.snapshot().items()})
    return out


def behind_dp(spans) -> float:
    """Seconds the all-to-alls' waits overlapped a dp all-reduce in flight (a bucket's
    bytes ahead of the rows on the connection: see a2a_overlap.py's docstring)."""
    reducing = []                  # the all-reduces in flight, merged where they overlap
    for b, e in sorted((s[3], s[4]) for s in spans if s[2] == "dp_cp in flight" and s[4] is not None):
        if reducing and b <= reducing[-1][1]:
            reducing[-1] = (reducing[-1][0], max(e, reducing[-1][1]))
        else:
            reducing.append((b, e))
    waits = [(s[3], s[4]) for s in spans if s[0] == "ep.all_to_allv wait" and s[4] is not None]
    return sum(max(0.0, min(end, e) - max(start, b)) for start, end in waits for b, e in reducing)


def traced(trainer, paired_schedule, tokens, steps: int, world) -> dict:
    """A trace of `steps` paired steps: the all-to-alls' seconds in flight, hidden, and waited behind dp."""
    from numpitron.trace.comm_probe import CommProbe
    from numpitron.trace.recorder import Recorder
    use(trainer, paired_schedule, "paired")
    rec = Recorder()
    probe = CommProbe(rec, trainer.topo)
    probe.install()
    rec.active = True
    for _ in range(steps):
        world.Barrier()
        trainer.train_step(tokens)
    rec.active = False
    probe.uninstall()
    spans = [s for s in rec.spans if s[2] == "ep in flight" and s[0] == "ep.all_to_allv"]
    ends = [(s[4] if s[4] is not None else s[3]) for s in spans]
    n = max(steps, 1)
    return {"in_flight_s": sum(e - s[3] for s, e in zip(spans, ends)) / n,
            "hidden_s": sum(max(0.0, e - s[3] - s[5]["waited_ms"] / 1e3) for s, e in zip(spans, ends)) / n,
            "a2a_waited_behind_dp_s": behind_dp(rec.spans) / n}


def main(argv: list) -> None:
    """On every rank: warm up both kinds, time --iters steps of each, trace --traced paired."""
    import numpy as np
    from mpi4py import MPI

    from benchmark import N_TOKENS, VOCAB, HostLinks, parse_args, sgemm_gflops, trainer_from_args
    p = argparse.ArgumentParser()
    p.add_argument("--traced", type=int, default=2)
    ours, rest = p.parse_known_args(argv)
    args = parse_args(rest)
    world = MPI.COMM_WORLD
    trainer = trainer_from_args(args)
    paired_schedule = trainer.run_schedule
    if type(paired_schedule).__name__ != "PairedSchedule":          # on every rank alike: none waits for another
        if world.Get_rank() == 0:
            print("a2a_overlap_worker.py: the run must pair chunks (experts, --moe-a2a-overlap, a pairing schedule)",
                  file=sys.stderr)
        raise SystemExit(2)
    tokens = np.random.default_rng(0).integers(0, VOCAB, N_TOKENS).astype(np.uint16)
    start = time.perf_counter()
    alternating_steps(trainer, paired_schedule, tokens, args.warmup, world)
    warmup_s = time.perf_counter() - start
    links = HostLinks(args.cluster_prefix, world)         # the bytes that crossed the simulated links
    pair = paired_schedule.pair                           # its own cost (chunk_pairing/pair.py)
    counters = ("switching_s", "testing_s", "tests", "handovers")
    before = {k: getattr(pair, k) for k in counters}
    links.start()
    steps = alternating_steps(trainer, paired_schedule, tokens, args.iters, world)
    crossed = links.stop(len(KINDS) * args.iters)
    own = {k: (getattr(pair, k) - v) / args.iters for k, v in before.items()}
    trace = traced(trainer, paired_schedule, tokens, ours.traced, world)
    gflops = world.gather(sgemm_gflops(1024, 1024, 1024, np.dtype(args.dtype), reps=5), root=0)
    kinds = {}
    for kind, mine in steps.items():
        slowest = np.array(mine["step_s"])
        world.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        waited = {k: float(np.median([w.get(k, 0.0) for w in mine["waited"]])) for k in mine["waited"][-1]}
        kinds[kind] = {"ms_median": 1e3 * float(np.median(slowest)), "ms_steps": [1e3 * s for s in slowest],
                       "per_rank": world.gather({"waited_s": waited.get("ep.all_to_allv", 0.0),
                                                 "comm_s_by_kind": waited}, root=0)}
    ranks = world.gather({**trace, "pair_per_paired_step": own}, root=0)
    if world.Get_rank() == 0:
        print(json.dumps({**kinds, "paired_trace": ranks, **crossed, "sgemm_gflops_per_rank": float(np.mean(gflops)),
                          "warmup_s": warmup_s, "ranks": world.Get_size()}))


if __name__ == "__main__":
    main(sys.argv[1:])
