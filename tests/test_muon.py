"""Muon's math on one process: the Newton-Schulz iteration, the update rule against its
formula written out, which parameters it takes, its state, and the one-line errors."""

import math

import numpy as np
import pytest

from numpitron.config import TrainConfig
from numpitron.errors import UserError
from numpitron.nn.param import Param
from numpitron.nn.param_store import ParamStore
from numpitron.optim.adamw import AdamW
from numpitron.muon.muon import (Muon, is_hidden_matrix, local_orthogonalise, matrix_pieces, newton_schulz,
                                  update_scale)
from numpitron.muon.owners import balanced_owners
from tests.harness import SMALLER, error_lines, make_trainer, tiny_model, tiny_train, train_script


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32)])
def test_newton_schulz_keeps_the_singular_vectors_and_maps_the_values_near_one(shape):
    G = np.random.default_rng(0).normal(size=shape)
    U, S, Vt = np.linalg.svd(G, full_matrices=False)
    O = newton_schulz(G)
    core = U.T @ O @ Vt.T                          # diagonal iff O = U f(S) V^T
    off = core - np.diag(np.diag(core))
    assert np.max(np.abs(off)) < 1e-12
    # Five quintic steps leave the singular values in about [0.7, 1.2], not at 1 (Jordan et al.).
    assert 0.6 < np.diag(core).min() and np.diag(core).max() < 1.25
    # A tall matrix is iterated as its transpose (a square one as it is: equal to rounding).
    transposed = newton_schulz(G.T)
    assert np.array_equal(transposed, O.T) if shape[0] != shape[1] else np.max(np.abs(transposed - O.T)) < 1e-12


def test_newton_schulz_in_float32_follows_float64():
    G = np.random.default_rng(1).normal(size=(32, 96))
    O32 = newton_schulz(G.astype(np.float32))
    assert O32.dtype == np.float32
    assert np.max(np.abs(O32 - newton_schulz(G))) < 1e-4


def store_of(*params):
    store = ParamStore(list(params), np.float64)
    store.initialize(3)
    return store


def muon_cfg(**overrides) -> TrainConfig:
    return TrainConfig(**{**dict(lr=0.02, weight_decay=0.1, optimizer="muon", muon_momentum=0.9), **overrides})


def test_one_step_is_the_formula_written_out():
    """Two steps on a matrix and a bias: Muon's formula on the matrix, AdamW on the bias."""
    store = store_of(Param("blocks.0.mlp.fc.weight", (8, 24)),
                     Param("blocks.0.mlp.fc.bias", (24,), decay=False))
    cfg = muon_cfg()
    rule = Muon(store, 0, store.size, cfg, matrix_pieces(store, 0, store.size),
                local_orthogonalise(matrix_pieces(store, 0, store.size)))
    W, b = store.data[:192].reshape(8, 24).copy(), store.data[192:].copy()
    adam, M = AdamW(24, np.float64, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay), np.zeros((8, 24))
    rng = np.random.default_rng(2)
    for lr in (0.02, 0.01):
        grads = rng.normal(size=store.size)
        rule.update(store.data, grads, store.decay_runs, lr)
        G = grads[:192].reshape(8, 24)
        M = 0.9 * M + 0.1 * G
        W = W * (1 - lr * 0.1) - lr * 0.2 * math.sqrt(24) * newton_schulz(0.1 * G + 0.9 * M)
        adam.update(b, grads[192:], [], lr)
        assert np.max(np.abs(store.data[:192] - W.reshape(-1))) < 1e-14
        assert np.array_equal(store.data[192:], b)
    assert rule.step_count == 2
    # One moment for the matrix's 192 elements, two for the bias's 24.
    assert rule.state_nbytes == (192 + 2 * 24) * 8
    state = rule.flat_state()
    assert np.max(np.abs(state["muon_m"][:192] - M.reshape(-1))) < 1e-15
    assert not state["muon_m"][192:].any() and not state["adam_m"][:192].any()


def test_muon_takes_the_blocks_weights_and_leaves_embeddings_biases_and_gains_to_adamw():
    trainer = make_trainer(tiny_model(**SMALLER), tiny_train(optimizer="muon"))
    muon = sorted(p.name for p in trainer.model.parameters() if is_hidden_matrix(p))
    assert muon == sorted(f"blocks.{i}.{w}.weight" for i in range(2) for w in ("attn.qkv", "attn.proj", "mlp.fc",
                                                                               "mlp.proj"))
    # The fused q|k|v weight (in, 3, out) is one (in, 3 out) matrix, as the layer multiplies it.
    qkv = next(p for p in trainer.optimizer.adam.pieces if p.param.name == "blocks.0.attn.qkv.weight")
    assert qkv.shape == (32, 96) and update_scale(qkv.shape) == 0.2 * math.sqrt(96)


def test_a_hidden_parameter_that_is_no_matrix_is_one_clear_error():
    store = store_of(Param("blocks.0.mlp.scale", (8,)))         # decayed, in a block, but 1-D
    with pytest.raises(UserError, match="orthogonalises matrices, but blocks.0.mlp.scale has shape"):
        matrix_pieces(store, 0, store.size)


def test_owners_are_balanced_by_size_largest_first():
    assert balanced_owners([10, 40, 30, 20], 2) == [0, 0, 1, 1]       # 40 + 10 and 30 + 20
    assert balanced_owners([5, 5, 5], 4) == [0, 1, 2]
    assert balanced_owners([7], 1) == [0]


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "lion"], "invalid choice: 'lion'"),
    (["--optimizer", "muon", "--muon-momentum", "1"], "muon-momentum must lie in [0, 1)"),
    (["--optimizer", "muon", "--muon-lr", "-1"], "muon-lr must not be negative"),
])
def test_bad_muon_flags_are_one_line(flags, message, data_dir, tmp_path):
    result = train_script(data_dir, tmp_path / "out", "--max-iters", "2", *flags)
    assert result.returncode != 0
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and message in lines[0], result.stderr
