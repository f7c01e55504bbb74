"""Where one training step's time goes: median forward and backward per layer type,
the optimizer, the whole step, and the matmul-only lower bound.

    python benchmarks/profile_layers.py [--reps 50] [--json-only] [--glibc-malloc-defaults]

One process, one BLAS thread, float32, the default model (B=12 T=64 C=128 H=4 L=4,
V=65). Layers are the library's own objects, fed real activations; the attention and
MLP sub-steps repeat the library's NumPy calls one by one (keep them in step with
nn/attention.py and nn/mlp.py). In-place kernels get a fresh copy of their input
before every repetition, outside the timer.

With --glibc-malloc-defaults (skipping numpitron.runtime's malloc tuning) freed
activations go back to the OS and are page-faulted in again, and that cost lands on
whichever layer allocates: compare the two to see it.
"""

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(["--blas-threads", "1"], tune_malloc="--glibc-malloc-defaults" not in sys.argv)  # before NumPy

import numpy as np  # noqa: E402

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from numpitron.distributed.topology import Topology  # noqa: E402
from numpitron.nn.functional import gelu_backward, gelu_forward, softmax_lastdim_, softmax_lastdim_backward  # noqa: E402
from numpitron.trainer import Trainer  # noqa: E402

B, T = 12, 64
REPS = 50


def median_ms(fn, setup=None, reps=None):
    """Median wall time of fn(setup()) in ms; setup runs outside the timer."""
    times = []
    for _ in range((reps or REPS) + 2):            # the first two warm caches and allocator
        arg = setup() if setup else None
        start = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:])) * 1e3


def profile_attention(attn, h, rows):
    """Sub-steps of ParallelAttention forward/backward, as the library performs them."""
    (qkv, qkv_cache) = attn.qkv.forward(h)
    q, k, v = attn._split_heads(qkv, B, T)
    q *= attn.scale
    mask = attn._mask(T, h.dtype)
    scores = q @ k.transpose(0, 1, 3, 2)
    scores += mask
    probs = softmax_lastdim_(scores.copy())
    heads = probs @ v
    merged = heads.transpose(0, 2, 1, 3).reshape(B * T, -1)
    y, proj_cache = attn.proj.forward(merged)
    dy = np.random.default_rng(1).standard_normal(y.shape).astype(y.dtype)
    dmerged = attn.proj.backward(dy, proj_cache)
    dheads = dmerged.reshape(B, T, attn.local_heads, attn.head_dim).transpose(0, 2, 1, 3)
    dprobs = dheads @ v.transpose(0, 1, 3, 2)
    dscores = softmax_lastdim_backward(dprobs.copy(), probs)
    dqkv = np.empty((3, B, attn.local_heads, T, attn.head_dim), dy.dtype)
    dqkv_flat = dqkv.transpose(1, 3, 0, 2, 4).reshape(B * T, -1)

    def split(_):
        q, k, v = attn._split_heads(qkv, B, T)
        q *= attn.scale

    def scores_fn(_):
        s = q @ k.transpose(0, 1, 3, 2)
        s += mask

    def dq_dk(_):
        np.matmul(dscores, k, out=dqkv[0])
        dqkv[0] *= attn.scale
        np.matmul(dscores.transpose(0, 1, 3, 2), q, out=dqkv[1])

    rows["attn.qkv"] = (median_ms(lambda _: attn.qkv.forward(h)),
                        median_ms(lambda _: attn.qkv.backward(dqkv_flat, qkv_cache)))
    rows["attn.split_heads / merge_dqkv"] = (median_ms(split),
                                             median_ms(lambda _: dqkv.transpose(1, 3, 0, 2, 4).reshape(B * T, -1)))
    rows["attn.scores q@kT+mask / dq,dk"] = (median_ms(scores_fn), median_ms(dq_dk))
    rows["attn.softmax"] = (median_ms(softmax_lastdim_, scores.copy),
                            median_ms(lambda d: softmax_lastdim_backward(d, probs), dprobs.copy))
    rows["attn.probs@v / dv,dprobs"] = (
        median_ms(lambda _: probs @ v),
        median_ms(lambda _: (np.matmul(probs.transpose(0, 1, 3, 2), dheads, out=dqkv[2]),
                             dheads @ v.transpose(0, 1, 3, 2))))
    rows["attn.merge_heads"] = (median_ms(lambda _: heads.transpose(0, 2, 1, 3).reshape(B * T, -1)), 0.0)
    rows["attn.proj"] = (median_ms(lambda _: attn.proj.forward(merged)),
                         median_ms(lambda _: attn.proj.backward(dy, proj_cache)))


