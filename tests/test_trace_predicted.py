"""The planner's predicted step as a trace (numpitron/trace/predicted.py): valid, its
step the planner's where their models coincide, and comparable with a measured trace."""

import json

import pytest

from numpitron.plan.__main__ import main as plan_main
from numpitron.trace.compare import compare
from numpitron.trace.summary import share_sum, summarize
from tests.harness import assert_valid_trace


def predicted(tmp_path, *flags):
    path = tmp_path / "predicted.json"
    plan_main([*flags, "--json", "--trace", str(path)])
    return json.loads(path.read_text())


def test_one_stage_predicts_the_planners_step(tmp_path, capsys):
    """One stage: the schedule is m micro-batches back to back, then the exposed
    communication and the optimizer, which is how the planner adds its step up."""
    trace = predicted(tmp_path, "--tensor-parallel-size", "2", "--data-parallel-size", "2")
    planned = json.loads(capsys.readouterr().out)["step_s"] * 1e6
    assert_valid_trace(trace)
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "step"]
    assert [e["pid"] for e in steps] == [0] and steps[0]["dur"] == pytest.approx(planned, rel=1e-6)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_a_predicted_pipeline_waits_where_its_schedule_does(tmp_path, schedule):
    trace = predicted(tmp_path, "--pipeline-parallel-size", "2", "--pipeline-schedule", schedule,
                      "--global-batch-size", "96")
    assert_valid_trace(trace)
    rows = summarize(trace)
    assert [r["rank"] for r in rows] == [0, 1] and all(abs(share_sum(r) - 1) < 1e-9 for r in rows)
    # Eight micro-batches on two stages: the idle share is near the schedule's ideal bubble.
    ideal = trace["otherData"]["planner_bubble"]
    assert all(abs(r["bubble"] - ideal) < 0.05 for r in rows), ([r["bubble"] for r in rows], ideal)
    same = compare(trace, trace)
    assert all(r["step_ms"]["measured"] == r["step_ms"]["predicted"] for r in same) and len(same) == 2
