"""The planner's accounting equals what a real run counts, to the byte: parameters,
gradients and optimizer state per rank, bytes per collective kind in one iteration,
and the peak activation bytes of the schedule, on every layout below, with mixed
precision and with experts; and its calls and sync points are the ones a step makes."""

import pytest

from numpitron.optim.memory_report import memory_bytes
from numpitron.plan.accounting import Rank, state_bytes
from numpitron.plan.traffic import comm_bytes, comm_calls
from numpitron.plan.activations import peak_activation_bytes
from tests.harness import assert_on_every_rank, make_trainer, tiny_model, tiny_tokens, tiny_train


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
