"""Where one training step's time goes: median forward and backward (both halves)
per layer, the optimizer, the whole step, and the matmul-only lower bound.

    python benchmarks/profile_layers.py [--reps 50] [--json-only] [--glibc-malloc-defaults]
    python benchmarks/profile_layers.py --batch 4 --n-layers 6 --n-heads 6 --d-model 384 --seq-len 256

One process, one BLAS thread, float32, the default model (B=12 T=64 C=128 H=4 L=4,
V=65) unless the flags give another (the second line: one dp rank's share of nanoGPT's
config). Every row drives the model's own layer objects through the one layer contract
(forward, backward_input, backward_weights; numpitron/nn/layer.py) on real activations,
so nothing here repeats a layer's internals. A fresh forward (and, for the weight
half, a fresh input half) runs before every repetition, outside the timer, because
some kernels work in place on their cache. The element-wise kernels of
numpitron/nn/functional.py are timed on their own as well, on the shapes the model
gives them.

With --glibc-malloc-defaults (skipping numpitron.runtime's malloc tuning) freed
activations go back to the OS and are page-faulted in again, and that cost lands on
whichever layer allocates: compare the two to see it.
"""

import argparse
import json
import resource
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(["--blas-threads", "1"], tune_malloc="--glibc-malloc-defaults" not in sys.argv)  # before NumPy

import numpy as np  # noqa: E402

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from numpitron.distributed.topology import Topology  # noqa: E402
from numpitron.transformer.activation_memory import softmax_groups  # noqa: E402
from numpitron.nn.functional import bias_gelu_forward, gelu_backward_, row_tiles, softmax_lastdim_with_lse_  # noqa: E402
from numpitron.build import build_trainer  # noqa: E402

B, T = 12, 64
REPS = 50
# --cpu-time: the process's CPU time instead of wall time, for a machine others load
CLOCK = time.process_time if "--cpu-time" in sys.argv else time.perf_counter


def median_ms(fn, setup=None, reps=None):
    """Median time (CLOCK) of fn(setup()) in ms; setup runs outside the timer."""
    times = []
    for _ in range((reps or REPS) + 2):            # the first two warm caches and allocator
        arg = setup() if setup else None
        start = CLOCK()
        fn(arg)
        times.append(CLOCK() - start)
    return float(np.median(times[2:])) * 1e3


def profile_layer(layer, x, dy, **context):
    """(forward, backward_input, backward_weights) medians in ms for any layer."""
    def forward():
        return layer.forward(x, **context)[1]

    def after_input_half():
        cache = forward()
        layer.backward_input(dy, cache)
        return cache
    return (median_ms(lambda _: layer.forward(x, **context)),
            median_ms(lambda cache: layer.backward_input(dy, cache), forward),
            median_ms(layer.backward_weights, after_input_half))


def gradient_like(y, seed):
    return np.random.default_rng(seed).standard_normal(np.shape(y)).astype(np.float32)


def matmul_lower_bound(cfg, dtype, batch: int = B, seq_len: int = T):
    """The step's matmuls alone, same shapes and layouts (transposed views; the
    attention's products tile by tile, as the library walks them), timed as the library
    writes them (`@`, allocating) and into preallocated outputs (`out=`).
    Returns (ms with @, ms with out=, GFLOP per step)."""
    N, C, V, H, hd, L = batch * seq_len, cfg.d_model, cfg.vocab_size, cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.n_layers
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(dtype)

    def linear(n_in, n_out):          # forward y = x W, backward dW = x^T dy, dx = dy W^T
        x, w, dy = r(N, n_in), r(n_in, n_out), r(N, n_out)
        return [(x, w), (x.T, dy), (dy, w.T)]

    def attention_tile(rows, keys):   # one softmax group: `rows` queries against `keys` keys
        q, k, p = r(batch, H, rows, hd), r(batch, H, keys, hd), r(batch, H, rows, keys)
        return [(q, k.swapaxes(2, 3)), (p, k),                          # scores, probs @ v
                (p.swapaxes(2, 3), q), (q, k.swapaxes(2, 3)),           # dv = P^T dY, dP = dY V^T
                (p, k), (p.swapaxes(2, 3), q)]                          # dq = dS K, dk = dS^T Q
    per_block = linear(C, 3 * C) + linear(C, C) + linear(C, 4 * C) + linear(4 * C, C)
    for tile, seen in softmax_groups(seq_len):
        per_block += attention_tile(tile.stop - tile.start, seen[-1].stop)
    head = linear(C, V)               # logits = h E^T: same shapes as a (C -> V) linear
    pairs = [(p, L) for p in per_block] + [(p, 1) for p in head]
    t_alloc = t_out = flops = 0.0
    for (a, b), count in pairs:
        out = np.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), dtype)
        t_alloc += count * median_ms(lambda _: a @ b)
        t_out += count * median_ms(lambda _: np.matmul(a, b, out=out))
        flops += count * 2 * out.size * a.shape[-1]
    return t_alloc, t_out, flops / 1e9


