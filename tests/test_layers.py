"""Every layer's backward against central finite differences (serial, float64).

Every layer is driven the same way, through the one layer contract: for
y, cache = layer.forward(x, **context) and the scalar L = sum(y * R), R random and
fixed, dL/dy = R. `backward_input(R, cache)` must give dL/dx and leave every weight
gradient untouched; `backward_weights(cache)` must then accumulate dL/dparam; and
`backward` must do exactly both. Each entry is compared with
(L(a + eps) - L(a - eps)) / (2 eps) for that entry.
"""

import numpy as np
import pytest

from numpitron.config import ModelConfig
from numpitron.distributed.topology import Topology
from numpitron.build import build_stage
from numpitron.context_parallel import blockwise_attention
from numpitron.transformer.activation_memory import attention_area, block_activation_bytes
from numpitron.transformer.attention import ParallelAttention
from numpitron.transformer.block import Block
from numpitron.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from numpitron.nn.embedding import Embeddings, PositionEmbedding
from numpitron.tensor_parallel.vocab_parallel import TiedLMHead, VocabParallelEmbedding, VocabShard
from numpitron.nn.functional import bias_gelu_forward, gelu_backward_
from numpitron.transformer.head import LanguageModelHead
from numpitron.nn.cache_bytes import cache_nbytes
from numpitron.nn.layernorm import LayerNorm
from numpitron.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from numpitron.transformer.mlp import ParallelMLP
from numpitron.nn.recompute import Recomputed
from tests.layer_checks import assert_fd, check_layer, make_store, rand_x
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

B, T, C, H = 2, 5, 8, 2          # (B, T, C): the shape rand_x draws unless told
V = 11
SERIAL = Topology.serial()


def token_ids(seed=2):
    ids = np.random.default_rng(seed).integers(0, V, (B, T))
    ids[0, :3] = ids[1, 0]                # repeated ids: their gradients must add up
    return ids


def test_layernorm_backward_matches_finite_differences():
    check_layer(LayerNorm("ln", C), rand_x())


def test_column_parallel_linear_groups_1_and_3():
    for groups in (1, 3):
        lin = ColumnParallelLinear(f"col{groups}", C, 6, SERIAL, groups=groups)
        check_layer(lin, rand_x(), seed=groups)
        y = lin.forward(rand_x())[0]
        assert y.shape == (B, T, 6 * groups)
        # group g's block of outputs is x @ W[:, g, :] + b[g]
        w, b = lin.weight.data.reshape(C, groups, 6), lin.bias.data.reshape(groups, 6)
        expected = np.concatenate([rand_x() @ w[:, g] + b[g] for g in range(groups)], axis=-1)
        assert rel_diff(y, expected) <= EQUIV_RTOL_FLOAT64


def test_row_parallel_linear_backward_matches_finite_differences():
    check_layer(RowParallelLinear("row", 12, C, SERIAL), rand_x((B, T, 12)))


def test_mlp_backward_matches_finite_differences():
    check_layer(ParallelMLP("mlp", C, SERIAL, out_std=0.3), rand_x())


def test_attention_backward_matches_finite_differences():
    check_layer(ParallelAttention("attn", C, H, SERIAL, out_std=0.3), rand_x())


def test_attention_is_causal():
    attn = ParallelAttention("attn", C, H, SERIAL, out_std=0.3)
    make_store(attn.parameters())
    x = rand_x()
    y = attn.forward(x.copy())[0]
    for t in range(T - 1):
        changed = x.copy()
        changed[:, t + 1:] += np.random.default_rng(t).normal(size=changed[:, t + 1:].shape)
        y2 = attn.forward(changed)[0]
        assert np.array_equal(y2[:, :t + 1], y[:, :t + 1]), f"position <= {t} saw the future"
        assert not np.allclose(y2[:, t + 1:], y[:, t + 1:]), "later positions must see the change"


def test_block_backward_matches_finite_differences():
    check_layer(Block("blocks.0", C, H, 2, SERIAL), rand_x())


@pytest.mark.parametrize("tile", [1, 2])
def test_attention_in_query_tiles_skips_the_future_and_keeps_what_the_formula_says(monkeypatch, tile):
    # Chunks of 2 and 3 rows cut into tiles of `tile` rows: gradients still exact (with
    # the probabilities kept or recomputed), and the block keeps the bytes it should.
    monkeypatch.setattr(blockwise_attention, "QUERY_TILE", tile)
    check_layer(ParallelAttention("attn", C, H, SERIAL, out_std=0.3), rand_x())
    check_layer(ParallelAttention("attn", C, H, SERIAL, out_std=0.3, keep_probs=False), rand_x())
    block = Block("blocks.0", C, H, 2, SERIAL)
    make_store(block.parameters())
    cache = block.forward(rand_x())[1]
    # T = 5 is chunks [0, 2) and [2, 5); each tile sees the keys up to its last query
    ends = {1: [1, 2, 3, 4, 5], 2: [2, 4, 5]}[tile]
    assert [group.key_end for group in cache["attn"]["groups"][0]] == ends
    assert attention_area(T) == {1: 15, 2: 2 * 2 + 2 * 4 + 1 * 5}[tile] < T * T
    assert cache_nbytes(cache) == block_activation_bytes(B, T, C, H, itemsize=8)


def test_recomputed_block_and_attention_without_kept_probabilities():
    check_layer(Recomputed(Block("blocks.0", C, H, 2, SERIAL)), rand_x())
    check_layer(ParallelAttention("attn", C, H, SERIAL, out_std=0.3, keep_probs=False), rand_x())


