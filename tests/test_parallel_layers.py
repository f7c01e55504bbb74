"""Every tensor-parallel layer on tp = world against its serial twin (float64).

Both twins carry the same parameter names and are initialised from the same seed,
then moved away from init by the same full-shape jitter (so zero-initialised biases
matter); each rank keeps its tp slice. Outputs, input gradients and the parameter
gradients gathered over tp must equal the serial ones. Every rank computes every
figure, the figures are all-gathered, and every rank asserts the same thing, so a
failure never leaves ranks waiting in a collective.
"""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.config import ModelConfig
from numpitron.distributed.gather import gather_full
from numpitron.distributed.topology import Topology
from numpitron.build import build_stage
from numpitron.transformer.attention import ParallelAttention
from numpitron.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from numpitron.tensor_parallel.vocab_parallel import TiedLMHead, VocabParallelEmbedding
from numpitron.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from numpitron.transformer.mlp import ParallelMLP
from numpitron.nn.param import pad_to_full
from numpitron.nn.param_store import ParamStore
from tests.harness import assert_close_on_every_rank, assert_on_every_rank, gathered
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

B, T, C, H, V = 2, 5, 8, 4, 65      # vocab 65 pads to 66 (tp=2) and 68 (tp=4)
N = B * T
SEED = 11


def build(factory, topo):
    """factory(topo) -> (layer, params); initialise from SEED, then add a jitter drawn
    in full logical shape (identical for every mesh) and keep this rank's slice."""
    layer, params = factory(topo)
    store = ParamStore(params, np.float64, topo.tp_rank)
    store.initialize(SEED)
    for k, p in enumerate(params):
        jitter = np.random.default_rng([SEED, k]).normal(0, 0.1, p.logical_shape)
        p.data += pad_to_full(jitter, p.full_shape)[p.tp_slice()]
    return layer, params


def gather_tp(local, axis, topo):
    """The full tensor: every tp rank's slice concatenated along `axis`."""
    if axis is None:
        return local
    return np.concatenate(gathered(topo.tp_comm, np.ascontiguousarray(local)), axis=axis)


def grad_diffs(params, serial_params, topo):
    """rel_diff of every gathered gradient against the serial one; the padding rows of a
    padded tensor must receive exactly zero gradient (reported as a diff of 1 if not)."""
    diffs = {}
    for p, s in zip(params, serial_params):
        full = gather_tp(p.grad, p.split_axis, topo)
        real = tuple(slice(0, n) for n in p.logical_shape)
        padding = full.copy()
        padding[real] = 0
        diffs[p.name] = rel_diff(full[real], s.grad) + float(np.any(padding != 0))
    return diffs


def agree_and_assert(diffs, flags=None):
    """All ranks learn all figures, then all assert the same thing."""
    assert_on_every_rank(flags or {})
    assert_close_on_every_rank(diffs, EQUIV_RTOL_FLOAT64)


def cols(topo, n):
    """This rank's [lo, hi) of an output dimension n split over tp."""
    return n // topo.tp * topo.tp_rank, n // topo.tp * (topo.tp_rank + 1)


def data(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape)


@pytest.mark.parallel(nprocs=[2, 4])
def test_column_and_row_parallel_linear():
    topo, serial = Topology.from_world(tensor=MPI.COMM_WORLD.Get_size()), Topology.serial()
    diffs = {}
    x = data(N, C, seed=1)
    for groups in (1, 3):
        def factory(t):
            lin = ColumnParallelLinear(f"col{groups}", C, 8, t, groups=groups)
            return lin, lin.parameters()
        (lin, params), (ref, ref_params) = build(factory, topo), build(factory, serial)
        lo, hi = cols(topo, 8)
        y_ref, cache_ref = ref.forward(x.copy())
        dy_full = data(N, groups, 8, seed=2)
        dx_ref = ref.backward(dy_full.reshape(N, -1), cache_ref)
        y, cache = lin.forward(x.copy())
        dx = lin.backward(np.ascontiguousarray(dy_full[:, :, lo:hi].reshape(N, -1)), cache)
        diffs[f"col{groups}.y"] = rel_diff(y, y_ref.reshape(N, groups, 8)[:, :, lo:hi].reshape(N, -1))
        diffs[f"col{groups}.dx"] = rel_diff(dx, dx_ref)
        diffs.update(grad_diffs(params, ref_params, topo))

    def row_factory(t):
        lin = RowParallelLinear("row", 16, C, t)
        return lin, lin.parameters()
    (lin, params), (ref, ref_params) = build(row_factory, topo), build(row_factory, serial)
    lo, hi = cols(topo, 16)
    x, dy = data(N, 16, seed=3), data(N, C, seed=4)
    y_ref, cache_ref = ref.forward(x.copy())
    dx_ref = ref.backward(dy.copy(), cache_ref)
    y, cache = lin.forward(x[:, lo:hi].copy())
    dx = lin.backward(dy.copy(), cache)
    diffs.update({"row.y": rel_diff(y, y_ref), "row.dx": rel_diff(dx, dx_ref[:, lo:hi])})
    diffs.update(grad_diffs(params, ref_params, topo))
    agree_and_assert(diffs)


