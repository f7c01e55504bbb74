"""Parameters and FLOPs of a GPT, as Narayanan et al. (2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM") count them.

Per layer and token the forward's matmuls cost 24 h^2 (q, k, v and the output
projection 8 h^2, the MLP 16 h^2) plus 4 s h for the scores and the attention-weighted
values; the backward costs twice the forward; the LM head 2 h V per token forward. So
one iteration of B sequences of s tokens costs

    72 B s l h^2 (1 + s/(6h) + V/(12 l h))          without recomputation
    96 B s l h^2 (1 + s/(6h) + V/(16 l h))          with full recomputation (eq. 3)

and selective recomputation adds the scores and attention-weighted values once more,
4 B s^2 h per layer. The first is the model's FLOPs (what MFU divides by); the others
are what the hardware executes.
"""


def parameter_count(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Eq. 2: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    return 12 * layers * hidden ** 2 * (1 + 13 / (12 * hidden) + (vocab + seq_len) / (12 * layers * hidden))


def model_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int) -> float:
    return 72 * batch * seq_len * layers * hidden ** 2 * (1 + seq_len / (6 * hidden) + vocab / (12 * layers * hidden))


def hardware_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int, recompute: str = "none") -> float:
    if recompute == "full":
        return 96 * batch * seq_len * layers * hidden ** 2 * (1 + seq_len / (6 * hidden) + vocab / (16 * layers * hidden))
    extra = 4 * batch * seq_len ** 2 * hidden * layers if recompute == "selective" else 0
    return model_flops(batch, seq_len, layers, hidden, vocab) + extra
