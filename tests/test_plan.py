"""The planner's accounting equals what a real run counts, to the byte: parameters,
gradients and optimizer state per rank, bytes per collective kind in one iteration,
and the peak activation bytes of the schedule, on every layout below."""

import pytest

from numpitron.plan.accounting import Rank, comm_bytes, peak_activation_bytes, state_bytes
from tests.harness import assert_on_every_rank, make_trainer, tiny_model, tiny_tokens, tiny_train


def measured_and_planned(n_layers=4, **layout):
    trainer = make_trainer(tiny_model(n_layers=n_layers), tiny_train(), **layout)
    topo, model_cfg = trainer.topo, trainer.model_cfg
    topo.stats.reset()
    trainer.train_step(tiny_tokens())
    rank = Rank(topo.tp, topo.pp, topo.dp, topo.cp, topo.pp_rank, topo.cp_rank, topo.dp_rank)
    return {
        "memory": (trainer.optimizer.memory_bytes(), state_bytes(model_cfg, trainer.parallel_cfg, rank)),
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
             dict(pipeline=2, schedule="interleaved", virtual_stages=2)]
LAYOUTS_4 = [dict(tensor=2, pipeline=2, sequence_parallel=True, recompute="full"),
             dict(context=2, data=2, zero_stage=1), dict(tensor=2, context=2), dict(pipeline=4, schedule="1f1b"),
             # ZeRO stages 0-3 at dp = 4, and each with tp (the memory table of docs/12)
             dict(data=4), dict(data=4, zero_stage=1), dict(data=4, zero_stage=2), dict(data=4, zero_stage=3),
             dict(tensor=2, data=2), dict(tensor=2, data=2, zero_stage=2, sequence_parallel=True),
             dict(tensor=2, data=2, zero_stage=3, recompute="full"), dict(pipeline=2, data=2, zero_stage=2),
             dict(context=2, data=2, zero_stage=3),
             dict(pipeline=4, schedule="interleaved", virtual_stages=2, n_layers=8),
             dict(pipeline=2, tensor=2, schedule="zero-bubble", sequence_parallel=True)]


def name(layout):
    return "-".join(f"{k}{v}" for k, v in layout.items()) or "serial"


def test_one_process():
    checks = measured_and_planned()
    assert all(measured == planned for measured, planned in checks.values()), checks


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("layout", LAYOUTS_2[1:], ids=name)
def test_two_ranks(layout):
    assert_on_every_rank(measured_and_planned(**layout))


@pytest.mark.parallel(nprocs=4)
def test_four_ranks():
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
