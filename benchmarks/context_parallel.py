"""Context parallelism on this machine: which (query, key) chunk pairs every rank
computes with the zigzag split and with a plain split, how long each rank spends in
attention, and how much attention memory a rank keeps.

    mpiexec -n 4 python benchmarks/context_parallel.py --seq-len 1024

One attention layer (B x T x C, H heads) runs forward and backward with cp = the
world size. The time a rank spends computing attention blocks is measured by timing
the two blockwise kernels (context_parallel/blockwise_attention.py) from outside; the rest of a
ring step is waiting for the slowest rank. Prints one JSON object and writes
docs/figures/context_parallel_blocks.svg (from the pairs actually computed).
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(sys.argv)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from numpitron.distributed.topology import Topology  # noqa: E402
from numpitron.transformer import attention as attention_module  # noqa: E402
from numpitron.transformer.attention import ParallelAttention  # noqa: E402
from numpitron.nn.cache_bytes import cache_nbytes  # noqa: E402
from numpitron.nn.param_store import ParamStore  # noqa: E402
from numpitron.context_parallel.zigzag import contiguous_chunks, zigzag_chunks  # noqa: E402

SPLITS = {"zigzag": zigzag_chunks, "contiguous": contiguous_chunks}
busy = {"s": 0.0}


def timed(kernel):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return kernel(*args, **kwargs)
        finally:
            busy["s"] += time.perf_counter() - start
    return run


def measure(attn, x, dy, reps: int) -> dict:
    """Median per-rank busy and wall seconds of forward + backward, and what one
    forward computed: (step, query chunk, key chunk) and the attention bytes kept."""
    busy_s, wall_s = [], []
    for _ in range(reps + 1):
        MPI.COMM_WORLD.Barrier()
        busy["s"], start = 0.0, time.perf_counter()
        _, cache = attn.forward(x.copy())
        attn.backward_input(dy, cache)
        busy_s.append(busy["s"])
        wall_s.append(time.perf_counter() - start)
    T, cp = x.shape[1], attn.cp.size
    size = T // 2 if attn.ring.chunks is zigzag_chunks else T
    pairs = set()                 # a chunk pair is computed when any of its query tiles sees a key of it
    for step, groups in enumerate(cache["groups"]):
        owner = (attn.cp_rank - step) % cp
        for group in groups:
            for kc in attn.ring.chunks(T, cp, owner):
                if kc.start < group.key_end:
                    q_chunk = group.queries.position // size
                    pairs.add((step, q_chunk, kc.position // size, kc.position // size == q_chunk))
    pairs = sorted(pairs)
    kept = cache_nbytes([group.probs for groups in cache["groups"] for group in groups])
    return {"busy_ms": 1e3 * float(np.median(busy_s[1:])), "wall_ms": 1e3 * float(np.median(wall_s[1:])),
            "pairs": pairs, "probs_bytes": kept}


def draw(results: dict, cp: int, caption: str) -> str:
    """Two grids (query chunk x key chunk), one per split; a cell is coloured by the
    rank that computes it and labelled with the ring step. Each panel's title takes two
    lines and the explanation one line under both panels, so no text runs past its panel
    or the picture (about 6.5 px per character at 11 px)."""
    colours = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"]
    cell, gap, top = 34, 60, 62
    grid = 2 * cp * cell
    panels = []
    for p, (split, per_rank) in enumerate(results.items()):
        n = 2 * cp if split == "zigzag" else cp
        x0 = 40 + p * (grid + gap)
        work = " / ".join(f"{r['probs_bytes'] / 2**20:.1f}" for r in per_rank)
        panels.append(f'<text x="{x0}" y="{top - 32}" font-size="13" font-weight="bold">{split} split</text>')
        panels.append(f'<text x="{x0}" y="{top - 14}" font-size="11">kept per rank, MiB: {work}</text>')
        for r, rank_result in enumerate(per_rank):
            for step, qi, ki, diagonal in rank_result["pairs"]:
                scale = 2 * cp // n
                x, y, w = x0 + ki * cell * scale, top + qi * cell * scale, cell * scale
                panels.append(f'<rect x="{x}" y="{y}" width="{w - 2}" height="{w - 2}" fill="{colours[r % 8]}" '
                              f'opacity="{0.55 if diagonal else 0.95}"/>')
                panels.append(f'<text x="{x + w / 2 - 1}" y="{y + w / 2 + 4}" font-size="11" fill="white" '
                              f'text-anchor="middle">s{step}</text>')
    below = top + grid + 20
    legend = "".join(f'<rect x="{40 + 70 * r}" y="{below}" width="12" height="12" fill="{colours[r % 8]}"/>'
                     f'<text x="{56 + 70 * r}" y="{below + 11}" font-size="11">rank {r}</text>' for r in range(cp))
    key = (f'<text x="40" y="{below + 32}" font-size="11">keys (chunks) &#8594;, queries &#8595;; colour: rank; '
           f's: ring step; pale: diagonal pair (causal mask)</text>')
    widest = max(len(caption) * 6, 95 * 6.5, grid + gap + 26 * 6.5 + 6.5 * 5 * cp)  # caption, key, second title
    width = int(40 + max(2 * grid + gap, widest) + 20)
    height = below + 62
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">'
            f'<rect width="100%" height="100%" fill="white"/>{"".join(panels)}{legend}{key}'
            f'<text x="40" y="{height - 10}" font-size="10" fill="#555">{caption}</text></svg>\n')


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--batch", 4), ("--seq-len", 1024), ("--d-model", 128), ("--n-heads", 4), ("--reps", 5)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--figure", default="docs/figures/context_parallel_blocks.svg")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    cp = world.Get_size()
    topo = Topology.from_world(context=cp)
    attention_module.attend_block = timed(attention_module.attend_block)
    attention_module.attend_block_backward = timed(attention_module.attend_block_backward)
    attn = ParallelAttention("attn", args.d_model, args.n_heads, topo, out_std=0.02)
    ParamStore(attn.parameters(), np.float32).initialize(0)
    rng = np.random.default_rng(topo.cp_rank)
    local = (args.batch, args.seq_len // cp, args.d_model)
    x, dy = (rng.standard_normal(local).astype(np.float32) for _ in range(2))
    results = {}
    for split, chunks in SPLITS.items():
        attn.ring.chunks = chunks
        results[split] = world.gather(measure(attn, x, dy, args.reps), root=0)
    if world.Get_rank() != 0:
        return
    command = f"mpiexec -n {cp} python benchmarks/context_parallel.py --seq-len {args.seq_len}"
    machine = f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores"
    caption = f"{command} (B={args.batch}, C={args.d_model}, H={args.n_heads}, float32) on {machine}"
    summary = {split: {"busy_ms_per_rank": [round(r["busy_ms"], 2) for r in rs],
                       "wall_ms_per_rank": [round(r["wall_ms"], 2) for r in rs],
                       "pairs_per_rank": [len(r["pairs"]) for r in rs],
                       "imbalance_busy_max_over_mean": round(max(r["busy_ms"] for r in rs)
                                                             / np.mean([r["busy_ms"] for r in rs]), 3),
                       "probs_bytes_per_rank": [r["probs_bytes"] for r in rs]}
               for split, rs in results.items()}
    if args.figure:
        Path(args.figure).write_text(draw(results, cp, caption))
    print(json.dumps({"command": command, "machine": machine, "cp": cp, "seq_len": args.seq_len,
                      "batch": args.batch, "d_model": args.d_model, "n_heads": args.n_heads,
                      "full_scores_bytes": args.batch * args.n_heads * args.seq_len ** 2 * 4, **summary}))


if __name__ == "__main__":
    main()
