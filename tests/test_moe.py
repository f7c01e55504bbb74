"""The mixture-of-experts layer on one process: every backward against finite
differences (the experts, the router through the gates, the load-balancing loss), the
routing rules (top-k without renormalising, per-sequence capacity in position order,
dropped tokens giving zero), and the one-line errors for bad settings."""

import numpy as np
import pytest

from numpitron.config import ModelConfig, ParallelConfig
from numpitron.layout import check_layout
from numpitron.distributed.topology import Mesh, Topology
from numpitron.errors import UserError
from numpitron.experts.local_experts import LocalExperts
from numpitron.experts.moe import MixtureOfExperts
from numpitron.experts.router import TopKRouter, capacity
from numpitron.pipeline_parallel.executor import forward_only
from tests.harness import make_trainer, tiny_model, tiny_tokens, tiny_train
from tests.layer_checks import assert_fd, check_layer, make_store, rand_x
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

SERIAL = Topology.serial()
B, T, C, E = 2, 8, 8, 4


def moe(top_k=2, capacity_factor=0.0, aux_loss_coef=0.0, loss_weight=1.0, num_experts=E):
    return MixtureOfExperts("mlp", C, SERIAL, out_std=0.3, num_experts=num_experts, top_k=top_k,
                            capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef, loss_weight=loss_weight)


def test_local_experts_backward_and_an_empty_expert():
    experts = LocalExperts("experts", C, range(2, 5), SERIAL, out_std=0.3)
    check_layer(experts, rand_x((7, C)), counts=np.array([3, 1, 3]))
    assert [p.name for p in experts.parameters()][4] == "experts.3.fc.weight"      # global indices
    # an expert no token chose: no rows, no gradient, the others unchanged
    store = make_store(experts.parameters())
    y, cache = experts.forward(rand_x((7, C)), np.array([3, 0, 4]))
    experts.backward(rand_x((7, C), seed=3), cache)
    assert not np.any(store.view(store.grad, "experts.3.fc.weight")) and np.any(store.grad)


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 0.0), (2, 0.0), (2, 0.5)])
def test_moe_layer_backward_through_router_and_experts(top_k, capacity_factor):
    layer = moe(top_k, capacity_factor)
    check_layer(layer, rand_x((B, T, C)), seed=top_k)
    routing = layer.router.forward(rand_x((B, T, C)))[0]
    assert np.any(~routing.kept) == (capacity_factor > 0)       # the dropping case does drop


def test_aux_loss_gradient_enters_with_the_loss_weight():
    """L = sum(y * R) + w * aux: the router's gradient (dx and W_r) includes the aux
    loss's, scaled by the micro-batch's loss weight w."""
    w = 0.25
    layer = moe(top_k=2, capacity_factor=0.75, aux_loss_coef=0.3, loss_weight=w)
    store = make_store(layer.parameters(), seed=5)
    x = rand_x((B, T, C), seed=6)
    R = np.random.default_rng(7).normal(size=x.shape)

    def output():
        y, cache = layer.forward(x.copy())
        return np.append(y.ravel(), cache["routing"].aux_loss)
    weights = np.append(R.ravel(), w)
    store.zero_grad()
    dx = layer.backward(R.copy(), layer.forward(x.copy())[1])
    assert_fd("dx", dx, output, weights, x)
    router = layer.router.weight
    assert_fd("router", store.view(store.grad, router.name), output, weights, router.data)
    # and the aux loss really contributes: without it the router's gradient differs
    plain = moe(top_k=2, capacity_factor=0.75, aux_loss_coef=0.0)
    make_store(plain.parameters(), seed=5)
    plain.backward(R.copy(), plain.forward(x.copy())[1])
    assert not np.allclose(plain.router.weight.grad, router.grad)


def test_gates_are_the_chosen_probabilities_not_renormalised():
    router = TopKRouter("r", C, E, 2, 0.0, 0.01)
    make_store(router.parameters())
    x = rand_x((B, T, C))
    routing = router.forward(x)[0]
    logits = x.reshape(-1, C) @ router.weight.data
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    top = np.sort(probs, axis=1)[:, ::-1][:, :2]
    assert rel_diff(routing.gates, top) <= EQUIV_RTOL_FLOAT64
    assert np.all(routing.gates.sum(axis=1) < 1)


def test_uniform_router_gives_aux_loss_alpha():
    # Equal probabilities: whatever is chosen, E * sum_i f_i P_i = E * (1/E) = 1.
    router = TopKRouter("r", C, E, 2, 0.0, 0.37)
    make_store(router.parameters(), jitter=0.0)
    router.weight.data[...] = 0
    assert rel_diff(router.forward(rand_x((B, T, C)))[0].aux_loss, 0.37) <= EQUIV_RTOL_FLOAT64


