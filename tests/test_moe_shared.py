"""Shared experts and finer-grained routed experts (DeepSeekMoE): the shared experts
are one dense tensor-parallel MLP beside the routed ones, every token through it; the
routed experts take their own hidden width. Backward against finite differences, and
ten float64 iterations equal to one process on tp, ep and pp meshes."""

import numpy as np
import pytest

from numpitron.layout import check_layout
from numpitron.distributed.topology import Mesh, Topology
from numpitron.errors import UserError
from numpitron.experts.moe import MixtureOfExperts
from tests.harness import check_mesh, make_trainer, tiny_model, tiny_train
from tests.layer_checks import check_layer, make_store, rand_x

SERIAL = Topology.serial()
B, T, C, E = 2, 8, 8, 4
SHARED = dict(num_experts=4, moe_top_k=2, moe_shared_experts=2, moe_expert_hidden=24)


def shared_moe(capacity_factor=0.0):
    return MixtureOfExperts("mlp", C, SERIAL, out_std=0.3, num_experts=E, top_k=2, capacity_factor=capacity_factor,
                            aux_loss_coef=0.0, shared_experts=2, expert_hidden=12)


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_shared_and_narrow_experts_backward(capacity_factor):
    layer = shared_moe(capacity_factor)
    shapes = {p.name: p.full_shape for p in layer.parameters()}
    assert shapes["mlp.shared.fc.weight"] == (C, 2 * 12) and shapes["mlp.experts.3.fc.weight"] == (C, 12)
    check_layer(layer, rand_x((B, T, C)), seed=2)


def test_a_token_every_routed_choice_dropped_still_gets_the_shared_experts():
    layer = shared_moe(capacity_factor=0.5)
    make_store(layer.parameters())
    x = rand_x((B, T, C))
    y, cache = layer.forward(x.copy())
    shared_only = layer.shared.forward(x.copy())[0]
    none_kept = ~np.any(cache["routing"].kept.reshape(B, T, 2), axis=2)
    assert np.any(none_kept) and np.array_equal(y[none_kept], shared_only[none_kept])
    assert not np.allclose(y[~none_kept], shared_only[~none_kept])


def test_shared_experts_live_in_the_dense_store():
    trainer = make_trainer(tiny_model(**SHARED), tiny_train(), SERIAL)
    model = trainer.model
    assert "blocks.0.mlp.shared.proj.weight" in model.store.by_name
    assert not any(".shared." in name for name in model.expert_store.by_name)


def test_expert_hidden_must_split_over_tp_in_one_line():
    with pytest.raises(UserError) as error:
        check_layout(tiny_model(num_experts=4, moe_expert_hidden=25), None, Mesh(2, 1, 1, 1, 1))
    assert "--moe-expert-hidden (25) must be divisible by the tensor-parallel size (2)" == str(error.value)


MESHES = [(dict(tensor=2), dict(moe_capacity_factor=1.0)), (dict(data=2, expert=2), {}),
          (dict(pipeline=2, schedule="1f1b"), dict(moe_every=2))]


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("case", MESHES, ids=lambda c: "-".join(f"{k}{v}" for k, v in {**c[0], **c[1]}.items()))
def test_shared_experts_match_serial(case):
    check_mesh(case[0], model={**SHARED, **case[1]})
