"""The planner's accounting equals what a real run counts, to the byte: parameters,
gradients and optimizer state per rank, bytes per collective kind in one iteration,
and the peak activation bytes of the schedule, on every layout below."""

import pytest

from numpitron.optim.memory_report import memory_bytes
from numpitron.plan.accounting import Rank, state_bytes
from numpitron.plan.traffic import comm_bytes, comm_calls
from numpitron.plan.activations import peak_activation_bytes
from tests.harness import TINY, assert_on_every_rank, make_trainer, tiny_model, tiny_tokens, tiny_train


def measured_and_planned(n_layers=4, global_batch_size=8, dtype="float64", mixed=None, moe=None, **layout):
    """mixed: TrainConfig fields of a mixed-precision run (precision, grad_reduce_dtype);
    moe: ModelConfig fields of a mixture-of-experts model."""
    trainer = make_trainer(tiny_model(dtype, n_layers=n_layers, **(moe or {})),
                           tiny_train(global_batch_size=global_batch_size, **(mixed or {})), **layout)
    topo, model_cfg = trainer.topo, trainer.model_cfg
    topo.stats.reset()
    trainer.train_step(tiny_tokens())
    rank = Rank.of(topo, trainer.parallel_cfg)
    assert rank.placement == trainer.model.placement        # the planner places the stages as the model does
    stores = [memory_bytes(optimizer) for optimizer in trainer.optimizers]     # experts: a second store
    return {
        "memory": ({k: sum(store[k] for store in stores) for k in stores[0]}, state_bytes(model_cfg, trainer.parallel_cfg, rank,
                                                                trainer.train_cfg.optimizer, trainer.train_cfg.precision)),
        "comm": ({k: v["bytes"] for k, v in topo.stats.snapshot().items()},
                 comm_bytes(model_cfg, trainer.parallel_cfg, trainer.train_cfg, rank)),
        "activations": (trainer.last_pipeline_stats.peak_activation_bytes,
                        peak_activation_bytes(model_cfg, trainer.parallel_cfg, trainer.train_cfg, rank)),
    }


LAYOUTS_2 = [dict(), dict(data=2), dict(data=2, zero_stage=1), dict(data=2, zero_stage=2), dict(data=2, zero_stage=3),
             dict(data=2, zero_stage=3, overlap_grad_reduce=False),
             dict(tensor=2), dict(tensor=2, sequence_parallel=True),
             dict(tensor=2, recompute="full"), dict(pipeline=2, schedule="gpipe"), dict(pipeline=2),
             dict(context=2), dict(context=2, recompute="selective"), dict(pipeline=2, schedule="zero-bubble"),
             dict(pipeline=2, schedule="interleaved", virtual_stages=2),
             # the V: rank 0 holds the embeddings and the head, rank 1 the bottom of the V
             dict(pipeline=2, schedule="zb-v"), dict(pipeline=2, schedule="dualpipev")]
LAYOUTS_4 = [dict(tensor=2, pipeline=2, sequence_parallel=True, recompute="full"),
             dict(context=2, data=2, zero_stage=1), dict(tensor=2, context=2), dict(pipeline=4, schedule="1f1b"),
             # ZeRO stages 0-3 at dp = 4, and each with tp (the memory table of docs/09-zero-2-and-3.md)
             dict(data=4), dict(data=4, zero_stage=1), dict(data=4, zero_stage=2), dict(data=4, zero_stage=3),
             dict(tensor=2, data=2), dict(tensor=2, data=2, zero_stage=2, sequence_parallel=True),
             dict(tensor=2, data=2, zero_stage=3, recompute="full"), dict(pipeline=2, data=2, zero_stage=2),
             dict(context=2, data=2, zero_stage=3),
             dict(pipeline=4, schedule="interleaved", virtual_stages=2, n_layers=8),
             dict(pipeline=2, tensor=2, schedule="zero-bubble", sequence_parallel=True),
             # hybrid sharding (docs/09-zero-2-and-3.md): S = 2 of dp = 4, each stage; S = 1 with cp, tp or pp
             dict(data=4, data_shard=2, zero_stage=1), dict(data=4, data_shard=2, zero_stage=2),
             dict(data=4, data_shard=2, zero_stage=3), dict(data=4, data_shard=2, hierarchical_all_reduce=True),
             dict(context=2, data=2, data_shard=1, zero_stage=3), dict(tensor=2, data=2, data_shard=1, zero_stage=2),
             dict(pipeline=2, data=2, data_shard=1, zero_stage=1),
             # the V with tp (the embedding's and the head's collectives on one rank) and with dp
             dict(pipeline=2, tensor=2, schedule="zb-v", sequence_parallel=True),
             dict(pipeline=2, data=2, schedule="dualpipev", zero_stage=1, global_batch_size=12)]


