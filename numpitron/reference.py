"""A whole GPT in plain NumPy, on one process: read this file first (chapter 1,
docs/01-one-process.md).

    python -m numpitron.reference --data-dir data --max-iters 2000 [--dtype float64]

trains the model and the recipe that `python train_shakespeare.py` trains by default
(the same flag names change them) and prints one JSON object per iteration,
{"iter": i, "train_loss": ...}, numbered as the run's metrics.jsonl numbers them. In
float64 its losses equal the library's on one process to a relative 1e-10
(tests/test_reference_gpt.py): same characters, same batches, same initial weights,
same updates.

Everything here is the formula as the paper writes it, over whole arrays: no flat
buffers, no tiles or chunks, nothing in place, no communicators. It imports NumPy and
the standard library only. The library computes the same functions in fewer passes
over memory and on any mesh; its kernels' docstrings point to their plain twins here
(the first section), and tests/test_kernels_vs_reference.py holds each kernel to its
twin in float64 and float32.

Shapes: B sequences of T tokens, width C, H heads of D = C / H, vocabulary V, L blocks.
Every function takes arrays of any float dtype and keeps it (constants are Python
floats, so float32 stays float32); the last axis is the feature (or key) axis.
"""

import argparse
import json
import math
import sys
import zlib
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------------
# The formulas the tuned kernels compute
# ---------------------------------------------------------------------------------

GELU_S = math.sqrt(2.0 / math.pi)       # Python floats: a float32 input stays float32
GELU_A = 0.044715


def gelu(x):
    """GPT-2's GELU, tanh form (Hendrycks & Gimpel 2016, §2):
    gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)."""
    u = GELU_S * (x + GELU_A * x ** 3)
    return 0.5 * x * (1.0 + np.tanh(u))


def gelu_slope(x):
    """d gelu / dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh(u)^2) du/dx,
    du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)."""
    u = GELU_S * (x + GELU_A * x ** 3)
    du_dx = GELU_S * (1.0 + 3.0 * GELU_A * x ** 2)
    t = np.tanh(u)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t ** 2) * du_dx


def layernorm(x, weight, bias, eps=1e-5):
    """Ba et al. 2016, §3, over the last axis: y = (x - mean) / sqrt(var + eps) * weight + bias."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def layernorm_backward(x, weight, dy, eps=1e-5):
    """(dx, dweight, dbias) of `layernorm` for the output gradient dy. With
    xhat = (x - mean) r, r = 1 / sqrt(var + eps) and g = dy * weight (chapter 1):
    dx = r (g - mean(g) - xhat mean(g xhat)), dweight = sum of dy xhat, dbias = sum of dy."""
    mean = x.mean(axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    xhat = (x - mean) * r
    g = dy * weight
    dx = r * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    batch_axes = tuple(range(x.ndim - 1))
    return dx, (dy * xhat).sum(axis=batch_axes), dy.sum(axis=batch_axes)


def softmax(s):
    """exp(s) / sum(exp(s)) along the last axis. Subtracting the row maximum first
    changes nothing but keeps exp from overflowing."""
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def logsumexp(s):
    """log(sum(exp(s))) along the last axis, keeping it: the softmax's normaliser."""
    top = s.max(axis=-1, keepdims=True)
    return top + np.log(np.exp(s - top).sum(axis=-1, keepdims=True))


def causal_attention_probs(q, k, q_start=0):
    """P = softmax(q k^T / sqrt(d) + mask) (Vaswani et al. 2017, eq. 1), q: (..., Tq, d),
    k: (..., Tk, d). Query i sits at position q_start + i, key j at position j; the
    mask hides (minus infinity) every key after its query's position."""
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    q_pos = q_start + np.arange(q.shape[-2])[:, None]
    k_pos = np.arange(k.shape[-2])[None, :]
    return softmax(np.where(k_pos > q_pos, -np.inf, scores))


def causal_attention(q, k, v, q_start=0):
    """O = P v, the whole score matrix at once (no tiles, no blocks)."""
    return causal_attention_probs(q, k, q_start) @ v


