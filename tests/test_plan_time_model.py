"""The planner's time model (numpitron/plan/kernels.py, predict.py): the work it counts
is the work a step does (exponentials, matmul FLOPs, softmax groups, experts' matmuls),
and ranks sharing cores, waiting for the slowest one or idle in the bubble change the
step as it says. What the counts claim about the code is checked here; how long the
code takes is benchmarks/plan_vs_measured.py's."""

import pytest

from numpitron.plan.accounting import Rank
from tests.harness import TINY, make_trainer, tiny_model, tiny_tokens, tiny_train


@pytest.mark.parametrize("T, cp", [(16, 1), (64, 1), (128, 1), (16, 2), (64, 2), (32, 4)])
def test_softmax_groups_cover_the_probabilities_the_layer_keeps(T, cp):
    from numpitron.transformer.activation_memory import attention_area
    from numpitron.plan.kernels import attention_groups
    groups = attention_groups(T, cp, 0)
    assert sum(rows * keys for rows, keys, *_ in groups) == attention_area(T, cp)
    assert sum(first for *_, first in groups) == -(-T // 2 // min(T // 2, 64)) * 2     # each tile starts once


def _count_exponentials(monkeypatch):
    """Elements np.exp and np.tanh are asked for (GELU takes one of them per element)."""
    import numpy as np
    counted = {"elements": 0}
    for name in ("exp", "tanh"):
        original = getattr(np, name)

        def counting(x, *args, _original=original, **kwargs):
            counted["elements"] += np.asarray(x).size
            return _original(x, *args, **kwargs)
        monkeypatch.setattr(np, name, counting)
    return counted


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_exponentials_in_one_step_are_the_ones_the_planner_counts(monkeypatch, recompute):
    from numpitron.plan.predict import microbatch_work
    trainer = make_trainer(tiny_model(), tiny_train(), recompute=recompute)
    trainer.train_step(tiny_tokens())
    counted = _count_exponentials(monkeypatch)
    trainer.train_step(tiny_tokens())
    m = trainer.train_cfg.num_microbatches(1)
    planned = microbatch_work(trainer.model_cfg, trainer.parallel_cfg, trainer.train_cfg, Rank(1, 1, 1, 1)).exps
    assert counted["elements"] == m * planned


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_planner_counts_the_papers_matmul_flops_but_the_scores_it_skips(recompute):
    """Narayanan et al.'s count charges every query all T keys; the layer computes
    attention_area of them, and adds the embedding's one-hot matmul."""
    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.transformer.activation_memory import attention_area
    from numpitron.plan.flops import hardware_flops
    from numpitron.plan.predict import microbatch_work
    model, train = ModelConfig(), TrainConfig(micro_batch_size=12)
    B, T, L, C, V = 12, model.seq_len, model.n_layers, model.d_model, model.vocab_size
    planned = microbatch_work(model, ParallelConfig(recompute=recompute), train, Rank(1, 1, 1, 1)).flops
    skipped = (16 if recompute == "full" else 12) * B * C * L * (T * T - attention_area(T))
    assert planned == pytest.approx(hardware_flops(B, T, L, C, V, recompute) - skipped + 2 * V * B * T * C, rel=1e-12)


def test_a_matmul_curve_is_read_between_its_points_and_flat_beyond():
    from numpitron.plan.devices import PAPER, Device
    device = Device("cpu", 30.0, 1.0, 1.0, 1, 0, 1, 0, 1, matmul_curve=((1e3, 10.0), (1e5, 30.0)))
    assert [device.matmul_flops(s) for s in (10, 1e3, 1e4, 1e5, 1e9)] == pytest.approx([10, 10, 20, 30, 30])
    assert PAPER["a100-80gb-node"].matmul_flops(10) == 312e12                 # no curve: the peak


def test_ranks_beyond_the_cores_share_them():
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan, sync_points
    model, parallel, train = ModelConfig(), ParallelConfig(), TrainConfig(micro_batch_size=12)
    cpu = replace(load_device("this-machine"), cores_per_node=2, time_sharing_wait=0.0)
    mesh = (2, 1, 2, 1)
    shared, alone = plan(model, parallel, train, mesh, cpu), plan(model, parallel, train, mesh, replace(cpu, cores_per_node=4))
    assert shared["time_sharing"] == 2 and alone["time_sharing"] == 1
    assert shared["step_s"] == pytest.approx(2 * alone["step_s"])
    waiting = plan(model, parallel, train, mesh, replace(cpu, time_sharing_wait=1e-3))
    per_mb, per_step = sync_points(model, parallel, Rank(2, 1, 2, 1))
    assert (per_mb, per_step) == (4 * 4 + 1 + 4, 3)
    assert waiting["step_s"] == pytest.approx(shared["step_s"] + (per_mb * 1 + per_step) * 1e-3)


def test_ranks_that_wait_for_each_other_go_at_the_slowest_ones_pace():
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import PAPER, load_device
    from numpitron.plan.predict import plan
    model, parallel, train = ModelConfig(), ParallelConfig(), TrainConfig(micro_batch_size=12)
    steady = replace(load_device("this-machine"), slowest_rank=1.0, time_sharing_wait=0.0)
    noisy = replace(steady, slowest_rank=1.25)
    for mesh in ((1, 1, 2, 1), (2, 1, 1, 1), (2, 1, 2, 1)):
        assert plan(model, parallel, train, mesh, noisy)["step_s"] == pytest.approx(
            1.25 * plan(model, parallel, train, mesh, steady)["step_s"])
    one = (1, 1, 1, 1)                                  # one rank waits for no one
    assert plan(model, parallel, train, one, noisy)["step_s"] == plan(model, parallel, train, one, steady)["step_s"]
    assert PAPER["a100-80gb-node"].pace(8) == 1.0


def test_a_rank_idle_in_the_bubble_lends_its_core_to_the_others():
    """pp = 4, m = 4 under 1F1B: the bubble is 3/7 of a stage's time alone, 1 / (1 - b) =
    1.75; four ranks on two cores already take twice their work, so the bubble costs
    nothing more there."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    model, parallel, train = ModelConfig(), ParallelConfig(), TrainConfig(micro_batch_size=3, global_batch_size=12)
    cpu = replace(load_device("this-machine"), time_sharing_wait=0.0, slowest_rank=1.0)
    alone = plan(model, parallel, train, (1, 4, 1, 1), replace(cpu, cores_per_node=4))
    shared = plan(model, parallel, train, (1, 4, 1, 1), cpu)
    assert alone["bubble"] == pytest.approx(3 / 7) and shared["time_sharing"] == 2
    for a, s in zip(alone["stages"], shared["stages"]):
        assert a["time_s"]["bubble"] > 0 and s["time_s"]["bubble"] == 0
        assert s["time_s"]["step"] == pytest.approx(2 * (a["time_s"]["step"] - a["time_s"]["bubble"]))


def test_experts_flops_are_a_tokens_active_matmuls_and_the_step_time_follows():
    """Per token an MoE block runs the router (C x E) and k experts (two C x 4C matrices
    each) where a dense block runs its MLP: with k = 1 only the router is added, each
    further choice adds one expert's matmuls, 6 FLOPs a weight (forward and backward)."""
    from numpitron.config import ParallelConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    parallel, train, device = ParallelConfig().validate(), tiny_train(), load_device("this-machine")
    plans = {k: plan(tiny_model(**({"num_experts": 4, "moe_top_k": k} if k else {})), parallel, train, (1, 1, 1, 1),
                     device) for k in (0, 1, 2)}
    C, L, tokens = TINY["d_model"], TINY["n_layers"], train.global_batch_size * TINY["seq_len"]
    flops = {k: p["model_flops_per_iteration"] for k, p in plans.items()}
    assert flops[1] - flops[0] == pytest.approx(6 * tokens * L * C * 4)
    assert flops[2] - flops[1] == pytest.approx(6 * tokens * L * 2 * C * 4 * C)
    assert 0 < plans[0]["step_s"] < plans[2]["step_s"] and plans[1]["step_s"] < plans[2]["step_s"]