def test_capacity_keeps_the_first_tokens_of_each_sequence_and_drops_to_zero():
    """Every token prefers expert 0; capacity ceil(1 * 1 * 8 / 4) = 2 per sequence: the
    first two positions of each sequence are kept, the rest get y = 0 (residual only)."""
    assert capacity(1.0, 1, T, E) == 2 and capacity(0.0, 1, T, E) == 0
    layer = moe(top_k=1, capacity_factor=1.0)
    make_store(layer.parameters())
    layer.router.weight.data[...] = 0
    layer.router.weight.data[:, 0] = 1.0
    x = np.abs(rand_x((B, T, C))) + 0.1                      # logit of expert 0 is sum(x) > 0
    y, cache = layer.forward(x)
    kept = cache["routing"].kept.reshape(B, T)
    assert np.array_equal(kept, np.arange(T)[None, :].repeat(B, 0) < 2)
    assert np.all(y[:, 2:] == 0) and np.all(y[:, :2] != 0)
    assert rel_diff(np.count_nonzero(~kept) / kept.size, 0.75) == 0


def test_dropping_is_causal():
    """Changing later tokens never changes an earlier token's output, drops included."""
    layer = moe(top_k=2, capacity_factor=0.5)
    make_store(layer.parameters())
    x = rand_x((B, T, C))
    y, cache = layer.forward(x.copy())
    assert np.any(~cache["routing"].kept)
    for t in range(T - 1):
        changed = x.copy()
        changed[:, t + 1:] = rand_x((B, T - t - 1, C), seed=t + 20)
        assert np.array_equal(layer.forward(changed)[0][:, :t + 1], y[:, :t + 1]), t


def test_moe_every_keeps_some_blocks_dense_and_training_logs_routing():
    cfg = tiny_model(num_experts=4, moe_top_k=1, moe_every=2, moe_capacity_factor=1.0)
    trainer = make_trainer(cfg, tiny_train(), SERIAL)
    kinds = [type(b.mlp).__name__ for b in trainer.model.blocks]
    assert kinds == ["MixtureOfExperts", "ParallelMLP", "MixtureOfExperts", "ParallelMLP"]
    # the cross-entropy of the batch the step will train on, before it changes anything
    ce = np.mean(forward_only(trainer.model, SERIAL, trainer.microbatches(tiny_tokens(), "train", 0)))
    step = trainer.train_step(tiny_tokens())
    counts = np.array(step["moe_tokens_per_expert"])
    # two MoE blocks; each routes every token of the global batch once (k = 1)
    assert counts.shape == (2, 4) and np.all(counts.sum(axis=1) == 8 * 16)
    assert 0 < step["moe_dropped_fraction"] < 1 and step["moe_aux_loss"] > 0
    # the reported loss is the cross-entropy plus the aux loss
    assert rel_diff(step["train_loss"] - step["moe_aux_loss"], ce) <= EQUIV_RTOL_FLOAT64


@pytest.mark.parametrize("model, mesh, parallel, message", [
    (dict(num_experts=3), Mesh(1, 1, 2, 1, 2), {}, "--num-experts (3) must be divisible by the expert-parallel size (2)"),
    (dict(num_experts=4), Mesh(1, 1, 3, 1, 2), {}, "the expert-parallel size (2) must divide data x context parallel "
                                                  "size (3 x 1 = 3)"),
    (dict(num_experts=4), Mesh(1, 1, 1, 2, 4), {}, "the expert-parallel size (4) must divide data x context parallel "
                                                  "size (1 x 2 = 2)"),
    (dict(), Mesh(1, 1, 2, 1, 2), {}, "--expert-parallel-size splits experts over ranks: it needs --num-experts"),
])
def test_layouts_that_cannot_work_are_one_line(model, mesh, parallel, message):
    with pytest.raises(UserError) as error:
        check_layout(tiny_model(**model), None, mesh, ParallelConfig(**parallel))
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("fields, message", [
    (dict(num_experts=2, moe_top_k=3), "--moe-top-k (3) must not exceed --num-experts (2)"),
    (dict(num_experts=4, moe_capacity_factor=-1.0), "moe-capacity-factor must not be negative"),
    (dict(num_experts=-1), "num-experts must not be negative"),
    (dict(num_experts=4, moe_every=0), "moe-every must be positive"),
])
def test_bad_moe_settings_are_one_line(fields, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**fields).validate()
