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


def attention_area(T: int, cp: int = 1) -> int:
    """Score entries per head a rank keeps for its local sequence of T tokens in two
    chunks of c = T // 2 (parallel/context.py). With cp = 1 the first chunk's queries
    see c keys, the second's all T; around a ring of cp ranks every rank computes
    2cp + 1 chunk pairs of c x c."""
    c = T // 2
    return c * c + (T - c) * T if cp == 1 else (2 * cp + 1) * c * c


def lse_rows(T: int, cp: int = 1, cp_rank: int = 0) -> int:
    """Rows of log-sum-exp kept per head: the running one (T) and one per softmax group
    (the two chunks once each with cp = 1; around a ring, rank r's late chunk meets cp
    groups and its early chunk r + 1)."""
    c = T // 2
    return T + (T if cp == 1 else (cp + cp_rank + 1) * c)


def block_activation_bytes(B: int, T: int, C: int, H: int, tp: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", itemsize: int = 8, cp: int = 1, cp_rank: int = 0) -> int:
    n = B * T // tp if sequence_parallel else B * T
    if recompute == "full":
        return itemsize * n * C
    elements = 4 * n * C + 2 * n + (3 + 1 + 12) * B * T * C // tp + B * H * lse_rows(T, cp, cp_rank) // tp
    if recompute != "selective":
        elements += B * H * attention_area(T, cp) // tp
    return itemsize * elements