def name(layout):
    return "-".join(f"{k}{v}" for k, v in layout.items()) or "serial"


def test_planned_memory_bytes_and_activations_equal_one_process_counts():
    checks = measured_and_planned()
    assert all(measured == planned for measured, planned in checks.values()), checks


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("layout", LAYOUTS_2[1:], ids=name)
def test_planned_memory_bytes_and_activations_equal_two_ranks_counts(layout):
    assert_on_every_rank(measured_and_planned(**layout))


# Mixed precision (docs/07-numbers.md): 2 + 2 + 12 bytes a parameter, parameters gathered
# at 2 bytes, gradients summed at 2 or 4; each ZeRO stage once, both formats and both
# reduce dtypes among them; the activations under full recomputation at 2 bytes.
MIXED_2 = [dict(data=2, mixed=dict(precision="bf16", grad_reduce_dtype="param")),
           dict(data=2, zero_stage=1, mixed=dict(precision="bf16")),
           dict(data=2, zero_stage=2, mixed=dict(precision="fp16", grad_reduce_dtype="param")),
           dict(data=2, zero_stage=3, mixed=dict(precision="bf16", grad_reduce_dtype="param")),
           dict(data=2, zero_stage=3, overlap_grad_reduce=False, mixed=dict(precision="fp16")),
           # a block's input kept in 2 bytes under full recomputation, across a pipeline
           dict(pipeline=2, recompute="full", mixed=dict(precision="bf16"))]


@pytest.mark.parallel(nprocs=2)
def test_planned_memory_and_bytes_of_mixed_precision_runs_equal_their_counts():
    assert_on_every_rank({f"{i} {key}": value for i, layout in enumerate(MIXED_2)
                          for key, value in measured_and_planned(dtype="float32", **layout).items()})


@pytest.mark.parallel(nprocs=4)
def test_planned_memory_bytes_and_activations_equal_four_ranks_counts():
    # One launch for all of them: four ranks on two cores start slowly.
    assert_on_every_rank({f"{name(layout)} {key}": value for layout in LAYOUTS_4
                          for key, value in measured_and_planned(**layout).items()})


def test_the_paper_table_parameter_counts_and_a_plan_for_each_row():
    from numpitron.plan.paper import TABLE_1, reproduce
    rows = reproduce()
    assert len(rows) == len(TABLE_1)
    for row in rows:
        assert abs(row["params_b_eq2"] / row["params_b"] - 1) < 0.03, row        # eq. 2 gives the published sizes
        assert row["fits_80gb"] and row["tflops_predicted"] > 0, row


@pytest.mark.parametrize("flags, message", [
    (["--n-heads", "3"], "d_model (128) must be divisible by n_heads (3)"),
    (["--tensor-parallel-size", "3", "--devices", "4"], "world size 4 is not divisible by tensor x context x pipeline"),
    (["--device", "abacus"], "unknown device 'abacus'"),
    (["--search"], "--search needs --devices N"),
])
def test_a_layout_that_cannot_work_is_the_line_training_gives(flags, message):
    import subprocess
    import sys
    from tests.conftest import REPO
    result = subprocess.run([sys.executable, "-m", "numpitron.plan", *flags], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"error: {result.stderr.strip()[7:]}"] and message in result.stderr


def test_search_ranks_layouts_and_says_why_the_others_fail():
    import json
    import subprocess
    import sys
    from tests.conftest import REPO
    out = subprocess.run([sys.executable, "-m", "numpitron.plan", "--search", "--devices", "8", "--json"],
                         capture_output=True, text=True, cwd=REPO, check=True).stdout
    result = json.loads(out)
    speeds = [r["tokens_per_s"] for r in result["fits"]]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) > 3
    assert any("n_heads (4) must be divisible by the tensor-parallel size (8)" in why for _, why in result["rejected"])


