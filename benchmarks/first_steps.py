"""Why are a run's first iterations slower? Per-step time of one process over its first
iterations, split into windows, under variants that each remove one suspect.

    python benchmarks/first_steps.py [--iters 200] [--variants plain frozen no-gc malloc-defaults]

Suspects, and the variant that removes each:

* the values: denormal floats or value-dependent kernels while the weights are young
  (`frozen`: lr 0, so every step computes on the initial weights);
* Python's garbage collector, whose full collections walk every object and come at a
  rate set by allocations (`no-gc`: gc disabled after the build);
* the allocator handing memory back and faulting it in again (`malloc-defaults`: without
  numpitron.runtime's mallopt settings), seen in the minor page faults per step;
* anything else that warms (caches, the BLAS's buffers, the CPU's clock): left in every
  variant; seen in the process's CPU time per step against its wall time (another job's
  load raises wall time only).

Each variant is its own process, one BLAS thread, the default model on random tokens,
AdamW with the library's defaults (warm-up over the first 100). Prints one JSON object:
per variant and window, the median wall and CPU milliseconds per step and the page
faults; and each of the first FIRST steps on its own: its wall, user and system CPU
milliseconds, minor page faults and garbage collections (a first touch of a page costs
system time: a heap still growing shows there). With --rounds R each variant runs R
times, the variants' order rotating from round to round, so that a machine warming or
cooling between processes shows as a difference between rounds, not between variants.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WINDOWS = ((0, 10), (10, 70), (70, 140), (140, 10 ** 9))
FIRST = 12


def one_process(variant: str, iters: int) -> dict:
    sys.path.insert(0, str(REPO))
    from numpitron.runtime import configure_process
    configure_process(["--blas-threads", "1"], tune_malloc=variant != "malloc-defaults")
    import gc
    import resource
    import time
    from dataclasses import replace

    import numpy as np

    from numpitron.build import build_trainer
    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.distributed.topology import Topology
    model = ModelConfig(vocab_size=65).validate()
    train = TrainConfig(max_iters=iters)
    if variant == "frozen":
        train = replace(train, lr=0.0, min_lr=0.0)
    trainer = build_trainer(model, ParallelConfig().validate(), train, Topology.serial())
    tokens = np.random.default_rng(0).integers(0, 65, 200_000).astype(np.uint16)
    if variant == "no-gc":
        gc.collect()
        gc.disable()
    collections = []                                   # the garbage collector's runs, by generation
    gc.callbacks.append(lambda phase, info: phase == "stop" and collections.append(info["generation"]))
    steps, first = [], []
    for i in range(iters):
        collections.clear()
        before, cpu, wall = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
        with np.errstate(all="ignore"):
            trainer.train_step(tokens)
        after = resource.getrusage(resource.RUSAGE_SELF)
        steps.append((time.perf_counter() - wall, time.process_time() - cpu, after.ru_minflt - before.ru_minflt))
        if i < FIRST:
            first.append({"wall_ms": round(1e3 * steps[-1][0], 2),
                          "user_ms": round(1e3 * (after.ru_utime - before.ru_utime), 1),
                          "sys_ms": round(1e3 * (after.ru_stime - before.ru_stime), 1), "page_faults": steps[-1][2],
                          "gc_generations": list(collections)})
    out = {"first_steps": first}
    for lo, hi in WINDOWS:
        part = steps[lo:hi]
        if part:
            wall, cpu, faults = (np.median([s[i] for s in part]) for i in range(3))
            out[f"{lo}-{min(hi, iters)}"] = {"wall_ms": round(1e3 * wall, 2), "cpu_ms": round(1e3 * cpu, 2),
                                             "page_faults": int(faults)}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--variants", nargs="+", default=["plain", "frozen", "no-gc", "malloc-defaults"])
    p.add_argument("--rounds", type=int, default=1, help="runs of each variant, their order rotating")
    p.add_argument("--one", help=argparse.SUPPRESS)        # the child process's variant
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_process(args.one, args.iters)))
        return
    results = {}
    for r in range(args.rounds):
        for variant in args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]:
            done = subprocess.run([sys.executable, __file__, "--one", variant, "--iters", str(args.iters)],
                                  capture_output=True, text=True, check=True, cwd=REPO)
            results.setdefault(variant, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(variant, r, results[variant][-1], file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