def profile_mlp(mlp, h, rows):
    hid, fc_cache = mlp.fc.forward(h)
    a, tanh_term = gelu_forward(hid)
    y, proj_cache = mlp.proj.forward(a)
    dy = np.random.default_rng(2).standard_normal(y.shape).astype(y.dtype)
    da = mlp.proj.backward(dy, proj_cache)
    dh = gelu_backward(da, hid, tanh_term)
    rows["mlp.fc"] = (median_ms(lambda _: mlp.fc.forward(h)), median_ms(lambda _: mlp.fc.backward(dh, fc_cache)))
    rows["mlp.gelu"] = (median_ms(lambda _: gelu_forward(hid)), median_ms(lambda _: gelu_backward(da, hid, tanh_term)))
    rows["mlp.proj"] = (median_ms(lambda _: mlp.proj.forward(a)), median_ms(lambda _: mlp.proj.backward(dy, proj_cache)))


def matmul_lower_bound(cfg, dtype):
    """The step's matmuls alone, same shapes and layouts (transposed views), timed as
    the library writes them (`@`, allocating) and into preallocated outputs (`out=`).
    Returns (ms with @, ms with out=, GFLOP per step)."""
    N, C, V, H, hd, L = B * T, cfg.d_model, cfg.vocab_size, cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.n_layers
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(dtype)

    def linear(n_in, n_out):          # forward y = x W, backward dW = x^T dy, dx = dy W^T
        x, w, dy = r(N, n_in), r(n_in, n_out), r(N, n_out)
        return [(x, w), (x.T, dy), (dy, w.T)]

    def batched(a_shape, b_shape):
        return [(r(*a_shape), r(*b_shape))]
    s, hv = (B, H, T, T), (B, H, T, hd)
    per_block = linear(C, 3 * C) + linear(C, C) + linear(C, 4 * C) + linear(4 * C, C)
    per_block += batched(hv, (B, H, hd, T)) + batched(s, hv)             # scores, probs @ v
    per_block += batched(s, hv) + batched(hv, (B, H, hd, T))             # dv = P^T dY, dP = dY V^T
    per_block += batched(s, hv) + batched(s, hv)                         # dq = dS K, dk = dS^T Q
    head = linear(C, V)               # logits = h E^T: same shapes as a (C -> V) linear
    pairs = [(p, L) for p in per_block] + [(p, 1) for p in head]
    t_alloc = t_out = flops = 0.0
    for (a, b), count in pairs:
        out = np.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), dtype)
        t_alloc += count * median_ms(lambda _: a @ b)
        t_out += count * median_ms(lambda _: np.matmul(a, b, out=out))
        flops += count * 2 * out.size * a.shape[-1]
    return t_alloc, t_out, flops / 1e9


