"""Autoregressive sampling with a key/value cache, on any tensor-parallel size.

The prompt is run through the model once (prefill), filling each block's cache of
keys and values; every new token then costs one incremental forward over a single
position. Each tp rank caches the keys and values of its own heads only, and the
head produces vocabulary-sharded logits; only the last position's logits (V
numbers per sample) are gathered, so every rank draws the same token from the
same generator. Positions are learned up to seq_len: when the window is full it
slides by half (the last seq_len/2 tokens are prefilled again), so the prefix is
recomputed once per seq_len/2 tokens instead of once per token.
"""

import numpy as np


def _gather_logits(local, model):
    """(B, V/tp) vocabulary-sharded logits -> (B, V) on every tp rank."""
    tp = model.topo.tp_comm
    full = np.empty((tp.size,) + local.shape, local.dtype)
    full[tp.rank] = local
    tp.all_gather(full)
    return np.concatenate(list(full), axis=1)[:, :model.cfg.vocab_size]


def _prefill(model, tokens, kv):
    """Run tokens (B, t) from position 0, filling the caches; returns the logits of
    the last position, (B, V)."""
    B, t = tokens.shape
    x, _ = model.token_embedding.forward(tokens.reshape(-1))
    x += model.position_embedding.forward(B, t)
    return _through_blocks(model, x.reshape(B, t, -1), kv, 0)


def _through_blocks(model, x, kv, pos):
    B, t, C = x.shape
    for block, block_kv in zip(model.blocks, kv):
        x = block.decode(x, block_kv, pos)
    h, _ = model.ln_f.forward(x[:, -1])
    logits, _ = model.head.forward(h)
    return _gather_logits(model.loss_fn.mask_padding(logits), model)


def _step(model, token, kv, pos):
    """One new token per sample (B,) at position pos; returns (B, V) logits."""
    B = token.shape[0]
    x, _ = model.token_embedding.forward(token)
    x += model.position_embedding.weight.data[pos]
    return _through_blocks(model, x.reshape(B, 1, -1), kv, pos)


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
    cfg, rng = model.cfg, np.random.default_rng(seed)
    T = cfg.seq_len
    heads = model.blocks[0].attn.local_heads if model.blocks else 1
    kv = [(np.zeros((num_samples, heads, T, cfg.head_dim), model.dtype),
           np.zeros((num_samples, heads, T, cfg.head_dim), model.dtype)) for _ in model.blocks]
    out = np.tile(np.asarray(prompt_ids, np.int64), (num_samples, 1))
    context = out[:, -T:]
    logits = _prefill(model, context, kv)
    pos = context.shape[1]
    for _ in range(max_new_tokens):
        token = sample_next(logits, rng, temperature, top_k)
        out = np.concatenate([out, token[:, None]], axis=1)
        if pos == T:                      # window full: slide it by half
            pos = T // 2
            logits = _prefill(model, out[:, -pos:], kv)
        else:
            logits = _step(model, token, kv, pos)
            pos += 1
    return out
