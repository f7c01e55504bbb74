"""Every tuned kernel against its plain reference (numpitron/reference.py).

The kernels work in tiles, chunks and runs, in place, with the bias corrections moved
and the GELU rewritten through sigmoid(2u); the references state each formula once,
over whole arrays. Each test drives a kernel across the boundaries its tuning adds
(tiles, chunks, runs, blocks) and compares in float64 to EQUIV_RTOL_FLOAT64, and in
float32 against the float64 reference of the same float32 inputs to
KERNEL_RTOL_FLOAT32.
"""

import warnings

import numpy as np
import pytest

from numpitron import reference
from numpitron.distributed.topology import Topology
from numpitron.context_parallel.blockwise_attention import AttentionState, attend_block, attend_block_backward, query_tiles
from numpitron.context_parallel.blockwise_attention import visible_keys
from numpitron.nn.functional import TILE_ELEMENTS, bias_gelu_forward, gelu_backward_, softmax_lastdim_with_lse_
from numpitron.nn.layer import FULL_PRECISION
from numpitron.nn.layernorm import LayerNorm
from numpitron.nn.mask_runs import mask_runs
from numpitron.nn.param_store import ParamStore
from numpitron.optim.adamw import AdamW
from numpitron.optim.grad_norm import global_grad_sumsq
from numpitron.context_parallel.zigzag import Chunk
from tests.tolerances import EQUIV_RTOL_FLOAT64, KERNEL_RTOL_FLOAT32, rel_diff

TOLERANCE = {np.float64: EQUIV_RTOL_FLOAT64, np.float32: KERNEL_RTOL_FLOAT32}
DTYPES = [np.float64, np.float32]


