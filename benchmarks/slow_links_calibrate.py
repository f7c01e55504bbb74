"""The two measurements benchmarks/slow_links.py prices every method from, taken on the
cluster's 4 ranks at once (so they share the cores as training does), before any
window is timed. Run by it through `python -m numpitron.cluster run -n 4`.

- A step's compute: a DiLoCo step (2 replicas of dp = 2, one per host) whose round never
  ends, so nothing crosses hosts but the loss's 8-byte average; the median of the
  slowest rank's step. What it sends inside its host is priced apart (plan/crossover.py).
- Each method's own work on the default model's stage, every collective replaced by a
  loopback that sends nothing: int8's quantise and rebuild of 4 ranks' messages and
  PowerSGD r = 4's products and QR, each with error feedback's two passes; DiLoCo's
  outer step over the whole stage, once a round (the method's share: divided by H).

Prints one JSON line on rank 0: {"compute_s": ..., "own_s": {method: seconds per iteration}}.
"""

import json
import statistics
import sys
import time
from types import SimpleNamespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark  # noqa: E402  (configures BLAS threads before numpy)
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from numpitron.compression.int8 import Int8  # noqa: E402
from numpitron.compression.powersgd import PowerSGD  # noqa: E402
from numpitron.diloco.outer import apply_outer  # noqa: E402
from slow_links import METHODS, inner_steps  # noqa: E402  (the sweep's methods, one list)

WARMUP, STEPS, REPS = 2, 6, 5
RANKS = 4


class Loopback:
    """A communicator of `size` ranks that moves nothing: the work around it is what is timed."""

    def __init__(self, size: int):
        self.size, self.rank = size, 0

    def all_gather(self, buf, *wire):
        return buf

    def all_reduce(self, buf, *args, **kwargs):
        return buf


def median_seconds(work, reps: int = REPS) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def with_feedback(compressor, grads, residual):
    """Error feedback around one reduction (compression/optimizer.py): M = g + e, e = M - C(M)."""
    def work():
        grads_plus = grads + residual
        _, own = compressor.reduce(grads_plus, Loopback(RANKS), RANKS)
        np.subtract(grads_plus, own, out=residual)
    return work


def main():
    world = MPI.COMM_WORLD
    args = benchmark.parse_args(["--data-parallel-size", "4", "--diloco-replicas", "2", "--diloco-inner-steps",
                                 "100000", "--warmup", str(WARMUP), "--iters", str(STEPS)])
    trainer = benchmark.trainer_from_args(args)
    tokens = np.random.default_rng(0).integers(0, benchmark.VOCAB, benchmark.N_TOKENS).astype(np.uint16)
    for _ in range(WARMUP):
        trainer.train_step(tokens)
    steps = []
    for _ in range(STEPS):
        world.Barrier()
        start = time.perf_counter()
        trainer.train_step(tokens)
        steps.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    store = trainer.optimizer.store
    rng = np.random.default_rng(world.rank)
    grads = rng.standard_normal(store.size).astype(store.dtype)
    residual = np.zeros_like(grads)
    world.Barrier()
    own = {"int8": median_seconds(with_feedback(Int8(store), grads, residual)),
           "powersgd": median_seconds(with_feedback(PowerSGD(store, 4, 0), grads, residual))}
    theta = grads.copy()
    round_state = SimpleNamespace(start=grads.copy(), momentum=np.zeros_like(grads))    # RoundState's two buffers

    def outer():
        delta = round_state.start - theta             # Δ, which the exchange would average
        apply_outer(theta, round_state, 0, theta.size, delta, 0.7, 0.9)
    outer_s = median_seconds(outer)
    own.update({name: outer_s / inner_steps(name) for name in METHODS if inner_steps(name)})
    own = {name: world.allreduce(s, op=MPI.SUM) / world.size for name, s in own.items()}     # the ranks' mean
    if world.rank == 0:
        print(json.dumps({"compute_s": statistics.median(steps), "steps_s": steps, "own_s": own,
                          "outer_step_s": outer_s}), flush=True)


if __name__ == "__main__":
    from numpitron.distributed.launch import run_main
    sys.exit(run_main(lambda argv: main()))