def exp_lower_bound(cfg, dtype, batch: int = B, seq_len: int = T):
    """The step's exponentials alone, at the shapes the library computes them: one per
    element of every MLP hidden layer (the GELU, in its row tiles) and one per score of
    every softmax group (the attention's query tiles); the loss's few, one per logit,
    are left out. The backward needs none: it reuses the kept GELU slope and probabilities
    (with cp = 1 and no recomputation). Exact GELU and softmax cannot do with fewer, and
    NumPy has no cheaper exponential on this CPU (docs/appendix-a-speed-on-a-cpu.md, "The floor"). Each shape is
    timed on one array, over and over, so that it sits in cache: a bound from below.
    Returns (ms per step, exponentials per step)."""
    rng = np.random.default_rng(0)
    n_rows, width = batch * seq_len, 4 * cfg.d_model
    shapes = Counter((t.stop - t.start, width) for t in row_tiles(n_rows, width))
    shapes.update((batch, cfg.n_heads, tile.stop - tile.start, seen[-1].stop) for tile, seen in softmax_groups(seq_len))
    ms = count = 0
    for shape, times in shapes.items():
        x = rng.standard_normal(shape).astype(dtype)
        out = np.empty_like(x)
        ms += times * median_ms(lambda _: np.exp(x, out=out))
        count += times * x.size
    return cfg.n_layers * ms, cfg.n_layers * count


def add_model_flags(parser) -> None:
    """--n-layers, --n-heads, --d-model, --seq-len and --batch, defaulting to the default
    model and batch (this script's and matmul_ceiling.py's)."""
    defaults = ModelConfig()
    for flag, default in (("--n-layers", defaults.n_layers), ("--n-heads", defaults.n_heads),
                          ("--d-model", defaults.d_model), ("--seq-len", T), ("--batch", B)):
        parser.add_argument(flag, type=int, default=default)


def model_config(args, **extra) -> ModelConfig:
    return ModelConfig(n_layers=args.n_layers, n_heads=args.n_heads, d_model=args.d_model, seq_len=args.seq_len,
                       **extra)


