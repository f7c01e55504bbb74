"""Batch-size ramp-up (--rampup-batch-size START INCREMENT SAMPLES, Megatron's semantics):
the schedule of global batches, every layout against one process in float64 (the
pipeline's micro-batch count changing from step to step), resuming mid-ramp on another
mesh, metrics.jsonl, and the one-line errors."""

import json

import pytest

from numpitron.checkpoint import load_checkpoint, save_checkpoint
from numpitron.config import TrainConfig
from numpitron.distributed.topology import Topology
from numpitron.errors import UserError
from tests.harness import (SMALLER, check_mesh, error_lines, make_trainer, mesh_id, tiny_model, tiny_tokens, tiny_train,
                           train_script, train_steps)
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

# Batches 4, 4, 4, 8, 8, 12, ...: one increment every 24 / 2 = 12 samples consumed.
RAMP = dict(micro_batch_size=2, global_batch_size=12, rampup_batch_size=(4, 4, 24))


def test_the_batch_grows_by_one_increment_per_share_of_the_samples():
    cfg = TrainConfig(micro_batch_size=2, global_batch_size=16, rampup_batch_size=(4, 4, 40), max_iters=12)
    # 40 samples over 3 increments: +4 once 13.3, 26.7 and 40 samples are consumed.
    assert [cfg.global_batch_at(i, 1) for i in range(10)] == [4, 4, 4, 4, 8, 8, 12, 16, 16, 16]
    assert TrainConfig(micro_batch_size=2, global_batch_size=16).global_batch_at(0, 1) == 16


def table_of_every_iteration(start, increment, samples, target, iterations):
    """The ramp as it was first written: one entry per iteration (the reference)."""
    per_increment, sizes, consumed = samples / max(1, (target - start) // increment), [], 0
    for _ in range(iterations):
        sizes.append(min(target, start + int(consumed / per_increment) * increment))
        consumed += sizes[-1]
    return sizes


@pytest.mark.parametrize("start, increment, samples, target", [
    (4, 4, 40, 16), (4, 4, 24, 12), (8, 8, 400, 32), (2, 2, 7, 64), (8, 8, 3, 64), (6, 2, 1000, 30), (4, 4, 1, 4)])
@pytest.mark.timeout(30)
def test_the_ramp_by_stages_is_the_ramp_of_every_iteration_and_costs_nothing_at_huge_max_iters(
        start, increment, samples, target):
    cfg = TrainConfig(micro_batch_size=2, global_batch_size=target, rampup_batch_size=(start, increment, samples),
                      max_iters=10 ** 12).validate()
    expected = table_of_every_iteration(start, increment, samples, target, 600)
    assert [cfg.global_batch_at(i, 1) for i in range(600)] == expected
    assert [cfg.global_batch_at(i, 1) for i in (10 ** 12 - 1, 10 ** 15)] == [target, target]   # instant


def test_a_ramp_step_is_the_step_of_that_batch_size():
    ramp = make_trainer(tiny_model(), tiny_train(**RAMP), Topology.serial())
    fixed = make_trainer(tiny_model(), tiny_train(micro_batch_size=2, global_batch_size=4), Topology.serial())
    assert train_steps(ramp, 1) == train_steps(fixed, 1)
    assert (ramp.global_batch_size, ramp.num_microbatches, ramp.model.loss_weight) == (4, 2, 0.5)
    train_steps(ramp, 5)
    assert (ramp.global_batch_size, ramp.num_microbatches) == (12, 6)


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("mesh", [dict(data=2), dict(pipeline=2, schedule="1f1b"), dict(tensor=2, zero_stage=1),
                                  dict(pipeline=2, schedule="interleaved", virtual_stages=2),
                                  dict(data=2, zero_stage=3), dict(context=2)], ids=mesh_id)
def test_every_layout_ramps_like_one_process(mesh):
    check_mesh(mesh, **RAMP)


@pytest.mark.parallel(nprocs=4)
def test_pipeline_with_data_parallel_and_muon_ramps_like_one_process():
    check_mesh(dict(pipeline=2, data=2, schedule="gpipe", zero_stage=1), **RAMP, optimizer="muon")


@pytest.mark.parallel(nprocs=2)
def test_experts_ramp_like_one_process_and_their_routers_follow_the_loss_weight():
    result = check_mesh(dict(data=2, expert=2), model=dict(num_experts=2, moe_top_k=1), **RAMP)
    trainer = result.trainer
    routers = [block.mlp.router for block in trainer.model.blocks]
    assert trainer.num_microbatches == 3 and all(r.loss_weight == 1 / 3 for r in routers)     # batch 12 over dp 2
    trainer.set_batch(0)
    assert trainer.num_microbatches == 1 and all(r.loss_weight == 1.0 for r in routers)      # batch 4


@pytest.mark.parallel(nprocs=2)
def test_a_run_resumes_mid_ramp_on_another_mesh(shared_dir):
    model, cfg = tiny_model(**SMALLER), tiny_train(**RAMP)
    expected = train_steps(make_trainer(model, cfg, Topology.serial()), 8, tiny_tokens())
    source = make_trainer(model, cfg, data=2, zero_stage=1)
    train_steps(source, 4, tiny_tokens())            # batches 4, 4, 4, 8: in the middle of the ramp
    path = save_checkpoint(shared_dir, source)
    resumed = make_trainer(model, cfg, pipeline=2)
    load_checkpoint(path, resumed)
    losses = train_steps(resumed, 4, tiny_tokens())
    assert resumed.global_batch_size == 12
    assert rel_diff(losses, expected[4:]) <= EQUIV_RTOL_FLOAT64


def test_a_ramp_that_does_not_divide_is_one_clear_error():
    with pytest.raises(UserError, match=r"start \(6\) and increment \(4\) must be multiples of micro batch x "
                                        r"data-parallel size \(4\)"):
        tiny_train(micro_batch_size=2, global_batch_size=12, rampup_batch_size=(6, 4, 24)).check_rampup(2)
    with pytest.raises(UserError, match=r"global batch size \(12\) must be start \(4\) plus a whole number"):
        tiny_train(micro_batch_size=2, global_batch_size=12, rampup_batch_size=(4, 6, 24)).check_rampup(1)


def test_metrics_show_the_growing_batch_and_bad_flags_are_one_line(data_dir, tmp_path):
    result = train_script(data_dir, tmp_path / "out", "--max-iters", "6", "--global-batch-size", "16",
                          "--rampup-batch-size", "4", "4", "24")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["global_batch_size"] for row in rows if "train_loss" in row] == [4, 4, 8, 12, 16, 16]
    config = (tmp_path / "out" / "config.toml").read_text()
    assert "rampup_batch_size = [4, 4, 24]" in config
    again = train_script(data_dir, tmp_path / "again", "--config", str(tmp_path / "out" / "config.toml"),
                         "--max-iters", "2")
    assert again.returncode == 0, again.stderr
    bad = train_script(data_dir, tmp_path / "bad", "--max-iters", "2", "--global-batch-size", "16",
                       "--rampup-batch-size", "6", "4", "24")
    lines = error_lines(bad.stderr)
    assert bad.returncode != 0 and len(lines) == 1 and "must be multiples of micro batch" in lines[0], bad.stderr


