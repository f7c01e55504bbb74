"""The experts' compute two ways, in one process (docs/13-experts.md, "Grouped compute"):

    python benchmarks/grouped_experts.py [--reps 30]

- grouped (the library, experts/local_experts.py): the rows arrive sorted by expert; each expert's
  MLP runs over its own contiguous rows, one BLAS call per matmul per expert, no padding;
- padded (here only): the rows scattered into one zero-padded (E, m, C) tensor, m the
  busiest expert's rows (dropless) or the capacity, and every matmul one batched
  np.matmul over the E experts' stacked weights (E, C, H), as a batched GEMM would.

Both run the forward and the whole backward (input and weight gradients), with the same
element-wise kernels (bias + GELU and its slope, per expert); the padded one is checked
against the library in float64 first. One BLAS thread, float32, the default model's
experts (C 128, H 4C) on one micro-batch of 12 x 64 tokens, with counts drawn as a
trained router spreads them (max / mean about 1.3) and as a fresh one does (about 3).
The two run alternately, rep after rep; the table gives median milliseconds of each
and their ratio (above 1: the library's grouped path is faster).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(["--blas-threads", "1"])

import numpy as np  # noqa: E402

from numpitron.distributed.topology import Topology  # noqa: E402
from numpitron.experts.local_experts import LocalExperts  # noqa: E402
from numpitron.nn.functional import bias_gelu_forward, gelu_backward_  # noqa: E402
from numpitron.nn.param_store import ParamStore  # noqa: E402


def library_experts(E: int, C: int, H: int, dtype) -> LocalExperts:
    experts = LocalExperts("experts", C, range(E), Topology.serial(), 0.02, H)
    store = ParamStore(experts.parameters(), dtype)
    store.initialize(0)
    store.data += np.random.default_rng(1).normal(scale=0.01, size=store.data.shape).astype(dtype)  # biases too
    return experts


def grouped_step(experts: LocalExperts, x, dy, counts):
    """The library's path: forward, input half, weight half."""
    for p in experts.parameters():
        p.grad[...] = 0
    y, cache = experts.forward(x, counts)
    dx = experts.backward_input(dy, cache)
    experts.backward_weights(cache)
    return y, dx, [p.grad.copy() for p in experts.parameters()]


class Padded:
    """The same experts as one zero-padded batch: weights stacked (E, in, out) once, at
    set-up (a padded layout would store them so)."""

    def __init__(self, experts: LocalExperts):
        self.w1 = np.stack([m.fc.weight.data for m in experts.mlps])     # (E, C, H)
        self.b1 = np.stack([m.fc.bias.data for m in experts.mlps])       # (E, H)
        self.w2 = np.stack([m.proj.weight.data for m in experts.mlps])   # (E, H, C)
        self.b2 = np.stack([m.proj.bias.data for m in experts.mlps])     # (E, C)

    def step(self, x, dy, counts, rows: int):
        """rows: m, the padded rows per expert (at least the busiest expert's count)."""
        E, C = len(counts), x.shape[1]
        expert = np.repeat(np.arange(E), counts)                 # each row's expert and place in it
        place = np.arange(len(x)) - np.repeat(np.cumsum(counts) - counts, counts)
        xp = np.zeros((E, rows, C), x.dtype)
        xp[expert, place] = x
        h = np.matmul(xp, self.w1)                               # (E, m, H): one batched GEMM
        a, slope = zip(*(bias_gelu_forward(h[e], self.b1[e]) for e in range(E)))
        a, slope = np.stack(a), np.stack(slope)
        yp = np.matmul(a, self.w2)
        yp += self.b2[:, None]
        y = yp[expert, place]
        dyp = np.zeros_like(xp)
        dyp[expert, place] = dy
        da = np.matmul(dyp, self.w2.transpose(0, 2, 1))
        dh = gelu_backward_(da, slope)
        dx = np.matmul(dh, self.w1.transpose(0, 2, 1))[expert, place]
        grads = [np.matmul(xp.transpose(0, 2, 1), dh), dh.sum(axis=1),         # fc weight, bias
                 np.matmul(a.transpose(0, 2, 1), dyp), dyp.sum(axis=1)]        # proj weight, bias
        return y, dx, grads


def counts_for(tokens: int, E: int, skew: float, rng) -> np.ndarray:
    """Rows per expert for `tokens` rows: one expert favoured so that it draws about
    `skew` times the mean, the others alike (p_last / p_other = skew (E-1) / (E-skew))."""
    p = np.ones(E)
    p[-1] = skew * (E - 1) / (E - skew)
    return rng.multinomial(tokens, p / p.sum())


def check(E: int, C: int, H: int) -> None:
    """The padded path computes what the library computes (float64)."""
    experts = library_experts(E, C, H, np.float64)
    rng = np.random.default_rng(2)
    counts = counts_for(200, E, 1.5, rng)
    x, dy = rng.normal(size=(200, C)), rng.normal(size=(200, C))
    y, dx, grads = grouped_step(experts, x, dy, counts)
    py, pdx, pgrads = Padded(experts).step(x, dy, counts, counts.max() + 3)
    lib = [np.stack([p.grad for p in experts.parameters()][i::4]) for i in range(4)]
    for got, want in [(py, y), (pdx, dx)] + list(zip(pgrads, lib)):
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12), "padded experts differ from the library's"


def measure(E: int, k: int, skew: float, capacity_factor: float, reps: int, C=128, tokens=12 * 64) -> dict:
    H = 4 * C
    experts = library_experts(E, C, H, np.float32)
    padded = Padded(experts)
    rng = np.random.default_rng(3)
    counts = counts_for(k * tokens, E, skew, rng)
    if capacity_factor:                                # a capacity drops the rows above it
        cap = int(np.ceil(capacity_factor * k * tokens / E))
        counts, rows = np.minimum(counts, cap), cap
    else:
        rows = int(counts.max())
    x = rng.normal(size=(counts.sum(), C)).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    times = {"grouped": [], "padded": []}
    for _ in range(reps):
        for name, run in (("grouped", lambda: grouped_step(experts, x, dy, counts)),
                          ("padded", lambda: padded.step(x, dy, counts, rows))):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    med = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
    return {"experts": E, "top_k": k, "capacity_factor": capacity_factor, "rows": int(counts.sum()),
            "max_over_mean": float(counts.max() / counts.mean()), "padded_rows": rows * E,
            "grouped_ms": med["grouped"], "padded_ms": med["padded"], "padded_over_grouped": med["padded"] / med["grouped"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    check(4, 16, 64)
    print("| E, k | capacity | max / mean rows | rows (padded) | grouped ms | padded ms | padded / grouped |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for E, k in ((4, 1), (8, 2)):
        for skew, capacity_factor in ((1.3, 0.0), (3.0, 0.0), (3.0, 1.25)):
            r = measure(E, k, skew, capacity_factor, args.reps)
            print(f"| {E}, {k} | {capacity_factor or 'dropless'} | {r['max_over_mean']:.2f} | {r['rows']} "
                  f"({r['padded_rows']}) | {r['grouped_ms']:.2f} | {r['padded_ms']:.2f} | "
                  f"{r['padded_over_grouped']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
