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
per variant and window, the median wall and CPU milliseconds per step and the page faults.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WINDOWS = ((0, 10), (10, 70), (70, 140), (140, 10 ** 9))


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
    steps = []
    for _ in range(iters):
        faults, cpu, wall = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
        with np.errstate(all="ignore"):
            trainer.train_step(tokens)
        steps.append((time.perf_counter() - wall, time.process_time() - cpu,
                      resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    out = {}
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
    p.add_argument("--one", help=argparse.SUPPRESS)        # the child process's variant
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_process(args.one, args.iters)))
        return
    results = {}
    for variant in args.variants:
        done = subprocess.run([sys.executable, __file__, "--one", variant, "--iters", str(args.iters)],
                              capture_output=True, text=True, check=True, cwd=REPO)
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        print(variant, results[variant], file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