def test_a_ramp_that_starts_below_what_a_v_shaped_schedule_needs_is_one_line():
    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.layout import check_layout
    from numpitron.distributed.topology import resolve_mesh
    from numpitron.errors import UserError
    model, v_shape = ModelConfig(n_layers=4, n_heads=2), ParallelConfig(schedule="zb-v").validate()
    short = TrainConfig(micro_batch_size=1, global_batch_size=8, rampup_batch_size=(2, 2, 16)).validate()
    with pytest.raises(UserError, match="the zb-v schedule needs at least 3 micro-batches per step"):
        check_layout(model, short, resolve_mesh(2, 1, 2, None), v_shape)
    enough = TrainConfig(micro_batch_size=1, global_batch_size=8, rampup_batch_size=(4, 2, 16)).validate()
    check_layout(model, enough, resolve_mesh(2, 1, 2, None), v_shape)


@pytest.mark.parametrize("iteration, now, note", [
    (4, RAMP, None),                                   # the same flags, mid-ramp: nothing changed
    (4, dict(RAMP, rampup_batch_size=()), "the global batch is now 12 sequences, the checkpoint's run would take 8: "
                                          "pass --global-batch-size 12 --rampup-batch-size 4 4 24"),
    (4, dict(RAMP, rampup_batch_size=(4, 4, 48)), "the global batch is now 4 sequences, the checkpoint's run would "
                                                  "take 8: pass --global-batch-size 12 --rampup-batch-size 4 4 24"),
    (6, dict(RAMP, rampup_batch_size=()), None),       # the ramp was over: dropping it changes nothing
    (6, dict(RAMP, global_batch_size=16, rampup_batch_size=()), "the global batch is now 16 sequences, the "
                                                                "checkpoint trained with 12: pass --global-batch-size 12"),
])
def test_a_resume_notes_a_changed_ramp_and_only_then(iteration, now, note):
    """Every resume of a ramped run used to say "pass --global-batch-size 12" (it compared
    the ramp's first batch with the target); one that dropped the ramp said nothing."""
    from numpitron.config import to_dict
    from numpitron.train import batch_change_note
    model = tiny_model(**SMALLER)
    manifest = {"train_config": to_dict(tiny_train(**RAMP)), "mesh": {"data": 1}}
    trainer = make_trainer(model, tiny_train(**now), Topology.serial())
    trainer.iteration = iteration
    said = batch_change_note(manifest, trainer)
    assert (said is None) if note is None else (said == f"note: {note} to continue its trajectory"), said


def test_a_ramp_added_on_resume_is_noted():
    from numpitron.config import to_dict
    from numpitron.train import batch_change_note
    plain = {"train_config": to_dict(tiny_train(global_batch_size=12)), "mesh": {"data": 1}}
    trainer = make_trainer(tiny_model(**SMALLER), tiny_train(**RAMP), Topology.serial())
    trainer.iteration = 2
    assert batch_change_note(plain, trainer) == ("note: the global batch is now 4 sequences, the checkpoint trained "
                                                 "with 12: pass --global-batch-size 12 without --rampup-batch-size "
                                                 "to continue its trajectory")


def test_resuming_a_ramped_run_with_its_own_flags_says_nothing_about_the_batch(data_dir, tmp_path):
    out, flags = tmp_path / "out", ["--global-batch-size", "16", "--rampup-batch-size", "4", "4", "48"]
    assert train_script(data_dir, out, "--max-iters", "4", "--save-interval", "2", *flags).returncode == 0
    again = train_script(data_dir, out, "--max-iters", "6", "--resume", *flags)
    assert again.returncode == 0 and "global batch" not in again.stdout + again.stderr, again.stdout
