"""Muon beside the features that reduce or store differently: mixed precision (the
fp32 master weights move along Muon's step; fp16's loss scale is undone before the
momentum; a skipped step skips Muon), hybrid sharding (owners inside each replica's
shard group) and the two-level all-reduce. Pairwise, on the tiniest model."""

import numpy as np
import pytest

from numpitron.distributed.topology import Topology
from numpitron.muon.muon import is_hidden_matrix, matrix_shape, update_scale
from tests.harness import check_mesh, make_trainer, mesh_id, tiny_model, tiny_tokens, tiny_train, train_steps

BF16_EPS = 2.0 ** -7
FP16_EPS = 2.0 ** -10


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("mesh", [dict(data=4, data_shard=2, zero_stage=1), dict(data=4, data_shard=2, zero_stage=3),
                                  dict(data=4, data_shard=2, hierarchical_all_reduce=True),
                                  dict(tensor=2, data=2, data_shard=1, zero_stage=2)], ids=mesh_id)
def test_muon_with_hybrid_sharding_or_the_two_level_all_reduce_matches_one_process(mesh):
    """Each replica's S ranks own every matrix between them, after the replica average
    (S = 1: each rank owns all of its own); the two-level all-reduce leaves each replica
    whole, so it orthogonalises for itself. float64, ten iterations, 1e-10."""
    check_mesh(mesh, optimizer="muon")


def muon_step_bound(trainer, steps: int = 10) -> float:
    """How far two runs' master weights can part, relative to the largest parameter:
    Muon moves an element by at most lr (wd |w| + 0.2 sqrt(max(A, B)) |O_ij|) a step,
    and |O_ij| <= ||O||_2 <= 1.25 after the quintic iteration (its fixed band is about
    [0.7, 1.2]); two runs whose roundings differ can move opposite ways."""
    scale = max(update_scale(matrix_shape(p)) for p in trainer.model.store.params if is_hidden_matrix(p))
    largest = np.max(np.abs(trainer.model.store.data))
    per_lr = 1.25 * scale + trainer.train_cfg.weight_decay * largest
    return 2 * per_lr * sum(trainer.lr(t) for t in range(steps)) / largest


# As for AdamW (tests/test_precision.py): two layouts in a low format sum the same fp32
# products in different orders, the rounding turns that into at most one ulp here and
# there, and the losses then differ by about eps relative.
@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("mesh, precision, eps", [(dict(data=2, zero_stage=1), "bf16", BF16_EPS),
                                                  (dict(tensor=2), "fp16", FP16_EPS)], ids=["dp2-zero1-bf16", "tp2-fp16"])
def test_muon_in_low_precision_on_a_mesh_equals_one_process_within_the_formats_epsilon(mesh, precision, eps):
    train = dict(precision=precision, optimizer="muon", loss_scale=2.0 ** 8 if precision == "fp16" else 0.0)
    serial = make_trainer(tiny_model("float32"), tiny_train(**train), Topology.serial())
    result = check_mesh(mesh, dtype="float32", rtol=muon_step_bound(serial), **train)
    assert np.max(np.abs(result.losses - result.reference_losses) / result.reference_losses) <= eps
    master = result.trainer.optimizer.adam.master
    assert master.dtype == np.float32 and result.trainer.optimizer.adam.adam.momentum.dtype == np.float32


def test_muons_momentum_sees_the_unscaled_gradient_in_fp16():
    """One step at loss scale 2^12: the momentum is (1 - beta) g of the true gradient,
    as in fp32, within fp16's rounding of g (not 2^12 times it)."""
    momenta = {}
    for precision, scale in (("fp32", 0.0), ("fp16", 2.0 ** 12)):
        trainer = make_trainer(tiny_model("float32"), tiny_train(precision=precision, loss_scale=scale,
                                                                   optimizer="muon"), Topology.serial())
        trainer.train_step(tiny_tokens())
        rule = trainer.optimizer.adam                   # fp16: the master weights' wrapper
        momenta[precision] = (rule.adam if precision == "fp16" else rule).momentum.copy()
    exact, fp16 = momenta["fp32"], momenta["fp16"]
    assert np.linalg.norm(exact) > 0
    assert np.linalg.norm(fp16 - exact) <= 4 * FP16_EPS * np.linalg.norm(exact), np.linalg.norm(fp16) / np.linalg.norm(exact)


def test_an_overflowing_fp16_step_skips_muon_too():
    trainer = make_trainer(tiny_model("float32"), tiny_train(precision="fp16", loss_scale=2.0 ** 40, optimizer="muon"),
                           Topology.serial())
    train_steps(trainer, 1)                     # 2^40 overflows: skipped, the scale halves
    master = trainer.optimizer.adam.master
    before = master.copy()
    out = trainer.train_step(tiny_tokens())
    assert out["skipped_steps"] == 2 and out["loss_scale"] == 2.0 ** 38
    muon = trainer.optimizer.adam.adam
    assert np.array_equal(master, before) and not muon.momentum.any() and not muon.adam.m.any()
    assert muon.step_count == 0