# The time model's counts (numpitron/plan/kernels.py, predict.py): what they claim about
# the code is checked here; how long the code takes is benchmarks/plan_vs_measured.py's.

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


@pytest.mark.parametrize("mesh, across", [((2, 1, 2, 1), ["dp_cp"]), ((4, 1, 1, 1), ["tp"]),
                                          ((1, 2, 1, 2), ["pp"]), ((1, 1, 4, 1), ["dp_cp"]), ((2, 1, 1, 1), [])])
def test_a_cluster_profile_splits_the_bytes_into_two_tiers(mesh, across):
    """Hosts of two ranks, filled in order: a group stays on one host when the ranks it
    spans divide a host's; its bytes go at that tier's bandwidth."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    cluster = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=1e8, inter_bandwidth=1e7,
                      intra_latency=0.0, inter_latency=0.0, cores_per_node=0)
    result = plan(ModelConfig(), ParallelConfig(), TrainConfig(micro_batch_size=12), mesh, cluster)
    assert result["groups_across_hosts"] == across
    stage = result["stages"][0]
    whole_world = ["model", "world", "embedding"] if mesh[0] * mesh[1] * mesh[2] * mesh[3] > 2 else []
    inter = sum(v for k, v in stage["comm_bytes"].items() if k.split(".")[0] in across + whole_world)
    total = sum(stage["comm_bytes"].values())
    hierarchical = {(1, 1, 4, 1): "dp_cp.all_reduce", (4, 1, 1, 1): "tp.all_reduce"}.get(mesh)
    inter_seconds = inter / 1e7                 # one rank of each group a host: the whole ring crosses
    if hierarchical:     # two ranks a host: half the buffer inside it, half its share across (links.link_parts)
        ring = stage["comm_bytes"][hierarchical]
        buffer = ring * 4 / 3
        inter += buffer / 2 / 2 - ring
        total += buffer / 2 + buffer / 2 / 2 - ring
        inter_seconds += buffer / 2 / 2 / 1e7 - ring / 1e7
    assert stage["tiers"].get("inter", {}).get("bytes", 0.0) == pytest.approx(inter)
    assert stage["tiers"].get("inter", {}).get("seconds", 0.0) == pytest.approx(inter_seconds)
    assert sum(t["bytes"] for t in stage["tiers"].values()) == pytest.approx(total)


@pytest.mark.parametrize("stage, split", [(0, {"intra": 1.0}), (1, {"intra": 0.5, "inter": 0.5}),
                                          (3, {"intra": 1.0})])
def test_a_stage_sends_to_each_neighbour_over_its_own_tier(stage, split):
    """pp = 4 on hosts of two ranks: stages 0 and 1 share host 0, 2 and 3 host 1. A
    middle stage sends half its bytes (activations on, gradients back) to each
    neighbour, an end stage all to its one; stage 1's next neighbour is across. A
    stage's sends and receives add up: it receives, computes, then sends."""
    from dataclasses import replace

    from numpitron.plan.accounting import Rank
    from numpitron.plan.devices import load_device
    from numpitron.plan.links import point_to_point_time
    bandwidth = {"intra": 1e8, "inter": 1e7}
    cluster = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=bandwidth["intra"],
                      inter_bandwidth=bandwidth["inter"], intra_latency=0.0, inter_latency=0.0, cores_per_node=0)
    comm, calls = {"pp.send": 3e6, "pp.recv": 2e6}, {"pp.send": 1, "pp.recv": 1}
    priced = sum(share * 5e6 / bandwidth[tier] for tier, share in split.items())
    assert point_to_point_time("pp", comm, calls, Rank(1, 4, 1, 1, stage), (1, 4, 1, 1), cluster) == pytest.approx(priced)