def main():
    global REPS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--json-only", action="store_true")
    p.add_argument("--glibc-malloc-defaults", action="store_true", help="skip the malloc tuning of numpitron.runtime")
    args = p.parse_args()
    REPS = args.reps
    cfg = ModelConfig()
    trainer = Trainer(cfg, ParallelConfig().validate(cfg), TrainConfig(micro_batch_size=B, warmup_iters=0), Topology.serial())
    model = trainer.model
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 200_000).astype(np.uint16)
    (x_tok, y_tok), = trainer.microbatches(tokens, "train", 0)
    idx, targets = x_tok.reshape(-1), y_tok.reshape(-1)
    rng = np.random.default_rng(3)
    dx = rng.standard_normal((B * T, cfg.d_model)).astype(np.float32)
    rows = {}                                  # name -> (forward ms, backward ms)
    counts = {}                                # name -> times per step

    emb, pos = model.token_embedding, model.position_embedding
    _, tok_cache = emb.forward(idx)

    def embed(_):                               # as GPTStage.forward does it
        x, _ = emb.forward(idx)
        x += pos.forward(B, T)
        return x
    rows["embedding (token+position)"] = (
        median_ms(embed),
        median_ms(lambda _: (pos.backward(dx, B, T), emb.backward(dx, tok_cache))))
    x = embed(None)                             # the residual stream entering block 0
    block = model.blocks[0]
    h, ln_cache = block.ln1.forward(x)
    rows["layernorm"] = (median_ms(lambda _: block.ln1.forward(x)), median_ms(lambda _: block.ln1.backward(dx, ln_cache)))
    _, attn_cache = block.attn.forward(h, B, T)
    rows["attention (whole)"] = (median_ms(lambda _: block.attn.forward(h, B, T)),
                                 median_ms(lambda _: block.attn.backward(dx, attn_cache)))
    profile_attention(block.attn, h, rows)
    _, mlp_cache = block.mlp.forward(h)
    rows["mlp (whole)"] = (median_ms(lambda _: block.mlp.forward(h)), median_ms(lambda _: block.mlp.backward(dx, mlp_cache)))
    profile_mlp(block.mlp, h, rows)
    _, block_cache = block.forward(x.copy(), B, T)
    rows["block (whole)"] = (median_ms(lambda xc: block.forward(xc, B, T), x.copy),
                             median_ms(lambda _: block.backward(dx, block_cache)))
    hf, ln_f_cache = model.ln_f.forward(x)
    logits, head_cache = model.head.forward(hf)
    dlogits = model.loss_fn.backward(1.0, model.loss_fn.forward(logits.copy(), targets)[1])
    rows["head (tied)"] = (median_ms(lambda _: model.head.forward(hf)), median_ms(lambda _: model.head.backward(dlogits, head_cache)))
    _, loss_cache = model.loss_fn.forward(logits.copy(), targets)
    rows["cross-entropy"] = (median_ms(lambda lg: model.loss_fn.forward(lg, targets), logits.copy),
                             median_ms(lambda pr: model.loss_fn.backward(1.0, (pr,) + loss_cache[1:]), loss_cache[0].copy))
    _, full_cache = model.forward(x_tok, B, T, y_tok)
    rows["model (whole)"] = (median_ms(lambda _: model.forward(x_tok, B, T, y_tok)),
                             median_ms(lambda _: model.backward(1.0, full_cache)))
    rows["data: global batch"] = (median_ms(lambda _: trainer.microbatches(tokens, "train", 1)), 0.0)
    rows["zero_grad"] = (0.0, median_ms(lambda _: model.store.zero_grad()))
    rows["optimizer step (norm+clip+AdamW)"] = (0.0, median_ms(lambda _: trainer.optimizer.step(1e-4)))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step_reps = max(10, REPS // 2)
    rows["train_step (total)"] = (median_ms(lambda _: trainer.train_step(tokens), reps=step_reps), 0.0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / (step_reps + 2)   # + median_ms's warm-ups
    L = cfg.n_layers
    counts.update({"embedding (token+position)": 1, "layernorm": 2 * L + 1, "block (whole)": L, "head (tied)": 1,
                   "cross-entropy": 1, "data: global batch": 1, "zero_grad": 1, "optimizer step (norm+clip+AdamW)": 1,
                   "attention (whole)": L, "mlp (whole)": L, "model (whole)": 1, "train_step (total)": 1})
    counts.update({n: L for n in rows if n.startswith(("attn.", "mlp."))})    # sub-steps of a block
    mm_alloc, mm_out, gflop = matmul_lower_bound(cfg, np.float32)

    # The step as the sum of its parts: blocks already contain their layernorms.
    parts = ["embedding (token+position)", "block (whole)", "head (tied)", "cross-entropy",
             "data: global batch", "zero_grad", "optimizer step (norm+clip+AdamW)"]
    parts_ms = sum(sum(rows[n]) * counts[n] for n in parts) + sum(rows["layernorm"])     # + ln_f
    step_ms = rows["train_step (total)"][0]
    report = {"config": {"B": B, "T": T, "C": cfg.d_model, "H": cfg.n_heads, "L": L, "V": cfg.vocab_size,
                         "dtype": "float32", "blas_threads": 1, "reps": REPS},
              "layers_ms": {n: {"fwd": round(f, 4), "bwd": round(b, 4), "per_step": counts[n],
                                "step_ms": round((f + b) * counts[n], 3)}
                            for n, (f, b) in rows.items()},
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
        print(f"{'layer':36s} {'fwd ms':>8s} {'bwd ms':>8s} {'x/step':>6s} {'ms/step':>8s} {'% step':>7s}")
        for name, (f, b) in rows.items():
            n, indent = counts[name], "  " if name.startswith(("attn.", "mlp.")) else ""
            print(f"{indent + name:36s} {f:8.3f} {b:8.3f} {n:6d} {(f + b) * n:8.3f} {100 * (f + b) * n / step_ms:6.1f}%")
        print(f"sum of parts {parts_ms:.2f} ms vs measured step {step_ms:.2f} ms "
              f"({faults:.0f} page faults per step); matmuls alone "
              f"{mm_alloc:.2f} ms with @ ({mm_out:.2f} ms with out=), {gflop:.3f} GFLOP "
              f"= {gflop / (mm_out / 1e3):.0f} GFLOP/s")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