def main():
    global REPS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--json-only", action="store_true")
    p.add_argument("--glibc-malloc-defaults", action="store_true", help="skip the malloc tuning of numpitron.runtime")
    p.add_argument("--cpu-time", action="store_true", help="time the process's CPU, not the wall (a loaded machine)")
    add_model_flags(p)
    args = p.parse_args()
    REPS = args.reps
    cfg = model_config(args)
    batch, seq_len = args.batch, args.seq_len
    trainer = build_trainer(cfg, ParallelConfig(), TrainConfig(micro_batch_size=batch, warmup_iters=0), Topology.serial())
    model, L = trainer.model, cfg.n_layers
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 200_000).astype(np.uint16)
    (ids, targets), = trainer.microbatches(tokens, "train", 0)
    block = model.blocks[0]
    x = model.embeddings.forward(ids)[0]                  # the residual stream entering block 0
    h = block.ln1.forward(x)[0]
    merged = block.attn.forward(h)[1]["proj"]["x"]         # attention's heads, merged
    hidden = block.mlp.fc.forward(h)[0]                    # the MLP's hidden layer before GELU (and its bias)
    dx = gradient_like(x, 3)
    rows, counts = {}, {}                                  # name -> (fwd, bwd input, bwd weights); times per step

    def add(name, per_step, timings):
        rows[name], counts[name] = timings, per_step

    add("embeddings (token+position)", 1, profile_layer(model.embeddings, ids, dx))
    add("layernorm", 2 * L + 1, profile_layer(block.ln1, x, dx))
    add("attention (whole)", L, profile_layer(block.attn, h, dx))
    add("  attn.qkv", L, profile_layer(block.attn.qkv, h, gradient_like(block.attn.qkv.forward(h)[0], 4)))
    add("  attn.proj", L, profile_layer(block.attn.proj, merged, dx))
    add("mlp (whole)", L, profile_layer(block.mlp, h, dx))
    add("  mlp.fc", L, profile_layer(block.mlp.fc, h, gradient_like(hidden, 5)))
    fc_bias = block.mlp.fc.bias.data
    add("  mlp.proj", L, profile_layer(block.mlp.proj, bias_gelu_forward(hidden.copy(), fc_bias)[0], dx))
    add("block (whole)", L, profile_layer(block, x, dx))
    add("head: ln_f + tied head + loss", 1, profile_layer(model.head, x, 1.0, targets=targets))
    add("  tied head matmuls", 1, profile_layer(model.head.head, h, gradient_like(model.head.head.forward(h)[0], 6)))
    add("model (whole)", 1, profile_layer(model, ids, 1.0, targets=targets))
    # The element-wise kernels, on the shapes the blocks give them
    groups = [group.probs for step in block.attn.forward(h)[1]["groups"] for group in step]
    slope = bias_gelu_forward(hidden.copy(), fc_bias)[1]
    dhidden = gradient_like(hidden, 8)
    # Every softmax group of one block (context_parallel/blockwise_attention.py); its backward is two
    # passes inside attend_block_backward, timed with attention.
    add("  kernel: softmax", L, (median_ms(lambda gs: [softmax_lastdim_with_lse_(g) for g in gs],
                                           lambda: [g.copy() for g in groups]), 0.0, 0.0))
    add("  kernel: bias + gelu", L, (median_ms(lambda h: bias_gelu_forward(h, fc_bias), hidden.copy),
                                     median_ms(lambda d: gelu_backward_(d, slope), dhidden.copy), 0.0))
    add("data: global batch", 1, (median_ms(lambda _: trainer.microbatches(tokens, "train", 1)), 0.0, 0.0))
    add("zero_grad", 1, (0.0, median_ms(lambda _: model.store.zero_grad()), 0.0))
    add("optimizer step (norm+clip+AdamW)", 1, (0.0, median_ms(lambda _: trainer.optimizer.step(1e-4)), 0.0))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step_reps = max(10, REPS // 2)
    add("train_step (total)", 1, (median_ms(lambda _: trainer.train_step(tokens), reps=step_reps), 0.0, 0.0))
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / (step_reps + 2)   # + median_ms's warm-ups
    mm_alloc, mm_out, gflop = matmul_lower_bound(cfg, np.float32, batch, seq_len)

    # The step as the sum of its parts (a model's whole forward and backward, plus
    # what the trainer does around it).
    parts = ["model (whole)", "data: global batch", "zero_grad", "optimizer step (norm+clip+AdamW)"]
    parts_ms = sum(sum(rows[n]) * counts[n] for n in parts)
    step_ms = rows["train_step (total)"][0]
    report = {"config": {"B": batch, "T": seq_len, "C": cfg.d_model, "H": cfg.n_heads, "L": L, "V": cfg.vocab_size,
                         "dtype": "float32", "blas_threads": 1, "reps": REPS},
              "layers_ms": {n.strip(): {"fwd": round(f, 4), "bwd_input": round(bi, 4), "bwd_weights": round(bw, 4),
                                        "per_step": counts[n], "step_ms": round((f + bi + bw) * counts[n], 3)}
                            for n, (f, bi, bw) in rows.items()},
              "train_step_ms": round(step_ms, 3),
              "train_step_page_faults": round(faults),
              "glibc_malloc_defaults": args.glibc_malloc_defaults,
              "sum_of_parts_ms": round(parts_ms, 3),
              "matmul_lower_bound_ms": round(mm_alloc, 3),
              "matmul_lower_bound_out_ms": round(mm_out, 3),
              "matmul_gflop_per_step": round(gflop, 4),
              "matmul_gflops_achieved": round(gflop / (mm_out / 1e3), 1),
              "matmul_share_of_step": round(mm_alloc / step_ms, 3)}
    if not args.json_only:
        print(f"{'layer':36s} {'fwd ms':>8s} {'bwd in':>8s} {'bwd w':>8s} {'x/step':>6s} {'ms/step':>8s} {'% step':>7s}")
        for name, (f, bi, bw) in rows.items():
            n = counts[name]
            print(f"{name:36s} {f:8.3f} {bi:8.3f} {bw:8.3f} {n:6d} {(f + bi + bw) * n:8.3f} "
                  f"{100 * (f + bi + bw) * n / step_ms:6.1f}%")
        print(f"sum of parts {parts_ms:.2f} ms vs measured step {step_ms:.2f} ms "
              f"({faults:.0f} page faults per step); matmuls alone "
              f"{mm_alloc:.2f} ms with @ ({mm_out:.2f} ms with out=), {gflop:.3f} GFLOP "
              f"= {gflop / (mm_out / 1e3):.0f} GFLOP/s")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