def test_a_pipeline_on_links_costs_what_its_messages_add_to_the_timeline():
    """pp = 2 x dp = 2 on hosts of two ranks: only the pipeline's messages cross hosts.
    Slowing the inter-host tier lengthens every stage's step by the same amount, the
    schedule's makespan with the messages on that link less the one with free messages
    (predict.pipeline_transfer_time), which is less than their sum: some hide."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    fast = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=1e8, inter_bandwidth=1e30,
                   intra_latency=0.0, inter_latency=0.0, cores_per_node=0)
    slow = replace(fast, inter_bandwidth=1e7)
    model, parallel, train = ModelConfig(), ParallelConfig(), TrainConfig(micro_batch_size=2, global_batch_size=16)
    free, paid = (plan(model, parallel, train, (1, 2, 2, 1), d) for d in (fast, slow))
    added = paid["step_s"] - free["step_s"]
    sent = paid["stages"][0]["comm_bytes"]["pp.send"] + paid["stages"][0]["comm_bytes"]["pp.recv"]
    assert 0 < added < sent / 1e7
    for before, after in zip(free["stages"], paid["stages"]):
        assert after["time_s"]["step"] - before["time_s"]["step"] == pytest.approx(added)


@pytest.mark.parametrize("cp_rank", [0, 1, 3])
def test_a_ring_sends_and_receives_at_once_on_a_full_duplex_link(cp_rank):
    """cp = 4 on hosts of two ranks: the ring's last rank (3) sends across to rank 0 and
    receives from rank 2 on its host; on a link both go at once, so the slower counts.
    Through one node's shared memory the rank's core copies both, one after the other."""
    from dataclasses import replace

    from numpitron.plan.accounting import Rank
    from numpitron.plan.devices import load_device
    from numpitron.plan.links import point_to_point_time
    cluster = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=1e8, inter_bandwidth=1e7,
                      intra_latency=0.0, inter_latency=0.0, cores_per_node=0)
    comm, calls = {"cp.send": 3e6, "cp.recv": 3e6}, {"cp.send": 6, "cp.recv": 6}
    rank = Rank(1, 1, 1, 4, cp_rank=cp_rank)
    sends_across, receives_across = cp_rank in (1, 3), cp_rank in (0, 2)
    expected = max(3e6 / (1e7 if sends_across else 1e8), 3e6 / (1e7 if receives_across else 1e8))
    assert point_to_point_time("cp", comm, calls, rank, (1, 1, 1, 4), cluster) == pytest.approx(expected)
    one_node = load_device("this-machine")
    assert not one_node.full_duplex() and cluster.full_duplex()
    assert point_to_point_time("cp", comm, calls, rank, (1, 1, 1, 4), one_node) == pytest.approx(
        6e6 / one_node.intra_bandwidth + 12 * one_node.intra_latency)


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


def _calls_and_sync_points(layout):
    from numpitron.plan.predict import sync_points
    trainer = make_trainer(tiny_model(), tiny_train(), **layout)
    topo = trainer.topo
    trainer.train_step(tiny_tokens())
    topo.stats.reset()
    trainer.train_step(tiny_tokens())
    rank = Rank.of(topo, trainer.parallel_cfg)
    per_mb, per_step = sync_points(trainer.model_cfg, trainer.parallel_cfg, rank)
    calls = sum(v["calls"] for v in topo.stats.snapshot().values())
    return calls, trainer.num_microbatches * per_mb + per_step


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("layout", [{"tensor": 2}, {"data": 2}, {"pipeline": 2}, {"pipeline": 2, "schedule": "gpipe"},
                                    {"tensor": 2, "recompute": "full"},
                                    {"pipeline": 2, "schedule": "interleaved", "virtual_stages": 2},
                                    {"pipeline": 2, "schedule": "zb-v"}, {"pipeline": 2, "schedule": "dualpipev"}],
                         ids=name)
def test_sync_points_are_the_blocking_calls_a_run_makes(layout):
    calls, planned = _calls_and_sync_points(layout)
    assert calls == planned, (calls, planned)


def test_each_call_pays_alpha_once_per_message_of_its_algorithm():
    """The alpha term by hand, bandwidth made free: tp = 2 x dp = 2 on hosts of two
    ranks, 4 blocks, 3 micro-batches. Inside a host, tp's all-reduces (f and g: 4 a block,
    1 for the embedding, 1 for the head, 3 for the loss, each micro-batch) send 2(2-1)
    messages each. Across hosts dp's one bucket and the loss, and the norm's all-reduce
    (its model group is priced as the whole world's): an all-reduce over 2 ranks, 2
    messages each."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.links import messages
    from numpitron.plan.predict import plan
    alpha_intra, alpha_inter = 1e-3, 1e-2
    cluster = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=1e30, inter_bandwidth=1e30,
                      intra_latency=alpha_intra, inter_latency=alpha_inter, cores_per_node=0)
    m, L = 3, 4
    train = TrainConfig(micro_batch_size=2, global_batch_size=2 * m * 2)
    result = plan(ModelConfig(n_layers=L), ParallelConfig(), train,
                  (2, 1, 2, 1), cluster)
    tiers = result["stages"][0]["tiers"]
    assert tiers["intra"]["seconds"] == pytest.approx(m * (4 * L + 1 + 1 + 3) * 2 * alpha_intra)
    assert tiers["inter"]["seconds"] == pytest.approx((1 + 1 + 1) * 2 * alpha_inter)
    assert [messages("x.all_reduce", n) for n in (1, 2, 4, 8)] == [0, 2, 6, 14]
    assert [messages("x.all_gather", 4), messages("x.reduce_scatter", 4), messages("pp.send", 4),
            messages("pp.broadcast", 4), messages("pp.broadcast", 5)] == [3, 3, 1, 2, 3]


