"""Each speed choice of the speed appendix (docs/) against the alternative it replaced, in one process.

    python benchmarks/kernel_choices.py [--reps 30]

One BLAS thread, float32, the shapes of the default model (B 12, T 64, C 128, H 4) and
of nanoGPT's Shakespeare config (B 8, T 256, C 384, H 6). The two variants of each
choice run alternately, rep after rep, so that the machine's drift hits both alike;
the table gives the median milliseconds of each and their ratio (below 1: the library's
choice is faster). The alternatives live here, not in the library:

- GELU: the library's bias + GELU through sigmoid(2u) in row tiles, forward and backward,
  against a bias add, then GPT-2's tanh form over the whole array (11 passes back);
- GELU's slope formed in the forward's tiles and kept (the backward is one multiply)
  against the slope formed in the backward from the kept x, sig and y (eight passes);
- row means and column sums: BLAS matrix-vector products against NumPy's reductions
  (LayerNorm's forward and both halves of its backward, the same passes otherwise);
- attention: query tiles of 64 rows against whole chunks of T/2 (the layer's forward and
  input half, its projections included; at T = 64 a chunk is one tile either way);
- the q|k|v bias added while the heads are copied into place (one strided pass) against
  the add, then the copy (two passes): the one choice measured and dropped;
- AdamW over the whole model's parameters: weight decay by the decayed runs and the bias
  corrections moved onto the step size and eps (13 passes per chunk) against the
  decay as three passes with the mask and the corrections applied to sqrt(v) (16).
"""

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(["--blas-threads", "1"])

import numpy as np  # noqa: E402

from numpitron.config import ModelConfig  # noqa: E402
from numpitron.distributed.topology import Topology  # noqa: E402
from numpitron.build import build_stage  # noqa: E402
from numpitron.context_parallel import blockwise_attention  # noqa: E402
from numpitron.transformer.attention import ParallelAttention  # noqa: E402
from numpitron.nn.functional import bias_gelu_forward, gelu_backward_, row_tiles, rows_per_tile  # noqa: E402
from numpitron.nn.layernorm import LayerNorm  # noqa: E402
from numpitron.nn.param_store import ParamStore  # noqa: E402
from numpitron.optim import adamw  # noqa: E402

LIBRARY_TILE = blockwise_attention.QUERY_TILE
SHAPES = {"default": (12, 64, 128, 4, 4), "nanoGPT": (8, 256, 384, 6, 6)}    # B, T, C, H, layers
S, A = math.sqrt(2.0 / math.pi), 0.044715      # Python floats: float32 passes stay float32


def tanh_gelu(h, bias, dy):
    """The replaced kernels: bias add, tanh GELU forward, its backward (from the tanh term)."""
    x = h + bias
    t = x * x
    t *= S * A
    t += S
    t *= x
    np.tanh(t, out=t)
    y = t + 1.0
    y *= x
    y *= 0.5
    d = x * x
    d *= 3 * A
    d += 1.0
    d *= 0.5 * S
    d *= x
    sech2 = t * t
    np.subtract(1.0, sech2, out=sech2)
    d *= sech2
    d += 0.5
    d += t * 0.5
    d *= dy
    return y, d


def sigmoid_gelu(h, bias, dy):
    x = h.copy()                       # the library adds the bias into h in place
    y, slope = bias_gelu_forward(x, bias)
    return y, gelu_backward_(dy.copy(), slope)      # the library multiplies into a fresh gradient


def gelu_slope_in_backward(h, bias, dy):
    """The replaced split of the same passes: the forward keeps x, sig and y (three
    hidden-sized arrays), and the backward forms the slope from them, tile by tile."""
    x = h.copy()
    sig, y, dx = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    with np.errstate(over="ignore"):
        for t in row_tiles(*x.shape):
            xt, st = x[t], sig[t]
            xt += bias
            np.multiply(xt, xt, out=st)
            st *= -2 * S * A
            st -= 2 * S
            st *= xt
            np.exp(st, out=st)
            st += 1.0
            np.reciprocal(st, out=st)
            np.multiply(xt, st, out=y[t])
    scratch = np.empty_like(x[:rows_per_tile(x.shape[1])])
    for t in row_tiles(*x.shape):
        d = dx[t]
        np.multiply(x[t], x[t], out=d)
        d *= 6 * S * A
        d += 2 * S
        one_minus = np.subtract(1.0, sig[t], out=scratch[:t.stop - t.start])
        one_minus *= y[t]
        d *= one_minus
        d += sig[t]
        d *= dy[t]
    return y, dx


def layernorm_by_reductions(ln, x, dy):
    """The library's LayerNorm passes, with NumPy's reductions where it now calls BLAS
    (row means; the two column sums of the weight half)."""
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    var += ln.eps
    rstd = np.reciprocal(np.sqrt(var, out=var), out=var)
    xhat = np.multiply(centred, rstd, out=centred)
    y = xhat * ln.weight.data
    y += ln.bias.data
    w, inv_c = ln.weight.data, 1.0 / x.shape[1]
    dy_xhat = dy * xhat
    sums = dy_xhat.sum(axis=0), dy.sum(axis=0)
    mean_g, mean_gx = (dy @ w)[:, None] * inv_c, (dy_xhat @ w)[:, None] * inv_c
    g = dy * w
    g -= mean_g
    g -= xhat * mean_gx
    g *= rstd
    return y, g, sums


