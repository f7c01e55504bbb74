"""The plain math of every tuned kernel: each function is the paper's formula in a few
lines of NumPy, written to be read and trusted, not to be fast.

Nothing in the library calls this module. The fast kernels (nn/functional.py,
nn/layernorm.py, context_parallel/blockwise_attention.py, optim/adamw.py, optim/grad_norm.py) compute
the same functions in fewer passes over memory, in tiles or chunks, in place; their
docstrings point here, and tests/test_kernels_vs_reference.py holds each of them to
its reference, in float64 to 1e-10 and in float32.

Every function takes whole arrays of any float dtype and returns new ones; the last
axis is the feature (or key) axis.
"""

import math

import numpy as np

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

    The decay is decoupled: it shrinks p itself, never passing through m and v; it
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
