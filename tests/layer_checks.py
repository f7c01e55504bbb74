"""Checks of one layer at a time, outside any trainer: its backward against central
finite differences (every layer goes through check_layer, tests/test_layers.py), the
parameter store and random activation those checks start from, and the rows a MoE
layer sends and receives between two expert-parallel ranks."""

import numpy as np
from mpi4py import MPI

from numpitron.nn.param_store import ParamStore
from tests.tolerances import FD_ATOL, FD_EPS, FD_RTOL


def make_store(params, seed=3, jitter=0.1):
    """Initialise, then move every parameter a little away from its init so that
    LayerNorm gains, biases and zero-initialised tensors give non-trivial gradients."""
    store = ParamStore(params, np.float64)
    store.initialize(seed)
    store.data += jitter * np.random.default_rng(seed + 1).normal(size=store.size)
    return store


def numeric_grad(output, weights, array, indices):
    """Central differences of L = sum(output() * weights) w.r.t. array.flat[indices]
    (perturbed in place). The outputs are differenced before they are weighted and
    summed, so parts of L that do not depend on the entry (a residual stream) add no
    rounding noise."""
    out = np.empty(len(indices))
    for k, i in enumerate(indices):
        old = array.flat[i]
        array.flat[i] = old + FD_EPS
        plus = np.array(output(), dtype=np.float64)
        array.flat[i] = old - FD_EPS
        minus = np.array(output(), dtype=np.float64)
        array.flat[i] = old
        out[k] = np.sum((plus - minus) * weights) / (2 * FD_EPS)
    return out


def assert_fd(name, analytic, output, weights, array, indices=None):
    indices = np.arange(array.size) if indices is None else indices
    numeric = numeric_grad(output, weights, array, indices)
    np.testing.assert_allclose(np.asarray(analytic).flat[indices], numeric,
                               rtol=FD_RTOL, atol=FD_ATOL, err_msg=name)
    assert np.any(numeric != 0), f"{name}: finite differences are all zero, the check is vacuous"


def check_layer(layer, x, params=None, seed=0, **context):
    """Both halves of the backward against finite differences, and `backward` equal
    to them bit for bit. x: the input (float: its gradient is checked too; integer
    token ids: no gradient)."""
    params = layer.parameters() if params is None else params
    store = make_store(params, seed=seed + 10)
    differentiable = np.issubdtype(x.dtype, np.floating)

    def output():
        return layer.forward(x.copy(), **context)[0]

    R = np.random.default_rng(seed).normal(size=np.shape(output()))
    store.zero_grad()
    cache = layer.forward(x.copy(), **context)[1]
    dx = layer.backward_input(R.copy(), cache)
    assert not np.any(store.grad), "backward_input must leave the weight gradients alone"
    layer.backward_weights(cache)
    grads = store.grad.copy()
    store.zero_grad()
    dx_both = layer.backward(R.copy(), layer.forward(x.copy(), **context)[1])
    assert np.array_equal(store.grad, grads), "backward must equal backward_input + backward_weights"
    if differentiable:
        assert dx.shape == x.shape and np.array_equal(dx, dx_both)
        assert_fd("dx", dx, output, R, x)
    else:
        assert dx is None and dx_both is None
    for p in params:
        assert_fd(p.name, store.view(grads, p.name), output, R, p.data)


def moe_layer_traffic(layer, x, dy, num_experts: int):
    """One forward and backward of a MoE layer on two ep ranks (ep rank = world rank):
    (rows this rank sends to the other rank's experts, rows it receives from it, as the
    router's kept choices imply; the routing; the layer's counted collectives)."""
    routing = layer.router.forward(x)[0]
    kept_per_expert = np.bincount(routing.chosen[routing.kept], minlength=num_experts)
    everyone = np.array(MPI.COMM_WORLD.allgather(kept_per_expert))     # (rank, expert)
    rank, half = MPI.COMM_WORLD.Get_rank(), num_experts // 2
    mine, other = slice(half * rank, half * rank + half), slice(half - half * rank, 2 * half - half * rank)
    sent, received = everyone[rank, other].sum(), everyone[1 - rank, mine].sum()
    stats = layer.dispatcher.ep.stats
    stats.reset()
    layer.backward(dy, layer.forward(x)[1])
    return sent, received, routing, stats.snapshot()


def rand_x(shape=(2, 5, 8), seed=1):
    """A float64 activation, (B, T, C) = (2, 5, 8) unless told."""
    return np.random.default_rng(seed).normal(size=shape)
