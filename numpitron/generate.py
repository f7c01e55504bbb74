"""Autoregressive sampling with a key/value cache, on any tp x pp x dp mesh.

The prompt is run through the model once (prefill), filling every attention layer's
key/value cache; each new token then costs one forward over a single position. It is
the model's own forward, given the cache (`GPTStage.forward(..., kv=cache)`): there is
no second copy of the model's math to keep in step. Each tp rank caches its own heads
and the head produces vocabulary-sharded logits; only the last position's logits (V
numbers per sample) are gathered, so every rank draws the same token from the same
generator. Positions are learned up to seq_len: when the window is full it slides by
half (the last seq_len/2 tokens are prefilled again), so the prefix is recomputed once
per seq_len/2 tokens instead of once per token.

Pipeline stages pass each new token's activations (B, 1, C) stage to stage; every
stage keeps the key/value cache of its own blocks, and the last stage's logits are
broadcast back over pp so every stage draws the same token. Data-parallel replicas
split the samples (as evenly as they divide): sample k draws from its own generator, seeded (seed, k), so the
text of each sample is the same whatever the mesh.
"""

import numpy as np

from numpitron.distributed.sharding import balanced_bounds, pad_to_multiple, shard_size
from numpitron.nn.kv_cache import KVCache

ACTIVATION_TAG = 0


def _gather_logits(local, model):
    """(B, V/tp) vocabulary-sharded logits -> (B, V) on every tp rank."""
    tp = model.topo.tp_comm
    full = np.empty((tp.size,) + local.shape, local.dtype)
    full[tp.rank] = local
    tp.all_gather(full)
    return np.concatenate(list(full), axis=1)[:, :model.model_cfg.vocab_size]


def next_token_logits(model, tokens, kv) -> np.ndarray:
    """Forward tokens (B, t) at the cache's next positions through the pipeline; the
    last position's logits, (B, V), on every rank of it."""
    topo, (B, t) = model.topo, tokens.shape
    inputs = tokens if model.first else topo.pp_comm.recv(np.empty(model.input_shape(B, t), model.dtype),
                                                           topo.prev_stage, ACTIVATION_TAG)
    out, _ = model.forward(inputs, kv=kv)
    if not model.last:
        topo.pp_comm.send(out, topo.next_stage, ACTIVATION_TAG)
    logits = (np.ascontiguousarray(_gather_logits(np.ascontiguousarray(out[:, -1]), model)) if model.last
              else np.empty((B, model.model_cfg.vocab_size), model.dtype))
    return topo.pp_comm.broadcast(logits, root=topo.pp - 1)


def sample_next(logits, rngs, temperature: float, top_k: int | None):
    """Draw one token per row from softmax(logits / temperature), keeping the top k;
    row i draws from rngs[i]."""
    logits = logits.astype(np.float64)
    if temperature == 0:
        return logits.argmax(axis=1)
    logits = logits / temperature
    if top_k:
        kth = np.sort(logits, axis=1)[:, -min(top_k, logits.shape[1])][:, None]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(probs, axis=1)
    draws = np.array([rng.random() for rng in rngs])[:, None] * cdf[:, -1:]
    return np.minimum((cdf < draws).sum(axis=1), logits.shape[1] - 1)


def generate(model, prompt_ids, max_new_tokens: int, num_samples: int = 1, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0) -> np.ndarray:
    """Returns (num_samples, len(prompt) + max_new_tokens) token ids, identical on
    every rank. Replica d of dp generates samples [d n / dp, (d + 1) n / dp), rounded
    down (none, when there are fewer samples than replicas), then the replicas
    exchange theirs. Check the sizes first (`memory.check_generation_fits`)."""
    topo = model.topo
    shares = [balanced_bounds(num_samples, topo.dp, d) for d in range(topo.dp)]
    start, stop = shares[topo.dp_rank]
    most = pad_to_multiple(num_samples, topo.dp) // topo.dp          # the largest share
    everyone = np.zeros((topo.dp, most, len(prompt_ids) + max_new_tokens), np.int64)
    # A replica without a sample still takes every step, on one placeholder row it then
    # drops: its expert-parallel peers wait for its tokens in each all-to-all. (Experts
    # see each row on its own, so the placeholder changes no other row.)
    rows = max(stop - start, 1)
    mine = everyone[topo.dp_rank, :rows]
    mine[:, :len(prompt_ids)] = prompt_ids
    rngs = [np.random.default_rng([seed, k]) for k in range(start, start + rows)]
    for i, tokens in enumerate(new_tokens(model, prompt_ids, max_new_tokens, rngs, temperature, top_k)):
        mine[:, len(prompt_ids) + i] = tokens
    mine[stop - start:] = 0                                          # the placeholder
    topo.dp_comm.all_gather(everyone)
    return np.concatenate([everyone[d, :b - a] for d, (a, b) in enumerate(shares)])


def stream(model, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           seed: int = 0):
    """Yields, one at a time as they are drawn, the new tokens of the one sample that
    `generate(..., num_samples=1)` returns, on every rank: every dp replica draws it (one
    without a sample would step on a placeholder row anyway). Only the window the model
    sees is kept, so the length costs no memory."""
    for tokens in new_tokens(model, prompt_ids, max_new_tokens, [np.random.default_rng([seed, 0])], temperature,
                             top_k):
        yield int(tokens[0])


def new_kv_cache(model, batch: int, chunk: int = 0) -> KVCache:
    """An empty key/value cache for generating `batch` sequences through a chunk of the stage."""
    c = model.model_cfg
    return KVCache(len(model.chunk_blocks[chunk]), batch, shard_size(c.n_heads, model.topo.tp), c.seq_len, c.head_dim,
                   model.dtype)


def new_tokens(model, prompt_ids, max_new_tokens: int, rngs, temperature: float, top_k: int | None):
    """Yields max_new_tokens times the next token of each of len(rngs) rows that start
    from the prompt, row i drawing from rngs[i]. Keeps the last seq_len tokens: all the
    model sees."""
    if model.virtual_stages != 1 or model.topo.cp != 1:
        raise ValueError("generation runs on one chunk per stage and whole sequences (cp = 1)")
    T = model.model_cfg.seq_len
    window = np.tile(np.asarray(prompt_ids, np.int64)[-T:], (len(rngs), 1))
    kv = new_kv_cache(model, len(rngs))
    logits = next_token_logits(model, window, kv)
    for n in range(max_new_tokens):
        token = sample_next(logits, rngs, temperature, top_k)
        yield token
        if n + 1 == max_new_tokens:
            return                        # no forward for a token nobody draws
        window = np.concatenate([window, token[:, None]], axis=1)[:, -T:]
        if kv.pos == T:                   # window full: slide it by half
            kv.reset()
            logits = next_token_logits(model, window[:, -(T // 2):], kv)
        else:
            logits = next_token_logits(model, token[:, None], kv)
