"""The bytes one transformer block keeps for its backward, derived from what each of
its layers puts in its cache (the derivation is in docs/06-sequence-parallelism-and-recomputation.md;
tests compare it with `cache_nbytes` of real caches, to the byte).

For B sequences of T tokens (the rank's part after context parallelism), width C, H
heads, tp tensor-parallel ranks and no dropout, in elements:

    LayerNorm regions (2 LayerNorms: x-hat; 2 column-layer inputs)
                                  4 n C                  n = B T, or B T / tp sequence-parallel
    attention: q, k, v            3 B T C / tp
               head outputs        B T C / tp
               probabilities      B H P / tp             P ~ T (T + t) / 2: query tiles of t rows
                                                         skip the keys in their future
    MLP: GELU's slope, output     8 B T C / tp
    statistics: 1/std             2 n                    (the 2 LayerNorms)
               log-sum-exp        B H (T + G) / tp       the running one and each group's (G rows)

Selective recomputation drops the probabilities; full recomputation keeps only the
block's input, n C. The activations take `itemsize` bytes each: 2 in a bf16 or fp16
run, which keeps them in the low format (nn/layer.py); the statistics `stat_itemsize`,
4 there (they stay fp32, as accelerators' kernels keep them). In fp32 and float64 runs
both are the dtype's size.
"""

from numpitron.context_parallel.zigzag import zigzag_chunks
from numpitron.context_parallel.blockwise_attention import query_tiles, visible_keys


def softmax_groups(T: int, cp: int = 1, cp_rank: int = 0):
    """(query tile, the key chunks it sees) of every softmax group a rank computes for
    its local sequence of T tokens over a whole ring: the query tiles of its two zigzag
    chunks (context_parallel/zigzag.py) against the visible prefix of each block, exactly as
    transformer/attention.py walks them."""
    mine = query_tiles(zigzag_chunks(T, cp, cp_rank))
    for step in range(cp):
        owner = (cp_rank - step) % cp
        for tile in mine:
            seen = visible_keys(tile, zigzag_chunks(T, cp, owner))
            if seen:
                yield tile, seen


def attention_area(T: int, cp: int = 1, cp_rank: int = 0) -> int:
    """Probabilities per head a rank keeps: about T (T + t) / 2 with cp = 1 and query
    tiles of t rows, against the T^2 of the whole score matrix."""
    return sum((tile.stop - tile.start) * seen[-1].stop for tile, seen in softmax_groups(T, cp, cp_rank))


def lse_rows(T: int, cp: int = 1, cp_rank: int = 0) -> int:
    """Rows of log-sum-exp kept per head: the running one (T) and one per softmax group."""
    return T + sum(tile.stop - tile.start for tile, _ in softmax_groups(T, cp, cp_rank))


def block_activation_bytes(B: int, T: int, C: int, H: int, tp: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", itemsize: int = 8, cp: int = 1, cp_rank: int = 0,
                           stat_itemsize: int = 0) -> int:
    n = B * T // tp if sequence_parallel else B * T
    if recompute == "full":
        return itemsize * n * C
    activations = 4 * n * C + (3 + 1 + 8) * B * T * C // tp
    if recompute != "selective":
        activations += B * H * attention_area(T, cp, cp_rank) // tp
    statistics = 2 * n + B * H * lse_rows(T, cp, cp_rank) // tp
    return itemsize * activations + (stat_itemsize or itemsize) * statistics
