"""This machine's roofline, measured (docs/20-roofline.md): one core's float32 GEMM of
(N, C) x (C, 4C), the MLP's first matmul, at several token counts N, and an element-wise
pass (x + y into out) over arrays larger than the caches. Each prints its arithmetic
intensity (FLOPs per byte of its operands and result), the median rate over --reps
repetitions and the spread of those repetitions (min to max, in % of the median): the
noise band a comparison must exceed.

    python benchmarks/roofline.py --reps 15
"""

import argparse
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # one core, as one rank has
import numpy as np  # noqa: E402


def timed(fn, reps):
    fn()                                              # warm the caches and BLAS's buffers
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    return median, (times[0] / median - 1) * 100, (times[-1] / median - 1) * 100


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--width", type=int, default=2048, help="C (2048: a 64 MiB weight, larger than the caches)")
    args = p.parse_args()
    C, b = args.width, 4
    rng = np.random.default_rng(0)
    w = rng.standard_normal((C, 4 * C), dtype=np.float32)
    print(f"GEMM (N, {C}) x ({C}, {4 * C}), float32, one core")
    print(f"{'N':>6} {'FLOP/byte':>10} {'GFLOP/s':>9} {'spread':>14}")
    best = 0.0
    for n in (1, 4, 16, 64, 256, 1024, 4096):
        x = rng.standard_normal((n, C), dtype=np.float32)
        out = np.empty((n, 4 * C), np.float32)
        median, lo, hi = timed(lambda: np.matmul(x, w, out=out), args.reps)
        flops, nbytes = 8 * n * C * C, b * (n * C + 4 * C * C + 4 * n * C)
        best = max(best, flops / median)
        print(f"{n:>6} {flops / nbytes:>10.1f} {flops / median / 1e9:>9.1f} {lo:>+6.0f}% {hi:>+5.0f}%")
    n = 1 << 24                                       # 64 MiB an array, far beyond the caches
    x, y, out = (np.ones(n, np.float32) for _ in range(3))
    median, lo, hi = timed(lambda: np.add(x, y, out=out), args.reps)
    print(f"element-wise x + y over {n:,} float32: {1 / (3 * b):.3f} FLOP/byte, "
          f"{3 * b * n / median / 1e9:.1f} GB/s, {n / median / 1e9:.2f} GFLOP/s, spread {lo:+.0f}% {hi:+.0f}%")
    print(f"ridge: {best / 1e9:.0f} GFLOP/s over {3 * b * n / median / 1e9:.1f} GB/s = "
          f"{best * median / (3 * b * n):.1f} FLOPs per byte")


if __name__ == "__main__":
    main()
