"""The bytes one transformer block keeps for its backward, derived from what each of
its layers puts in its cache (the derivation is in docs/09-sequence-parallelism-and-recomputation.md;
tests compare it with `cache_nbytes` of real caches, to the byte).

For B sequences of T tokens (the rank's part after context parallelism), width C, H
heads, tp tensor-parallel ranks and no dropout, in elements:

    LayerNorm regions (2 LayerNorms: x-hat and 1/std; 2 column-layer inputs)
                                  4 n C + 2 n            n = B T, or B T / tp sequence-parallel
    attention: q, k, v            3 B T C / tp
               head outputs        B T C / tp
               log-sum-exp (2x)   2 B T H / tp           the running one and each group's
               probabilities      B H P / tp             P = 3T^2/4: two chunks, one masked quarter skipped
    MLP: hidden, tanh, GELU      12 B T C / tp

Selective recomputation drops the probabilities; full recomputation keeps only the
block's input, n C.
"""


def attention_area(T: int) -> int:
    """Score entries per head for a sequence in two chunks (c = T // 2): the first
    chunk's queries see c keys, the second's all T (parallel/context.py, cp = 1)."""
    c = T // 2
    return c * c + (T - c) * T


def block_activation_bytes(B: int, T: int, C: int, H: int, tp: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", itemsize: int = 8) -> int:
    n = B * T // tp if sequence_parallel else B * T
    if recompute == "full":
        return itemsize * n * C
    elements = 4 * n * C + 2 * n + (3 + 1 + 12) * B * T * C // tp + 2 * B * T * H // tp
    if recompute != "selective":
        elements += B * H * attention_area(T) // tp
    return itemsize * elements
