"""Autoregressive sampling with a key/value cache, on any tensor-parallel size.

The prompt is run through the model once (prefill), filling every attention layer's
key/value cache; each new token then costs one forward over a single position. It is
the model's own forward, given the cache (`GPTStage.forward(..., kv=cache)`): there is
no second copy of the model's math to keep in step. Each tp rank caches its own heads
and the head produces vocabulary-sharded logits; only the last position's logits (V
numbers per sample) are gathered, so every rank draws the same token from the same
generator. Positions are learned up to seq_len: when the window is full it slides by
half (the last seq_len/2 tokens are prefilled again), so the prefix is recomputed once
per seq_len/2 tokens instead of once per token.
"""

import numpy as np


def _gather_logits(local, model):
    """(B, V/tp) vocabulary-sharded logits -> (B, V) on every tp rank."""
    tp = model.topo.tp_comm
    full = np.empty((tp.size,) + local.shape, local.dtype)
    full[tp.rank] = local
    tp.all_gather(full)
    return np.concatenate(list(full), axis=1)[:, :model.model_cfg.vocab_size]


def next_token_logits(model, tokens, kv) -> np.ndarray:
    """Forward tokens (B, t) at the cache's next positions; the last position's
    logits, (B, V), on every tp rank."""
    logits, _ = model.forward(tokens, kv=kv)
    return _gather_logits(np.ascontiguousarray(logits[:, -1]), model)


def sample_next(logits, rng, temperature: float, top_k: int | None):
    """Draw one token per row from softmax(logits / temperature), keeping the top k."""
    logits = logits.astype(np.float64)
    if temperature == 0:
        return logits.argmax(axis=1)
    logits = logits / temperature
    if top_k:
        kth = np.sort(logits, axis=1)[:, -min(top_k, logits.shape[1])][:, None]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(probs, axis=1)
    draws = rng.random(len(cdf))[:, None] * cdf[:, -1:]
    return np.minimum((cdf < draws).sum(axis=1), logits.shape[1] - 1)


def generate(model, prompt_ids, max_new_tokens: int, num_samples: int = 1, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0) -> np.ndarray:
    """Returns (num_samples, len(prompt) + max_new_tokens) token ids, identical on
    every rank. The model must be a whole (single-stage) model."""
    if not (model.first and model.last):
        raise ValueError("generation needs the whole model on one pipeline stage")
    rng, T = np.random.default_rng(seed), model.model_cfg.seq_len
    kv = model.new_kv_cache(num_samples)
    out = np.tile(np.asarray(prompt_ids, np.int64), (num_samples, 1))
    logits = next_token_logits(model, out[:, -T:], kv)
    for _ in range(max_new_tokens):
        token = sample_next(logits, rng, temperature, top_k)
        out = np.concatenate([out, token[:, None]], axis=1)
        if kv.pos == T:                   # window full: slide it by half
            kv.reset()
            logits = next_token_logits(model, out[:, -(T // 2):], kv)
        else:
            logits = next_token_logits(model, token[:, None], kv)
    return out