def test_embeddings_backward_matches_finite_differences_with_positions_out_of_order():
    token = VocabParallelEmbedding("tok", V, C, SERIAL)
    check_layer(token, token_ids())
    pos = PositionEmbedding("pos", T + 3, C)  # longer table than T: unused rows get no grad
    scattered = np.array([4, 0, 1, 7, 2])     # positions need not be in order (context parallelism)
    check_layer(pos, token_ids(), positions=scattered)
    assert np.all(pos.weight.grad[[3, 5, 6]] == 0)
    check_layer(Embeddings(VocabParallelEmbedding("tok", V, C, SERIAL), PositionEmbedding("pos", T, C), np.arange(T)),
                token_ids())


def test_tied_head_backward_matches_finite_differences():
    emb = VocabParallelEmbedding("tok", V, C, SERIAL)
    check_layer(TiedLMHead(emb), rand_x(), params=emb.parameters())


def test_head_and_loss_backward_matches_finite_differences():
    emb = VocabParallelEmbedding("tok", V, C, SERIAL)
    head = LanguageModelHead(emb, C, SERIAL)
    targets = token_ids(seed=4)
    check_layer(head, rand_x(), params=emb.parameters() + head.parameters(), targets=targets)


def test_cross_entropy_gradient_matches_finite_differences():
    ce = VocabParallelCrossEntropy(VocabShard(V, 1, 0), SERIAL)
    logits = rand_x((B, T, V)) * 2
    targets = np.random.default_rng(5).integers(0, V, (B, T))
    dloss = 1.7
    loss = lambda: ce.forward(logits.copy(), targets)[0]             # noqa: E731
    dlogits = ce.backward(dloss, ce.forward(logits.copy(), targets)[1])
    assert_fd("dlogits", dlogits, loss, dloss, logits)


def test_cross_entropy_equals_minus_log_softmax():
    ce = VocabParallelCrossEntropy(VocabShard(V, 1, 0), SERIAL)
    logits = rand_x((B * T, V)) * 3
    targets = np.random.default_rng(6).integers(0, V, B * T)
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    expected = -np.mean(np.log(probs[np.arange(B * T), targets]))
    loss, _ = ce.forward(logits.copy(), targets)
    assert rel_diff(loss, expected) <= EQUIV_RTOL_FLOAT64


def test_bias_gelu_backward_by_finite_differences():
    # the kernel against the formula, across tiles and in both tails: test_kernels_vs_reference.py
    h, zero = np.linspace(-3, 3, 61)[None, :], np.zeros(61)
    dy = np.random.default_rng(0).normal(size=h.shape)
    slope = bias_gelu_forward(h.copy(), zero)[1]
    assert_fd("gelu", gelu_backward_(dy.copy(), slope), lambda: bias_gelu_forward(h.copy(), zero)[0], dy, h)


def tiny_stage():
    cfg = ModelConfig(vocab_size=V, seq_len=T, n_layers=2, n_heads=H, d_model=C, dtype="float64").validate()
    model = build_stage(cfg, SERIAL, seed=4)
    rng = np.random.default_rng(9)
    model.store.data += 0.1 * rng.normal(size=model.store.size)
    tokens, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    return model, tokens, targets


def test_gpt_stage_loss_gradient_on_random_parameter_subset():
    model, tokens, targets = tiny_stage()
    loss = lambda: model.forward(tokens, targets)[0]                # noqa: E731
    model.store.zero_grad()
    _, cache = model.forward(tokens, targets)
    assert model.backward(1.0, cache) is None
    subset = np.random.default_rng(1).choice(model.store.numel, 200, replace=False)
    assert_fd("gpt", model.store.grad.copy(), loss, 1.0, model.store.data, subset)
    # the two halves, run a whole stage apart (as a zero-bubble schedule would), give
    # the same gradients bit for bit
    both = model.store.grad.copy()
    model.store.zero_grad()
    _, cache = model.forward(tokens, targets)
    assert model.backward_input(1.0, cache) is None and not np.any(model.store.grad)
    model.backward_weights(cache)
    assert np.array_equal(model.store.grad, both)
    # every kind of parameter must carry gradient (LN gains, biases, embeddings)
    assert all(np.any(p.grad != 0) for p in model.parameters()), [p.name for p in model.parameters() if not np.any(p.grad)]


def test_gradients_accumulate():
    # Each block parameter gets one contribution per backward: g + g == 2 g exactly.
    block = Block("blocks.0", C, H, 2, SERIAL)
    store = make_store(block.parameters())
    dy = rand_x(seed=7)
    block.backward(dy, block.forward(rand_x())[1])
    once = store.grad.copy()
    # Every gradient is nonzero but the key bias's: softmax ignores a constant added to
    # a row of scores, so that gradient is zero up to rounding, and may round to 0.
    for p in block.parameters():
        assert np.all((p.grad[[0, 2]] if p.name.endswith("qkv.bias") else p.grad) != 0), p.name
    block.backward(dy, block.forward(rand_x())[1])
    assert np.array_equal(store.grad, 2 * once)
    # The whole stage: the tied embedding sums two contributions (embedding and head),
    # so (E + H) + H + E == 2 (E + H) only up to rounding.
    model, tokens, targets = tiny_stage()
    model.store.zero_grad()
    model.backward(1.0, model.forward(tokens, targets)[1])
    once = model.store.grad.copy()
    model.backward(1.0, model.forward(tokens, targets)[1])
    assert np.any(once != 0)
    assert rel_diff(model.store.grad, 2 * once) <= EQUIV_RTOL_FLOAT64
    model.store.zero_grad()
    assert not np.any(model.store.grad) and all(not np.any(p.grad) for p in model.parameters())