def layernorm_library(ln, x, dy):
    y, cache = ln.forward(x)
    return y, ln.backward_input(dy, cache), (cache["dweight"], cache["dbias"])


def split_heads_add_then_copy(qkv, bias, shape):
    B, T, H, hd = shape
    return np.ascontiguousarray((qkv + bias).reshape(B, T, 3, H, hd).transpose(2, 0, 3, 1, 4))


def split_heads_fused(qkv, bias, shape):
    B, T, H, hd = shape
    heads = np.empty((3, B, H, T, hd), qkv.dtype)
    np.add(qkv.reshape(B, T, 3, H, hd).transpose(2, 0, 3, 1, 4), bias.reshape(3, 1, H, 1, hd), out=heads)
    return heads


def attention_pass(attn, x, dy, tile):
    blockwise_attention.QUERY_TILE = tile
    try:
        _, cache = attn.forward(x)
        return attn.backward_input(dy, cache)
    finally:
        blockwise_attention.QUERY_TILE = LIBRARY_TILE


def adamw_with_mask_passes(opt, params, grads, decay_mask, lr):
    """The update before the runs: the decay as three passes with the mask, and the bias
    corrections applied to sqrt(v) and to the step."""
    opt.step_count += 1
    b1, b2, t = opt.beta1, opt.beta2, opt.step_count
    v_scale, step_scale = 1.0 / math.sqrt(1 - b2 ** t), -lr / (1 - b1 ** t)
    for lo in range(0, params.size, adamw.CHUNK):
        hi = min(lo + adamw.CHUNK, params.size)
        p, g, m, v = params[lo:hi], grads[lo:hi], opt.m[lo:hi], opt.v[lo:hi]
        tmp = opt._scratch[:hi - lo]
        np.multiply(p, decay_mask[lo:hi], out=tmp)
        tmp *= -lr * opt.weight_decay
        p += tmp
        m *= b1
        m += np.multiply(g, 1 - b1, out=tmp)
        v *= b2
        np.multiply(g, g, out=tmp)
        tmp *= 1 - b2
        v += tmp
        np.sqrt(v, out=tmp)
        tmp *= v_scale
        tmp += opt.eps
        np.divide(m, tmp, out=tmp)
        tmp *= step_scale
        p += tmp


def cases(B, T, C, H, layers):
    """(name, library's choice, the alternative), each a no-argument callable."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    hidden, bias4, dhidden = r(B * T, 4 * C), r(4 * C), r(B * T, 4 * C)
    ln = LayerNorm("ln", C)
    ParamStore(ln.parameters(), np.float32).initialize(0)
    x, dx = r(B * T, C), r(B * T, C)
    qkv, bias3 = r(B, T, 3 * C), r(3 * C)
    attn = ParallelAttention("attn", C, H, Topology.serial(), out_std=0.02)
    ParamStore(attn.parameters(), np.float32).initialize(0)
    xa, dya = r(B, T, C), r(B, T, C)
    store = build_stage(ModelConfig(seq_len=T, n_layers=layers, n_heads=H, d_model=C), Topology.serial(), seed=0).store
    opt, grads = adamw.AdamW(store.size, np.float32), r(store.size) * 1e-3
    return [
        ("bias + GELU, forward and backward", lambda: sigmoid_gelu(hidden, bias4, dhidden),
         lambda: tanh_gelu(hidden, bias4, dhidden)),
        ("GELU's slope formed in the forward vs in the backward", lambda: sigmoid_gelu(hidden, bias4, dhidden),
         lambda: gelu_slope_in_backward(hidden, bias4, dhidden)),
        ("LayerNorm, forward and backward", lambda: layernorm_library(ln, x, dx),
         lambda: layernorm_by_reductions(ln, x, dx)),
        (f"attention layer, query tiles of {LIBRARY_TILE} vs T/2", lambda: attention_pass(attn, xa, dya, LIBRARY_TILE),
         lambda: attention_pass(attn, xa, dya, T)),
        ("q|k|v: add then copy vs one strided add (dropped)", lambda: split_heads_add_then_copy(qkv, bias3, (B, T, H, C // H)),
         lambda: split_heads_fused(qkv, bias3, (B, T, H, C // H))),
        (f"AdamW on {store.size / 1e6:.1f} M parameters: decay by runs vs by mask",
         lambda: opt.update(store.data, grads, store.decay_runs, 1e-4),
         lambda: adamw_with_mask_passes(opt, store.data, grads, store.decay_mask, 1e-4)),
    ]


def median_ms(times):
    return 1e3 * float(np.median(times))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    print("| shape | kernel | library ms | alternative ms | ratio |")
    print("| --- | --- | ---: | ---: | ---: |")
    for shape_name, shape in SHAPES.items():
        for name, ours, theirs in cases(*shape):
            ours(), theirs()                               # warm caches and the allocator
            mine, other = [], []
            for _ in range(args.reps):
                for fn, times in ((ours, mine), (theirs, other)):
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
            a, b = median_ms(mine), median_ms(other)
            print(f"| {shape_name} | {name} | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