def test_a_hierarchical_call_pays_each_tiers_alpha_for_its_ranks_there():
    """dp = 4 on 2 hosts of 2: an all-reduce is 2(2-1) messages inside a host and 2(2-1)
    across, per call (one bucket and the loss)."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    cluster = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=1e30, inter_bandwidth=1e30,
                      intra_latency=1e-3, inter_latency=1e-2, cores_per_node=0)
    result = plan(ModelConfig(), ParallelConfig(), TrainConfig(micro_batch_size=3), (1, 1, 4, 1), cluster)
    tiers = result["stages"][0]["tiers"]
    assert tiers["inter"]["seconds"] == pytest.approx(2 * 2 * 1e-2)
    assert tiers["intra"]["seconds"] == pytest.approx(2 * 2 * 1e-3)


def test_the_link_fit_recovers_alpha_and_beta_from_noisy_all_reduces():
    import numpy as np

    from numpitron.plan.devices import fit_link
    sizes = np.array([8 << s for s in range(0, 16, 3)], float)
    rng = np.random.default_rng(0)
    for ranks, alpha, beta in [(2, 1e-4, 7e6), (4, 3e-5, 9e7)]:
        exact = 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * sizes / beta
        fitted = fit_link(sizes, exact * rng.uniform(0.98, 1.02, sizes.size), ranks)
        assert fitted == pytest.approx((alpha, beta), rel=0.05)


@pytest.mark.parallel(nprocs=2)
def test_planned_calls_equal_the_calls_a_run_makes():
    """The calls the alpha term multiplies, against CommStats' count of one step:
    tensor, pipeline, context and data parallelism (several buckets), and with experts
    (their all-to-alls, the expert buffer's buckets, the router's collectives)."""
    checks = {}
    for moe, layout in [({}, dict(tensor=2)), ({}, dict(pipeline=2)), ({}, dict(context=2)),
                        ({}, dict(data=2, bucket_size=3000)), ({}, dict(data=2, zero_stage=2, bucket_size=3000)),
                        (CAPPED, dict(data=2, expert=2, bucket_size=3000)),
                        (CAPPED, dict(data=2, zero_stage=2, bucket_size=3000)),
                        (DEEPSEEK, dict(tensor=2, sequence_parallel=True)),
                        (CAPPED, dict(context=2, expert=2, recompute="full")), (DEEPSEEK, dict(pipeline=2))]:
        trainer = make_trainer(tiny_model(**moe), tiny_train(), **layout)
        trainer.topo.stats.reset()
        trainer.train_step(tiny_tokens())
        planned = comm_calls(trainer.model_cfg, trainer.parallel_cfg, trainer.train_cfg,
                             Rank.of(trainer.topo, trainer.parallel_cfg))
        checks[f"{name(layout)} {sorted(moe.items())}"] = ({k: v["calls"] for k, v in trainer.topo.stats.snapshot().items()}, planned)
    assert_on_every_rank(checks)


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


def test_a_slow_link_exposes_what_it_cannot_carry_during_the_backward():
    """dp = 2 in 8 buckets over a link of 1 MB/s: the 3 MB all-reduce takes seconds, the
    backward milliseconds, so nearly all of it is exposed, not one bucket's eighth."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    slow = replace(load_device("this-machine"), cores_per_node=0, intra_bandwidth=1e6, intra_latency=0.0)
    result = plan(ModelConfig(), ParallelConfig(bucket_size=100_000), TrainConfig(micro_batch_size=12),
                  (1, 1, 2, 1), slow)
    stage = result["stages"][0]
    link = stage["comm_bytes"]["dp_cp.all_reduce"] / 1e6
    compute = sum(stage["time_s"][k] for k in ("matmul", "elementwise", "exp", "calls"))
    assert stage["time_s"]["exposed_comm"] == pytest.approx(result["pace"] * link - 2 / 3 * compute)


