"""The fastest a numpitron step could be on these BLAS calls: its matmuls alone, and
its matmuls with the exponentials that exact GELU and softmax cannot skip.

    python benchmarks/matmul_ceiling.py --n-layers 6 --n-heads 6 --d-model 384 --seq-len 256 --batch 8

Times every matmul one training step makes at this config, on one BLAS thread, with
the shapes and layouts the library gives them (`profile_layers.matmul_lower_bound`:
the three products of every linear layer, the attention's products tile by tile, the
tied head), and reports the tokens/s of a step in which everything else (GELU,
softmax, LayerNorm, AdamW, the interpreter, communication) took no time at all, with
its MFU against the sgemm peak benchmark.py measures. No layout or tuning of the
element-wise work can beat it; only fewer FLOPs or a faster BLAS can. A tighter bound
adds the step's exponentials (`profile_layers.exp_lower_bound`: one per GELU element
and one per softmax score, each as costly as ten arithmetic passes here), which no
arrangement of NumPy calls avoids: `tokens_per_s_with_exps`. Twice either rate bounds
two ranks on two cores. Prints one JSON object.
"""

import argparse
import json
import resource

import profile_layers  # first: it sets one BLAS thread before NumPy loads
import benchmark

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    profile_layers.add_model_flags(p)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    cfg = profile_layers.model_config(args, vocab_size=benchmark.VOCAB)
    profile_layers.REPS = args.reps
    peak = benchmark.sgemm_gflops(1024, 1024, 1024, np.float32, reps=20)
    ms, _, gflop = profile_layers.matmul_lower_bound(cfg, np.float32, args.batch, args.seq_len)
    exp_ms, exps = profile_layers.exp_lower_bound(cfg, np.float32, args.batch, args.seq_len)
    tokens = args.batch * args.seq_len
    tokens_per_s, with_exps = tokens / (ms / 1e3), tokens / ((ms + exp_ms) / 1e3)
    flops_per_token = benchmark.flops_per_token(cfg)[1]
    print(json.dumps({"threads": 1, "matmul_ms_per_step": round(ms, 2),
                      "matmul_gflop_per_step": round(gflop, 3), "tokens_per_s": round(tokens_per_s, 1),
                      "exp_ms_per_step": round(exp_ms, 2), "exps_per_step": exps,
                      "tokens_per_s_with_exps": round(with_exps, 1),
                      "peak_gflops_per_rank": round(peak, 1), "flops_per_token": flops_per_token,
                      "mfu": round(tokens_per_s * flops_per_token / (peak * 1e9), 4),
                      "mfu_with_exps": round(with_exps * flops_per_token / (peak * 1e9), 4),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))


if __name__ == "__main__":
    main()
