"""AdamW, the learning-rate schedule, clipping and the gradient norm (serial).

Expected values come from the formulas, not from the code under test. The chunked
AdamW and the gradient norm by runs are held to numpitron/reference.py in
test_kernels_vs_reference.py.
"""

import math

import numpy as np

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
from numpitron.distributed.topology import Topology
from numpitron.build import build_stage
from numpitron.optim.adamw import AdamW
from numpitron.optim.grad_norm import clip_, global_grad_norm
from numpitron.optim.schedule import learning_rate
from numpitron.build import make_optimizer
from tests.tolerances import CLIP_RTOL, EQUIV_RTOL_FLOAT64, rel_diff

B1, B2, EPS, WD = 0.9, 0.95, 1e-3, 0.1     # eps large enough that where it goes matters


def test_adamw_first_step_is_lr_times_sign_when_eps_is_negligible():
    # With bias correction, step 1 is m_hat / sqrt(v_hat) = g / |g|: a step of exactly lr.
    g = np.array([1e-3, -2.0, 5.0, -7e-2])
    p = np.zeros(4)
    AdamW(4, np.float64, B1, B2, 0.0, WD).update(p, g, [(0, 4)], 0.5)
    assert rel_diff(p, -0.5 * np.sign(g)) <= EQUIV_RTOL_FLOAT64


def test_step_count_increments_every_update():
    opt = AdamW(3, np.float64)
    for k in range(1, 5):
        opt.update(np.ones(3), np.ones(3), [(0, 3)], 1e-3)
        assert opt.step_count == k
    # and through both optimizers a trainer uses (serial topology)
    train = TrainConfig(grad_clip=1.0, weight_decay=0.1)
    for zero in (0, 1):
        model = build_stage(tiny_cfg(), Topology.serial(), seed=1)
        optimizer = make_optimizer(model.store, Topology.serial(), train, ParallelConfig(zero_stage=zero))
        for k in range(1, 4):
            model.store.grad[:] = 1e-3
            optimizer.step(1e-3)
            assert optimizer.adam.step_count == k, (zero, k)


LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-4, 10, 110


def lr_at(i):
    return learning_rate(i, LR, MIN_LR, WARMUP, DECAY)


def test_warmup_is_linear_and_reaches_lr():
    warm = np.array([lr_at(i) for i in range(WARMUP + 1)])
    assert np.all(warm[:WARMUP] > 0) and np.all(np.diff(warm) > 0)
    # linear: equal increments; the last warm-up value plus one increment is lr
    steps = np.diff(warm)
    assert rel_diff(steps, np.full_like(steps, steps[0])) <= EQUIV_RTOL_FLOAT64
    assert rel_diff(warm[WARMUP - 1] + steps[0], LR) <= EQUIV_RTOL_FLOAT64
    assert lr_at(WARMUP) == LR and warm[WARMUP - 1] < LR
    assert learning_rate(0, LR, MIN_LR, 0, DECAY) == LR        # no warm-up at all


def test_cosine_decay_falls_monotonically_to_the_minimum_through_the_midpoint():
    after = np.array([lr_at(i) for i in range(WARMUP, DECAY + 20)])
    assert np.all(np.diff(after) <= 0)
    assert all(lr_at(i) == MIN_LR for i in (DECAY, DECAY + 1, 10 * DECAY))
    assert lr_at(DECAY - 1) > MIN_LR
    halfway = WARMUP + (DECAY - WARMUP) // 2
    assert rel_diff(lr_at(halfway), (LR + MIN_LR) / 2) <= EQUIV_RTOL_FLOAT64
    # a quarter of the way: min + (lr - min) * (1 + cos(pi/4)) / 2
    quarter = WARMUP + (DECAY - WARMUP) // 4
    expected = MIN_LR + (LR - MIN_LR) * (1 + math.sqrt(0.5)) / 2
    assert rel_diff(lr_at(quarter), expected) <= EQUIV_RTOL_FLOAT64


def test_clip_scales_large_gradients_to_max_norm():
    g = np.random.default_rng(1).normal(size=50)
    g *= 10.0 / np.linalg.norm(g)
    before = g.copy()
    clip_(g, float(np.linalg.norm(g)), 1.0)
    assert abs(np.linalg.norm(g) - 1.0) <= CLIP_RTOL and np.linalg.norm(g) <= 1.0
    ratio = g / before                                        # direction kept: one factor
    assert rel_diff(ratio, np.full_like(ratio, ratio[0])) <= EQUIV_RTOL_FLOAT64


def test_clip_leaves_small_gradients_and_disabled_clipping_alone():
    g = np.random.default_rng(2).normal(size=50)
    g *= 0.5 / np.linalg.norm(g)
    before = g.copy()
    clip_(g, float(np.linalg.norm(g)), 1.0)
    assert np.array_equal(g, before)
    big = before * 100
    clip_(big, float(np.linalg.norm(big)), 0.0)               # max_norm 0: off
    assert np.array_equal(big, before * 100)


def tiny_cfg():
    return ModelConfig(vocab_size=13, seq_len=4, n_layers=2, n_heads=2, d_model=8, dtype="float64").validate()


def test_global_grad_norm_serial_is_the_plain_norm():
    topo = Topology.serial()
    model = build_stage(tiny_cfg(), topo, seed=0)
    model.store.grad[:] = np.random.default_rng(3).normal(size=model.store.size)
    assert np.all(model.store.norm_mask == 1)                 # one process counts everything
    norm = global_grad_norm(model.store.grad, model.store.norm_runs, topo.model_comm)
    assert rel_diff(norm, np.linalg.norm(model.store.grad)) <= EQUIV_RTOL_FLOAT64
    assert topo.stats.total_bytes() == 0


def test_decay_mask_is_matrices_and_embeddings_only():
    model = build_stage(tiny_cfg(), Topology.serial(), seed=0)
    names = [p.name for p in model.parameters()]
    assert "embedding.token.weight" in names and "embedding.position.weight" in names
    for p in model.parameters():
        parts = p.name.split(".")
        is_norm = parts[-2] in ("ln1", "ln2", "ln_f")
        expected = 0.0 if parts[-1] == "bias" or is_norm else 1.0
        start, stop = model.store.offsets[p.name]
        assert np.all(model.store.decay_mask[start:stop] == expected), p.name
    # and the decayed tensors are exactly the >= 2-D weights of linears and embeddings
    decayed = {p.name for p in model.parameters() if model.store.decay_mask[model.store.offsets[p.name][0]]}
    assert all(name.endswith("weight") and "ln" not in name for name in decayed)
    assert len(decayed) == 2 + 4 * 2                           # 2 embeddings + 4 linears per block
