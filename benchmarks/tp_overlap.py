"""How much tensor-parallel communication --tp-comm-overlap hides (docs/04-tensor-parallelism.md).

    mpiexec -n 2 python benchmarks/tp_overlap.py --tensor-parallel-size 2 --iters 40

One trainer, its training steps alternating between overlap on and off (the region's
`overlap` switch, read at every backward), so both see the same load on a shared
machine. For each step: its time (the slowest rank's), the seconds `CommStats` counts
for all tp collectives, and the exposed seconds of the column-parallel input-gradient
collectives alone: the blocking call without overlap; starting it plus waiting for
it with overlap. The share hidden is 1 - on / off of the medians over paired steps.
Prints one JSON object. The flags are benchmarks/benchmark.py's; with --cluster-prefix
(run through `python -m numpitron.cluster run`, or benchmarks/cluster_comm.py tp-overlap)
it also reports the bytes each host's link sent per step.
"""

import json
import time

import benchmark  # first: it sets one BLAS thread before NumPy loads
import numpy as np
from mpi4py import MPI


def instrument(region, exposed: dict) -> None:
    """Count the seconds spent starting and waiting for each input-gradient collective
    ("s"), and the seconds of work between the two ("cover": the weight half, all that
    the collective can hide behind)."""
    start_input_grad = region.start_input_grad

    def timed(dx):
        t0 = time.perf_counter()
        inflight = start_input_grad(dx)
        started = time.perf_counter()
        exposed["s"] += started - t0
        wait = inflight.wait

        def timed_wait():
            t1 = time.perf_counter()
            exposed["cover"] += t1 - started
            value = wait()
            exposed["s"] += time.perf_counter() - t1
            return value
        inflight.wait = timed_wait
        return inflight
    region.start_input_grad = timed


def tp_seconds(stats) -> float:
    return sum(v["seconds"] for k, v in stats.snapshot().items() if k.startswith("tp."))


def main():
    args = benchmark.parse_args()
    world = MPI.COMM_WORLD
    trainer = benchmark.trainer_from_args(args)
    region, stats = trainer.model.region, trainer.topo.stats
    exposed = {"s": 0.0, "cover": 0.0}
    instrument(region, exposed)
    tokens = np.random.default_rng(0).integers(0, benchmark.VOCAB, benchmark.N_TOKENS).astype(np.uint16)
    for _ in range(args.warmup):
        trainer.train_step(tokens)
    rows = {True: [], False: []}
    links = benchmark.HostLinks(args.cluster_prefix, world)
    links.start()
    for i in range(2 * args.iters):
        overlap = region.overlap = i % 2 == 0
        stats.reset()
        exposed["s"] = exposed["cover"] = 0.0
        world.Barrier()
        t0 = time.perf_counter()
        trainer.train_step(tokens)
        step = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        rows[overlap].append((step, tp_seconds(stats), exposed["s"], exposed["cover"]))
    link_bytes = links.stop(2 * args.iters)                 # both settings move the same bytes
    mine = {k: np.median(np.array(v), axis=0).tolist() for k, v in rows.items()}
    ranks = world.gather(mine, root=0)
    if world.Get_rank() != 0:
        return
    on, off = (np.mean([r[key] for r in ranks], axis=0) for key in (True, False))
    pairs = np.array(rows[True])[:, 0] / np.array(rows[False])[:, 0]       # step i with, step i without
    print(json.dumps({
        "tp": trainer.topo.tp, "sequence_parallel": args.sequence_parallel, "dtype": args.dtype,
        "paired_steps": args.iters, "loadavg_1min": round(__import__("os").getloadavg()[0], 2),
        "ms_per_step_median": {"overlap": round(on[0] * 1e3, 2), "no_overlap": round(off[0] * 1e3, 2)},
        "step_ratio_overlap_over_no_overlap": round(on[0] / off[0], 3),
        "median_of_paired_step_ratios": round(float(np.median(pairs)), 3),
        "tp_comm_ms_per_step": {"overlap": round(on[1] * 1e3, 2), "no_overlap": round(off[1] * 1e3, 2)},
        "input_grad_exposed_ms_per_step": {"overlap": round(on[2] * 1e3, 2), "no_overlap": round(off[2] * 1e3, 2)},
        "share_of_tp_comm_hidden": round(1 - on[1] / off[1], 3),
        "share_of_input_grad_comm_hidden": round(1 - on[2] / off[2], 3),
        # the most overlap could hide: the weight halves' time over all tp communication
        "weight_half_ms_per_step": round(on[3] * 1e3, 2),
        "hideable_share_of_tp_comm": round(min(on[3], off[2]) / off[1], 3), **link_bytes}, indent=1))


if __name__ == "__main__":
    main()