def causal_attention_backward(q, k, v, dout, q_start=0):
    """(dq, dk, dv) of `causal_attention` for dO, by the chain rule through O = P v,
    P = softmax(S) row by row (dS = P (dP - rowsum(dP P))) and S = q k^T / sqrt(d)."""
    p = causal_attention_probs(q, k, q_start)
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    scale = 1.0 / math.sqrt(q.shape[-1])
    return ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, dv


def adamw_step(p, g, m, v, t, lr, beta1, beta2, eps, weight_decay, decay_mask):
    """One AdamW step (Loshchilov & Hutter 2019, Alg. 2, with the schedule multiplier
    folded into lr), t counting from 1. Returns the new (p, m, v):

        m = b1 m + (1 - b1) g                v = b2 v + (1 - b2) g^2
        m_hat = m / (1 - b1^t)               v_hat = v / (1 - b2^t)
        p = p - lr (m_hat / (sqrt(v_hat) + eps) + weight_decay * decay_mask * p)

    The moments and their bias corrections are Adam's (Kingma & Ba 2015, Alg. 1). The
    decay is decoupled: it shrinks p itself, never passing through m and v; it
    applies where decay_mask is 1 (matrices and embeddings, not biases or LayerNorm)."""
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1 ** t)
    v_hat = v / (1 - beta2 ** t)
    p = p - lr * (m_hat / (np.sqrt(v_hat) + eps) + weight_decay * decay_mask * p)
    return p, m, v


def global_grad_norm(grads, norm_mask):
    """sqrt(sum of norm_mask * g^2) over every rank's whole flat gradient (clipping by
    the global norm, Pascanu et al. 2013, Alg. 1). grads and norm_mask: one array
    each, or lists of them, one per rank; the mask is 0 where another rank counts
    the same logical element."""
    pairs = zip(grads, norm_mask) if isinstance(grads, list) else [(grads, norm_mask)]
    return math.sqrt(sum(float(np.sum(mask * g * g)) for g, mask in pairs))


def cross_entropy(logits, targets):
    """The mean over the B T tokens of -log softmax(z)[target] = logsumexp(z) - z[target]:
    the negative log-likelihood of the next character (Radford et al. 2019, §2)."""
    z_target = np.take_along_axis(logits, targets[..., None], axis=-1)
    return float(np.mean(logsumexp(logits) - z_target))


def cross_entropy_backward(logits, targets, dloss):
    """dL/dz = (softmax(z) - onehot(target)) dloss / N, N = B T tokens."""
    onehot = np.arange(logits.shape[-1]) == targets[..., None]
    return (softmax(logits) - onehot) * (dloss / targets.size)


def linear_backward(x, w, dy):
    """Y = X W + b: dX = dY W^T, dW = X^T dY, db = the sum of dY over every row."""
    x_rows, dy_rows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    return dy @ w.T, x_rows.T @ dy_rows, dy_rows.sum(axis=0)


# ---------------------------------------------------------------------------------
# The data: Tiny Shakespeare, one token per character
# ---------------------------------------------------------------------------------

TEXT_NAME = "tinyshakespeare.txt"
TRAIN_FRACTION = 0.9        # the first 90% of the characters train, the rest validate


def load_shakespeare(data_dir):
    """(characters, train tokens, val tokens). The vocabulary is every distinct
    character of the whole text, sorted, so the same text always gives the same ids;
    a token is a character's index in it."""
    # Decoded from the bytes: reading in text mode would turn any "\r\n" into "\n".
    text = (Path(data_dir) / TEXT_NAME).read_bytes().decode("utf-8")
    chars = sorted(set(text))
    id_of = {c: i for i, c in enumerate(chars)}
    tokens = np.array([id_of[c] for c in text], dtype=np.int64)
    n_train = int(len(tokens) * TRAIN_FRACTION)
    return chars, tokens[:n_train], tokens[n_train:]


