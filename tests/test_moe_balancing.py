"""Balancing without an auxiliary loss (experts/router.py): the bias steers the choice and
never the gates, moves by u * sign(mean load - load) from the global load, is the same
on every rank, and trains exactly like one process on dp, ep, tp and pp meshes."""

import numpy as np
import pytest

from numpitron.config import ModelConfig
from numpitron.distributed.topology import Topology
from numpitron.errors import UserError
from numpitron.experts.router import TopKRouter, update_balance_bias
from tests.harness import check_mesh, identical_over, make_trainer, tiny_model, tiny_train
from tests.layer_checks import make_store, rand_x
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

SERIAL = Topology.serial()
B, T, C, E = 2, 8, 8, 4
BIAS = dict(num_experts=4, moe_top_k=2, moe_load_balancing="bias", moe_bias_update_rate=0.01)


def test_the_bias_changes_the_choice_and_not_the_gates():
    bias = np.zeros(E)
    router = TopKRouter("r", C, E, 2, 0.0, 0.0, balance_bias=bias)
    make_store(router.parameters())
    x = rand_x((B, T, C))
    plain = router.forward(x)[0]
    bias[3] = 10.0                                # far above any probability: always chosen
    steered = router.forward(x)[0]
    assert np.all(np.any(steered.chosen == 3, axis=1)) and not np.all(np.any(plain.chosen == 3, axis=1))
    logits = x.reshape(-1, C) @ router.weight.data
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert rel_diff(steered.gates, np.take_along_axis(probs, steered.chosen, axis=1)) <= EQUIV_RTOL_FLOAT64
    assert np.all(steered.gates < 1)              # a probability, no trace of the bias


def test_bias_update_follows_the_sign_of_the_load_gap():
    bias = np.array([[0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    update_balance_bias(bias, np.array([[4.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]), rate=0.25)
    assert np.array_equal(bias, [[0.25, 0.5, 0.5, 0.75], [0.0, 0.0, 0.0, 0.0]])


def test_training_moves_the_bias_from_the_step_load_without_an_aux_loss():
    model_cfg = tiny_model(**BIAS)
    trainer = make_trainer(model_cfg, tiny_train(), SERIAL)
    steps, biases = [], []
    for _ in range(3):
        before = trainer.model.experts.bias.copy()
        steps.append(trainer.train_step(np.random.default_rng(0).integers(0, 65, 6000).astype(np.uint16)))
        biases.append((before, trainer.model.experts.bias.copy()))
    for step, (before, after) in zip(steps, biases):
        load = np.array(step["moe_tokens_per_expert"], float)
        assert np.array_equal(after, before + 0.01 * np.sign(load.mean(axis=1, keepdims=True) - load))
        assert step["moe_aux_loss"] == 0
        assert rel_diff(step["moe_max_over_mean_load"], load.max(axis=1) / load.mean(axis=1)) <= EQUIV_RTOL_FLOAT64
    assert np.any(biases[0][1])
    # and the bias does steer: without it, the later steps route differently
    fixed = make_trainer(tiny_model(**{**BIAS, "moe_bias_update_rate": 0.0}), tiny_train(), SERIAL)
    fixed_steps = [fixed.train_step(np.random.default_rng(0).integers(0, 65, 6000).astype(np.uint16))
                   for _ in range(3)]
    assert fixed_steps[0]["moe_tokens_per_expert"] == steps[0]["moe_tokens_per_expert"]
    assert fixed_steps[2]["moe_tokens_per_expert"] != steps[2]["moe_tokens_per_expert"]


@pytest.mark.parametrize("fields, message", [
    (dict(num_experts=4, moe_load_balancing="loss-free"), "unknown --moe-load-balancing 'loss-free'; choose one of"),
    (dict(num_experts=4, moe_bias_update_rate=-0.1), "--moe-bias-update-rate must not be negative"),
    (dict(num_experts=4, moe_bias_update_rate=float("nan")), "--moe-bias-update-rate must be a finite number"),
])
def test_bad_balancing_settings_are_one_line(fields, message):
    with pytest.raises(UserError) as error:
        ModelConfig(**fields).validate()
    assert message in str(error.value) and "\n" not in str(error.value)


MESHES = [dict(data=2, expert=2), dict(tensor=2), dict(pipeline=2, schedule="1f1b")]


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_bias_balancing_matches_serial(mesh):
    """Ten float64 iterations equal to one process: had any rank counted only its own
    tokens (or only its stage's blocks), its bias and then its routing would differ."""
    result = check_mesh(mesh, model={**BIAS, "moe_capacity_factor": 1.0} if "tensor" in mesh else BIAS)
    bias = result.trainer.model.experts.bias
    assert identical_over(result.trainer.topo.world, bias) and np.count_nonzero(bias) > 4


@pytest.mark.parallel(nprocs=4)
def test_bias_balancing_on_pp_dp_ep_matches_serial():
    result = check_mesh(dict(pipeline=2, data=2, expert=2, schedule="1f1b"), model=BIAS)
    bias = result.trainer.model.experts.bias
    assert identical_over(result.trainer.topo.world, bias) and np.count_nonzero(bias) > 4