# Experts (docs/13-experts.md): a capacity every expert fills (c = 0.25: 2 of a sequence's
# 8 choices an expert draws on average) fixes the rows the all-to-alls carry, so the planned
# bytes are the counted ones whatever the routing; dropless, the plan is the balanced ideal.
CAPPED = dict(num_experts=4, moe_top_k=2, moe_capacity_factor=0.25)
DEEPSEEK = dict(CAPPED, moe_shared_experts=1, moe_expert_hidden=64, moe_every=2, moe_load_balancing="bias")
MOE_LAYOUTS_2 = [(CAPPED, dict(data=2, expert=2, zero_stage=1)), (DEEPSEEK, dict(data=2, expert=2, zero_stage=3)),
                 (CAPPED, dict(data=2, expert=2, recompute="full", zero_stage=2)), (CAPPED, dict(data=2)),
                 (DEEPSEEK, dict(tensor=2, sequence_parallel=True, recompute="full")), (CAPPED, dict(tensor=2)),
                 (DEEPSEEK, dict(pipeline=2)), (DEEPSEEK, dict(tensor=2, sequence_parallel=True)),
                 (CAPPED, dict(tensor=2, sequence_parallel=True, recompute="selective")),
                 (CAPPED, dict(data=2, data_shard=1, zero_stage=2)), (CAPPED, dict(data=2, hierarchical_all_reduce=True))]


def test_planned_memory_bytes_and_activations_of_experts_equal_one_process_counts():
    for moe, layout in [(CAPPED, {}), (DEEPSEEK, {}), (CAPPED, dict(recompute="selective"))]:
        checks = measured_and_planned(moe=moe, **layout)
        assert all(measured == planned for measured, planned in checks.values()), checks
    for moe in (CAPPED, DEEPSEEK):      # Muon: one moment on the matrices, the experts' and the router's too
        measured, planned = measured_and_planned(moe=moe, mixed=dict(optimizer="muon"))["memory"]
        assert measured == planned


@pytest.mark.parallel(nprocs=2)
def test_planned_memory_bytes_and_activations_of_experts_equal_two_ranks_counts():
    """dp x ep with ZeRO-1, 2 and 3 (the experts at stage 2), dp with the experts replicated,
    tp (with sp, selective or full recomputation, shared experts), pp; dropless and cp x ep,
    the balanced plan near the count."""
    assert_on_every_rank({f"{i} {name(layout)} {key}": value
                          for i, (moe, layout) in enumerate(MOE_LAYOUTS_2) for key, value in measured_and_planned(moe=moe, **layout).items()})
    assert_on_every_rank({f"muon {name(layout)}": measured_and_planned(moe=moe, mixed=dict(optimizer="muon"), **layout)["memory"]
                          for moe, layout in [(CAPPED, dict(data=2, expert=2, zero_stage=1)), (DEEPSEEK, dict(data=2, zero_stage=2))]})
    # Dropless, or under cp (which splits a sequence's kept choices as the routing falls),
    # the all-to-all rows follow the router: the balanced plan is near the count, the rest exact.
    for moe, layout in [(dict(CAPPED, moe_capacity_factor=0), dict(data=2, expert=2)), (CAPPED, dict(context=2, expert=2))]:
        checks = measured_and_planned(moe=moe, **layout)
        (measured, planned), memory = checks["comm"], checks["memory"]
        assert planned["ep.all_to_allv"] == pytest.approx(measured["ep.all_to_allv"], rel=0.1)
        assert memory[0] == memory[1] and {k: v for k, v in measured.items() if k != "ep.all_to_allv"} == \
            {k: v for k, v in planned.items() if k != "ep.all_to_allv"}


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