def get_batch(tokens, seed, stream, index, batch_size, seq_len):
    """Batch `index` of `stream` ("train", "eval-val", ...): batch_size windows of
    seq_len + 1 tokens at random starts; the targets y are the inputs x shifted by one.
    The generator is seeded by (seed, crc32(stream), index), so batch i is the same
    whoever asks and whenever (a resumed run needs no saved generator state)."""
    rng = np.random.default_rng([seed, zlib.crc32(stream.encode("utf-8")), index])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)    # the last window ends at the last token
    windows = tokens[starts[:, None] + np.arange(seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]


# ---------------------------------------------------------------------------------
# The parameters
# ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 65        # set from the text's characters
    seq_len: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 128


def parameter_specs(cfg):
    """{name: (shape, init, decays)}: init is a standard deviation, "ones" or "zeros";
    decays says whether AdamW's weight decay shrinks it (matrices and embeddings do,
    biases and LayerNorm's gain and bias do not). Names as the library's checkpoints
    spell them."""
    C, L = cfg.d_model, cfg.n_layers
    # GPT-2 (Radford et al. 2019, §2.3): the layers that write into the residual
    # stream start smaller by 1/sqrt(N), N = 2L of them, so the stream's variance
    # does not grow with depth.
    out_std = 0.02 / math.sqrt(2 * L)

    def norm(name):
        return {f"{name}.weight": ((C,), "ones", False), f"{name}.bias": ((C,), "zeros", False)}

    specs = {"embedding.token.weight": ((cfg.vocab_size, C), 0.02, True),     # also the output layer
             # learned positions (Vaswani et al. 2017, §3.5, found them as good as sinusoids)
             "embedding.position.weight": ((cfg.seq_len, C), 0.02, True)}
    for i in range(L):
        b = f"blocks.{i}"
        specs.update(norm(f"{b}.ln1"))
        # q, k and v in one (C, 3, C) matrix: column j of part 0 is q's feature j
        specs[f"{b}.attn.qkv.weight"] = ((C, 3, C), 0.02, True)
        specs[f"{b}.attn.qkv.bias"] = ((3, C), "zeros", False)
        specs[f"{b}.attn.proj.weight"] = ((C, C), out_std, True)
        specs[f"{b}.attn.proj.bias"] = ((C,), "zeros", False)
        specs.update(norm(f"{b}.ln2"))
        specs[f"{b}.mlp.fc.weight"] = ((C, 4 * C), 0.02, True)
        specs[f"{b}.mlp.fc.bias"] = ((4 * C,), "zeros", False)
        specs[f"{b}.mlp.proj.weight"] = ((4 * C, C), out_std, True)
        specs[f"{b}.mlp.proj.bias"] = ((C,), "zeros", False)
    specs.update(norm("ln_f"))
    return specs


def init_params(cfg, seed, dtype):
    """{name: array}. Each random tensor is drawn whole, in float64, from a generator
    of its own seeded by (seed, crc32(name)): the same numbers however a mesh would
    split it, and adding a layer changes no other layer's draw."""
    params = {}
    for name, (shape, init, _) in parameter_specs(cfg).items():
        if init == "ones":
            value = np.ones(shape)
        elif init == "zeros":
            value = np.zeros(shape)
        else:
            value = np.random.default_rng([seed, zlib.crc32(name.encode())]).normal(0.0, init, shape)
        params[name] = value.astype(dtype)
    return params


def block_params(params, i):
    """Block i's parameters by their names inside the block ("ln1.weight", ...)."""
    prefix = f"blocks.{i}."
    return {name[len(prefix):]: p for name, p in params.items() if name.startswith(prefix)}


# ---------------------------------------------------------------------------------
# The model, forward
# ---------------------------------------------------------------------------------

def block_forward(p, x, n_heads):
    """A pre-LayerNorm transformer block (Radford et al. 2019, §2.3, moving Vaswani et
    al.'s LayerNorm to each sub-layer's input): x + attention(ln1(x)), then
    + mlp(ln2(.)). Returns the output and what the backward needs."""
    B, T, C = x.shape
    D = C // n_heads
    h1 = layernorm(x, p["ln1.weight"], p["ln1.bias"])
    # Multi-head attention (Vaswani et al. 2017, §3.2.2): q, k, v in one product, then
    # split into H heads of D features that attend independently, causally.
    qkv = h1 @ p["attn.qkv.weight"].reshape(C, 3 * C) + p["attn.qkv.bias"].reshape(3 * C)
    q, k, v = qkv.reshape(B, T, 3, n_heads, D).transpose(2, 0, 3, 1, 4)       # each (B, H, T, D)
    heads = causal_attention(q, k, v)
    att = heads.transpose(0, 2, 1, 3).reshape(B, T, C)                       # the heads side by side
    x_mid = x + att @ p["attn.proj.weight"] + p["attn.proj.bias"]
    # The MLP, 4C wide inside (Vaswani et al. 2017, §3.3), with GPT-2's GELU.
    h2 = layernorm(x_mid, p["ln2.weight"], p["ln2.bias"])
    pre = h2 @ p["mlp.fc.weight"] + p["mlp.fc.bias"]
    act = gelu(pre)
    out = x_mid + act @ p["mlp.proj.weight"] + p["mlp.proj.bias"]
    return out, dict(x=x, h1=h1, q=q, k=k, v=v, att=att, x_mid=x_mid, h2=h2, pre=pre, act=act)


def gpt_forward(params, cfg, ids, targets):
    """(mean loss, cache) of token ids (B, T) against their next tokens (B, T)."""
    T = ids.shape[1]
    token = params["embedding.token.weight"]
    x = token[ids] + params["embedding.position.weight"][:T]
    caches = []
    for i in range(cfg.n_layers):
        x, cache = block_forward(block_params(params, i), x, cfg.n_heads)
        caches.append(cache)
    h = layernorm(x, params["ln_f.weight"], params["ln_f.bias"])     # GPT-2's final LayerNorm
    # The output layer is the token table itself (Press & Wolf 2017, tied embeddings):
    # a character's logit is how well h matches its embedding.
    logits = h @ token.T                                            # (B, T, V)
    loss = cross_entropy(logits, targets)
    return loss, dict(ids=ids, targets=targets, blocks=caches, x=x, h=h, logits=logits)


# ---------------------------------------------------------------------------------
# The model, backward: the chain rule, layer by layer in reverse
# ---------------------------------------------------------------------------------

def block_backward(p, c, dout, n_heads):
    """(dL/dx, {name: dL/dparam}) of `block_forward` for dL/dout, c its cache."""
    g = {}
    # out = x_mid + gelu(h2 W_fc + b_fc) W_proj + b_proj
    dact, g["mlp.proj.weight"], g["mlp.proj.bias"] = linear_backward(c["act"], p["mlp.proj.weight"], dout)
    dpre = dact * gelu_slope(c["pre"])
    dh2, g["mlp.fc.weight"], g["mlp.fc.bias"] = linear_backward(c["h2"], p["mlp.fc.weight"], dpre)
    dx_ln2, g["ln2.weight"], g["ln2.bias"] = layernorm_backward(c["x_mid"], p["ln2.weight"], dh2)
    dx_mid = dout + dx_ln2                  # the residual hands dout through unchanged
    # x_mid = x + attention(h1) W_proj + b_proj
    datt, g["attn.proj.weight"], g["attn.proj.bias"] = linear_backward(c["att"], p["attn.proj.weight"], dx_mid)
    B, T, C = datt.shape
    dheads = datt.reshape(B, T, n_heads, C // n_heads).transpose(0, 2, 1, 3)
    dq, dk, dv = causal_attention_backward(c["q"], c["k"], c["v"], dheads)
    dqkv = np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * C)   # undo the split
    dh1, dw, db = linear_backward(c["h1"], p["attn.qkv.weight"].reshape(C, 3 * C), dqkv)
    g["attn.qkv.weight"], g["attn.qkv.bias"] = dw.reshape(C, 3, C), db.reshape(3, C)
    dx_ln1, g["ln1.weight"], g["ln1.bias"] = layernorm_backward(c["x"], p["ln1.weight"], dh1)
    return dx_mid + dx_ln1, g


def gpt_backward(params, cfg, cache, dloss):
    """{name: dL/dparam} for dL/dloss = dloss (the weight of this micro-batch's loss)."""
    grads = {}
    token = params["embedding.token.weight"]
    dlogits = cross_entropy_backward(cache["logits"], cache["targets"], dloss)
    # logits = h E^T: dh = dlogits E, and the table's first gradient, dE = dlogits^T h
    V, C = token.shape
    dh = dlogits @ token
    dtoken = dlogits.reshape(-1, V).T @ cache["h"].reshape(-1, C)
    dx, grads["ln_f.weight"], grads["ln_f.bias"] = layernorm_backward(cache["x"], params["ln_f.weight"], dh)
    for i in reversed(range(cfg.n_layers)):
        dx, g = block_backward(block_params(params, i), cache["blocks"][i], dx, cfg.n_heads)
        grads.update({f"blocks.{i}.{name}": grad for name, grad in g.items()})
    # x = E[ids] + P[:T]: each row of E gathers the gradient of every place it was
    # looked up (its second gradient, beside the output layer's); each position's
    # row, that of its place in every sequence.
    np.add.at(dtoken, cache["ids"], dx)
    grads["embedding.token.weight"] = dtoken
    dposition = np.zeros_like(params["embedding.position.weight"])
    dposition[:dx.shape[1]] = dx.sum(axis=0)
    grads["embedding.position.weight"] = dposition
    return grads


# ---------------------------------------------------------------------------------
# The optimizer: learning-rate schedule, clipping, AdamW
# ---------------------------------------------------------------------------------

def learning_rate(iteration, lr, min_lr, warmup_iters, decay_iters):
    """Linear warmup (Goyal et al. 2017, §2.2), then half a cosine from lr down to
    min_lr (Loshchilov & Hutter 2017, SGDR, eq. 5, without restarts), then min_lr.
    The warmup counts iteration + 1 of warmup_iters + 1, so the first step is not
    wasted at lr 0 and lr is reached at iteration warmup_iters itself."""
    if iteration < warmup_iters:
        return lr * (iteration + 1) / (warmup_iters + 1)
    if iteration >= decay_iters:
        return min_lr
    progress = (iteration - warmup_iters) / max(1, decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def clip_by_global_norm(grads, max_norm):
    """(grads scaled so that their norm over every parameter at once is at most
    max_norm, the norm before): a rare huge gradient cannot throw the weights far
    (Pascanu et al. 2013, Alg. 1). max_norm / (norm + 1e-6), as torch's
    clip_grad_norm_ divides; 0 turns clipping off."""
    norm = global_grad_norm(list(grads.values()), [1.0] * len(grads))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        grads = {name: g * scale for name, g in grads.items()}
    return grads, norm


class AdamW:
    """AdamW's state: the two moments of every parameter and the step count."""

    def __init__(self, params, specs, beta1, beta2, eps, weight_decay):
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.m = {name: np.zeros_like(p) for name, p in params.items()}
        self.v = {name: np.zeros_like(p) for name, p in params.items()}
        self.decay = {name: 1.0 if decays else 0.0 for name, (_, _, decays) in specs.items()}
        self.t = 0

    def step(self, params, grads, lr):
        self.t += 1
        for name in params:
            params[name], self.m[name], self.v[name] = adamw_step(
                params[name], grads[name], self.m[name], self.v[name], self.t, lr,
                self.beta1, self.beta2, self.eps, self.weight_decay, self.decay[name])


# ---------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """train_shakespeare.py's defaults (one process)."""
    micro_batch_size: int = 12
    global_batch_size: int = 0      # 0: one micro-batch
    max_iters: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 0         # 0: max_iters
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0          # 0: no clipping
    eval_interval: int = 250
    eval_iters: int = 200
    seed: int = 1337

    @property
    def batch_size(self):
        return self.global_batch_size or self.micro_batch_size


def batch_loss_and_grads(params, cfg, recipe, x, y, with_grads=True):
    """The batch cut into micro-batches of micro_batch_size rows (all that memory need
    hold at once): their losses, and the gradient of their mean, each micro-batch's
    backward weighted 1/m and the m gradients summed (gradient accumulation)."""
    mb = recipe.micro_batch_size
    m = len(x) // mb
    losses, grads = [], {name: np.zeros_like(p) for name, p in params.items()}
    for s in range(0, len(x), mb):
        loss, cache = gpt_forward(params, cfg, x[s:s + mb], y[s:s + mb])
        losses.append(loss)
        if with_grads:
            for name, g in gpt_backward(params, cfg, cache, 1.0 / m).items():
                grads[name] += g
    return losses, grads


def train_step(params, optimizer, cfg, recipe, train_tokens, iteration):
    """One iteration: the batch of (seed, "train", iteration), its loss and gradient,
    the gradient clipped, one AdamW step. Returns the iteration's record."""
    x, y = get_batch(train_tokens, recipe.seed, "train", iteration, recipe.batch_size, cfg.seq_len)
    losses, grads = batch_loss_and_grads(params, cfg, recipe, x, y)
    lr = learning_rate(iteration, recipe.lr, recipe.min_lr, recipe.warmup_iters,
                       recipe.lr_decay_iters or recipe.max_iters)
    grads, norm = clip_by_global_norm(grads, recipe.grad_clip)
    optimizer.step(params, grads, lr)
    # every micro-batch counts the same number of tokens: the mean of their means
    return {"train_loss": float(np.mean(losses)), "lr": lr, "grad_norm": norm}


def evaluate(params, cfg, recipe, splits):
    """The mean loss of eval_iters fixed batches of each split (streams "eval-train",
    "eval-val"): the same batches at every evaluation, so two are comparable."""
    out = {}
    for name, tokens in splits.items():
        losses = []
        for k in range(recipe.eval_iters):
            x, y = get_batch(tokens, recipe.seed, f"eval-{name}", k, recipe.batch_size, cfg.seq_len)
            losses += batch_loss_and_grads(params, cfg, recipe, x, y, with_grads=False)[0]
        out[name] = float(np.mean(losses))
    return out


def train(cfg, recipe, splits, dtype):
    """Yield one record per iteration, {"iter": iterations done, "train_loss", "lr",
    "grad_norm"}, and after every eval_interval-th and the last also "val_loss" and
    "eval_train_loss", as metrics.jsonl writes them."""
    params = init_params(cfg, recipe.seed, dtype)
    optimizer = AdamW(params, parameter_specs(cfg), recipe.beta1, recipe.beta2, recipe.eps, recipe.weight_decay)
    for iteration in range(recipe.max_iters):
        record = {"iter": iteration + 1, **train_step(params, optimizer, cfg, recipe, splits["train"], iteration)}
        if (iteration + 1) % recipe.eval_interval == 0 or iteration + 1 == recipe.max_iters:
            losses = evaluate(params, cfg, recipe, splits)
            record.update(val_loss=losses["val"], eval_train_loss=losses["train"])
        yield record


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m numpitron.reference",
                                description="Train the default GPT on Tiny Shakespeare in plain NumPy, one process.")
    p.add_argument("--data-dir", default="data", help=f"where {TEXT_NAME} is")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    for field in fields(GPTConfig):
        if field.name != "vocab_size":
            p.add_argument("--" + field.name.replace("_", "-"), type=int, default=field.default)
    for field in fields(Recipe):
        p.add_argument("--" + field.name.replace("_", "-"), type=field.type, default=field.default)
    args = p.parse_args(argv)
    if args.d_model % args.n_heads:
        p.error(f"d_model ({args.d_model}) must be divisible by n_heads ({args.n_heads})")
    recipe = Recipe(**{f.name: getattr(args, f.name) for f in fields(Recipe)})
    if recipe.batch_size % recipe.micro_batch_size:
        p.error(f"global batch size ({recipe.batch_size}) must be divisible by micro batch size "
                f"({recipe.micro_batch_size})")
    return args, recipe


def main(argv=None):
    args, recipe = parse_args(argv)
    chars, train_tokens, val_tokens = load_shakespeare(args.data_dir)
    cfg = GPTConfig(len(chars), args.seq_len, args.n_layers, args.n_heads, args.d_model)
    for record in train(cfg, recipe, {"train": train_tokens, "val": val_tokens}, np.dtype(args.dtype)):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