def exact(a):
    """a's values (already rounded to its dtype) in float64, for the reference."""
    return np.asarray(a, np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_and_its_slope_equal_the_tanh_formula_across_tiles(dtype):
    # more rows than one tile holds, and both far tails (exp(-2u) overflows below
    # x = -22 in float64, -10 in float32: sig = 0, y = -0)
    rows, cols = 300, 241
    assert rows * cols > TILE_ELEMENTS
    bias = np.random.default_rng(1).normal(size=cols).astype(dtype)
    h = (np.linspace(-30, 8, rows * cols).reshape(rows, cols) - bias).astype(dtype)
    x = exact(h + bias)                                # GELU's input exactly as the kernel forms it
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # the overflow is expected and silenced
        y, slope = bias_gelu_forward(h, bias)
    assert slope is h                                  # the slope is stored over the consumed input
    assert rel_diff(y, reference.gelu(x)) <= TOLERANCE[dtype]
    assert rel_diff(slope, reference.gelu_slope(x)) <= TOLERANCE[dtype]
    assert np.all(np.isfinite(slope)) and np.all(y[x < -23] == 0) and np.all(slope[x < -23] == 0)
    dy = np.random.default_rng(0).normal(size=x.shape).astype(dtype)
    dx = gelu_backward_(dy.copy(), slope)
    assert rel_diff(dx, exact(dy) * reference.gelu_slope(x)) <= TOLERANCE[dtype]


def test_gelu_reference_in_extended_precision():
    """The reference itself, in long double, against the sigmoid form without
    cancellation in the tails: 1 + tanh(u) = 2 / (1 + e^(-2u)), 1 - tanh(u)^2 = 1 / cosh(u)^2."""
    x = np.linspace(-30, 8, 2001).astype(np.longdouble)
    s, a = np.sqrt(np.longdouble(2) / np.pi), np.longdouble(0.044715)
    u = s * (x + a * x ** 3)
    sig = 1 / (1 + np.exp(-2 * u))
    assert rel_diff(reference.gelu(x), x * sig) <= EQUIV_RTOL_FLOAT64
    slope = sig + 0.5 * x * s * (1 + 3 * a * x ** 2) / np.cosh(u) ** 2
    assert rel_diff(reference.gelu_slope(x), slope) <= EQUIV_RTOL_FLOAT64


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_and_its_log_sum_exp_equal_the_formula(dtype):
    scores = (4 * np.random.default_rng(2).normal(size=(2, 3, 5, 33))).astype(dtype)
    scores[..., 1, 20:] = -np.inf                      # a masked row end, as the causal mask leaves
    probs = scores.copy()
    lse = softmax_lastdim_with_lse_(probs)
    assert rel_diff(probs, reference.softmax(exact(scores))) <= TOLERANCE[dtype]
    assert rel_diff(lse, reference.logsumexp(exact(scores))) <= TOLERANCE[dtype]
    assert np.all(probs[..., 1, 20:] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_forward_and_backward_equal_the_formula(dtype):
    rng = np.random.default_rng(3)
    ln = LayerNorm("ln", 48)
    store = ParamStore(ln.parameters(), dtype)
    store.initialize(0)
    store.data += (0.3 * rng.normal(size=store.size)).astype(dtype)    # gains and biases away from 1 and 0
    x = (2 * rng.normal(size=(3, 7, 48)) + 1.5).astype(dtype)
    dy = rng.normal(size=x.shape).astype(dtype)
    y, cache = ln.forward(x)
    dx = ln.backward_input(dy, cache)
    ln.backward_weights(cache)
    w, b = exact(ln.weight.data), exact(ln.bias.data)
    ref_dx, ref_dw, ref_db = reference.layernorm_backward(exact(x), w, exact(dy), eps=ln.eps)
    assert rel_diff(y, reference.layernorm(exact(x), w, b, eps=ln.eps)) <= TOLERANCE[dtype]
    assert rel_diff(dx, ref_dx) <= TOLERANCE[dtype]
    assert rel_diff(ln.weight.grad, ref_dw) <= TOLERANCE[dtype]
    assert rel_diff(ln.bias.grad, ref_db) <= TOLERANCE[dtype]


def blockwise(q, k, v, dout, q_chunks, k_blocks):
    """Output and (dq, dk, dv) of the blockwise kernels, the keys arriving in k_blocks
    ((start, stop) row ranges of k and v, in any order, as around a ring); q unscaled."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    qs = q * scale
    state, groups = AttentionState(qs, FULL_PRECISION), []
    for lo, hi in k_blocks:
        groups.append(attend_block(qs, q_chunks, k[:, :, lo:hi], v[:, :, lo:hi], [Chunk(0, hi - lo, lo)], state))
    d_rowsum = (dout * state.out).sum(-1, keepdims=True)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for (lo, hi), block_groups in zip(k_blocks, groups):
        attend_block_backward(block_groups, qs, k[:, :, lo:hi], v[:, :, lo:hi], dout, d_rowsum, state, dq,
                              dk[:, :, lo:hi], dv[:, :, lo:hi])
    return state.out, (dq * scale, dk, dv)


def check_attention(q, k, v, dout, q_chunks, k_blocks, q_start, dtype):
    out, grads = blockwise(q, k, v, dout, q_chunks, k_blocks)
    args = [exact(a) for a in (q, k, v)]
    assert rel_diff(out, reference.causal_attention(*args, q_start=q_start)) <= TOLERANCE[dtype]
    expected = reference.causal_attention_backward(*args, exact(dout), q_start=q_start)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        assert rel_diff(got, want) <= TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [None, 3])
def test_blockwise_attention_in_tiles_and_blocks_equals_whole_causal_attention(dtype, tile):
    """Twelve positions, keys in three blocks of 4 arriving latest first (as around a
    ring), queries in the same three chunks or in tiles of 3 rows (some tiles see part
    of a block, some none of it): the merged output and every gradient equal
    attention over the whole score matrix."""
    rng = np.random.default_rng(4)
    q, k, v, dout = (rng.normal(size=(2, 3, 12, 4)).astype(dtype) for _ in range(4))
    q_chunks = query_tiles([Chunk(0, 4, 0), Chunk(4, 8, 4), Chunk(8, 12, 8)], tile)
    # a tile of positions 3..5 sees the first two keys of a block at positions 4..7
    assert visible_keys(Chunk(3, 6, 3), [Chunk(0, 4, 4)]) == [Chunk(0, 2, 4)]
    # only the last chunk sees the latest keys (in tiles: the tile before it too, in part)
    latest = attend_block(q, q_chunks, k[:, :, 8:], v[:, :, 8:], [Chunk(0, 4, 8)], AttentionState(q, FULL_PRECISION))
    assert [group.key_end for group in latest] == ([3, 4] if tile else [4])
    check_attention(q, k, v, dout, q_chunks, [(8, 12), (0, 4), (4, 8)], 0, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_of_new_positions_to_a_key_value_cache_equals_the_formula(dtype):
    """Generation: t = 5 new queries at positions 7..11 attend to a cache of 12 keys
    (7 cached, then their own), as one block, in query tiles of 2."""
    rng = np.random.default_rng(5)
    start, t = 7, 5
    q, dout = (rng.normal(size=(2, 3, t, 4)).astype(dtype) for _ in range(2))
    k, v = (rng.normal(size=(2, 3, start + t, 4)).astype(dtype) for _ in range(2))
    check_attention(q, k, v, dout, query_tiles([Chunk(0, t, start)], 2), [(0, start + t)], start, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_adamw_with_decay_runs_equals_the_textbook_step(monkeypatch, dtype):
    """Chunks of 4 against decay runs of every kind: inside one chunk, across two, a
    run of one element, one that ends the buffer; elements outside them never decay,
    and an element with no gradient and no decay never moves. Three steps, so the
    bias corrections change between them."""
    monkeypatch.setattr("numpitron.optim.adamw.CHUNK", 4)
    beta1, beta2, eps, wd = 0.9, 0.95, 1e-3, 0.1           # eps large enough that where it goes matters
    rng = np.random.default_rng(6)
    n = 15
    mask = np.zeros(n)
    for a, b in [(1, 3), (3, 9), (10, 11), (13, 15)]:
        mask[a:b] = 1.0
    p0 = rng.normal(size=n).astype(dtype)
    p, opt = p0.copy(), AdamW(n, dtype, beta1, beta2, eps, wd)
    ref_p, ref_m, ref_v = exact(p0), np.zeros(n), np.zeros(n)
    for t, lr in enumerate((3e-2, 2e-2, 1e-2), start=1):
        g = (rng.normal(size=n) * 1e-2).astype(dtype)
        g[0] = 0.0
        opt.update(p, g, mask_runs(mask), lr)
        ref_p, ref_m, ref_v = reference.adamw_step(ref_p, exact(g), ref_m, ref_v, t, lr, beta1, beta2, eps, wd, mask)
        # float64: the updates themselves agree; float32: where they land (p's own
        # rounding, 6e-8 of |p|, is most of a small update's error)
        moved, ref_moved = (p - p0, ref_p - p0) if dtype == np.float64 else (p, ref_p)
        assert rel_diff(moved, ref_moved) <= TOLERANCE[dtype], t
    assert p[0] == p0[0]
    assert rel_diff(opt.m, ref_m) <= TOLERANCE[dtype] and rel_diff(opt.v, ref_v) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_norm_by_mask_runs_equals_the_masked_sum(dtype):
    rng = np.random.default_rng(7)
    grads = rng.normal(size=50).astype(dtype)
    mask = (rng.random(50) < 0.6).astype(dtype)
    mask[:3], mask[-2:] = 1, 0                     # a run at the start, none at the end
    comm = Topology.serial().model_comm
    got = np.sqrt(global_grad_sumsq(grads, mask_runs(mask), comm))
    assert rel_diff(got, reference.global_grad_norm(exact(grads), exact(mask))) <= TOLERANCE[dtype]
    assert global_grad_sumsq(grads, mask_runs(np.zeros(50, dtype)), comm) == 0.0