@pytest.mark.parallel(nprocs=[2, 4])
def test_attention_and_mlp_on_tp_ranks_match_their_serial_twins():
    topo, serial = Topology.from_world(tensor=MPI.COMM_WORLD.Get_size()), Topology.serial()
    diffs = {}
    factories = {
        "attn": lambda t: (lambda a: (a, a.parameters()))(ParallelAttention("attn", C, H, t, out_std=0.3)),
        "mlp": lambda t: (lambda m: (m, m.parameters()))(ParallelMLP("mlp", C, t, out_std=0.3)),
    }
    for name, factory in factories.items():
        (layer, params), (ref, ref_params) = build(factory, topo), build(factory, serial)
        x, dy = data(B, T, C, seed=5), data(B, T, C, seed=6)      # one contract: (B, T, C) in and out
        y_ref, cache_ref = ref.forward(x.copy())
        dx_ref = ref.backward(dy.copy(), cache_ref)
        y, cache = layer.forward(x.copy())
        dx = layer.backward(dy.copy(), cache)
        diffs.update({f"{name}.y": rel_diff(y, y_ref), f"{name}.dx": rel_diff(dx, dx_ref)})
        diffs.update(grad_diffs(params, ref_params, topo))
    agree_and_assert(diffs)


@pytest.mark.parallel(nprocs=[2, 4])
def test_vocab_embedding_tied_head_and_cross_entropy_with_padding():
    topo, serial = Topology.from_world(tensor=MPI.COMM_WORLD.Get_size()), Topology.serial()

    def factory(t):
        emb = VocabParallelEmbedding("tok", V, C, t)
        return emb, emb.parameters()
    (emb, params), (ref, ref_params) = build(factory, topo), build(factory, serial)
    head, ref_head = TiedLMHead(emb), TiedLMHead(ref)
    ce = VocabParallelCrossEntropy(emb.shard, topo)
    ref_ce = VocabParallelCrossEntropy(ref.shard, serial)
    rng = np.random.default_rng(7)
    idx, targets = rng.integers(0, V, N), rng.integers(0, V, N)
    idx[:2], targets[:2] = V - 1, V - 1                 # the last real row, beside the padding
    h, dx = data(N, C, seed=8), data(N, C, seed=9)

    x_ref, emb_cache_ref = ref.forward(idx)
    logits_ref, head_cache_ref = ref_head.forward(h.copy())
    loss_ref, ce_cache_ref = ref_ce.forward(logits_ref.copy(), targets)
    dlogits_ref = ref_ce.backward(1.0, ce_cache_ref)
    dh_ref = ref_head.backward(dlogits_ref.copy(), head_cache_ref)
    ref.backward(dx.copy(), emb_cache_ref)

    x, emb_cache = emb.forward(idx)
    logits, head_cache = head.forward(h.copy())
    start, local = emb.shard.start, logits.shape[1]
    real = np.arange(start, start + local) < V           # this rank's columns that are real
    masked = emb.shard.mask_padding(logits.copy())
    loss, ce_cache = ce.forward(logits.copy(), targets)
    dlogits = ce.backward(1.0, ce_cache)
    dh = head.backward(dlogits.copy(), head_cache)
    emb.backward(dx.copy(), emb_cache)

    ref_cols = logits_ref[:, start:start + local][:, :real.sum()]
    diffs = {"embedding.y": rel_diff(x, x_ref), "logits": rel_diff(logits[:, real], ref_cols),
             "loss": rel_diff(loss, loss_ref), "dh": rel_diff(dh, dh_ref),
             "dlogits": rel_diff(dlogits[:, real], dlogits_ref[:, start:start + local][:, :real.sum()])}
    diffs.update(grad_diffs(params, ref_params, topo))
    flags = {"padded logits are -inf": bool(np.all(masked[:, ~real] == -np.inf)),
             "real logits untouched": bool(np.array_equal(masked[:, real], logits[:, real])),
             "padded columns get no gradient": bool(np.all(dlogits[:, ~real] == 0)),
             "local vocab": local * topo.tp == -(-V // topo.tp) * topo.tp}
    pads = MPI.COMM_WORLD.allgather(int((~real).sum()))
    flags["padding count"] = sum(pads) == -(-V // topo.tp) * topo.tp - V
    agree_and_assert(diffs, flags)


def tiny_cfg():
    return ModelConfig(vocab_size=V, seq_len=8, n_layers=2, n_heads=H, d_model=C, dtype="float64").validate()


@pytest.mark.parallel(nprocs=[2, 4])
def test_gpt_stage_init_and_replicated_grads():
    topo = Topology.from_world(tensor=MPI.COMM_WORLD.Get_size())
    model, ref = build_stage(tiny_cfg(), topo, seed=3), build_stage(tiny_cfg(), Topology.serial(), seed=3)
    init = gather_full(model, topo, {"params": model.store.data})
    rng = np.random.default_rng(4)
    tokens, targets = rng.integers(0, V, (2, 8)), rng.integers(0, V, (2, 8))
    for m in (model, ref):
        m.store.zero_grad()
        m.backward(1.0, m.forward(tokens, targets)[1])
    grads = gather_full(model, topo, {"grad": model.store.grad})
    flags, diffs = {}, {}
    if topo.rank == 0:
        flags["same names"] = init["params"].keys() == {p.name for p in ref.parameters()}
        for p in ref.parameters():
            flags[f"init {p.name}"] = np.array_equal(init["params"][p.name], p.data)
            diffs[p.name] = rel_diff(grads["grad"][p.name], p.grad)
    diffs = MPI.COMM_WORLD.bcast(diffs, root=0)
    # Replicated tensors (LayerNorms, row-parallel biases, positions) must get
    # bit-identical gradients on every tp rank: no rank may drift from the others.
    replicated = [p for p in model.parameters() if p.split_axis is None]
    assert {p.name.split(".")[-2] for p in replicated} >= {"ln1", "ln2", "proj", "position"}
    for p in replicated:
        copies = gathered(topo.tp_comm, p.grad)
        flags[f"identical {p.name}"] = all(np.array_equal(c, copies[0]) for c in copies)
        flags[f"nonzero {p.name}"] = bool(np.any(p.grad != 0))
    agree_and_assert(diffs, flags)
