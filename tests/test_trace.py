"""Traces (numpitron/trace/, docs/19-traces.md): a traced run writes a valid Chrome trace
whose bytes, step times and pipeline bubble agree with what the run itself measures, the
summary partitions every step, and an untraced run carries no wrapper at all."""

import json
import subprocess

import numpy as np
import pytest

from tests.conftest import REPO
from tests.harness import PYTHON, assert_on_every_rank, assert_valid_trace, train_script
from tests.trace_runs import TRACED, steps_of, traced_runs

LAYOUTS = {"pp2": ["--pipeline-parallel-size", "2", "--global-batch-size", "16"],
           "dp2": ["--data-parallel-size", "2", "--global-batch-size", "16", "--bucket-size", "2000"],
           "tp2": ["--tensor-parallel-size", "2", "--global-batch-size", "8"]}
BUBBLE_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def traced(data_dir, tmp_path_factory):
    """layout -> (trace, metrics rows by iteration, trace path); an evaluation and a
    checkpoint save at iteration 3."""
    return traced_runs(data_dir, tmp_path_factory, LAYOUTS, eval_interval=3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_trace_is_valid_and_spans_on_a_track_nest(traced, layout):
    trace = traced(layout)[0]
    assert trace["displayTimeUnit"] == "ms" and trace["otherData"]["iterations"] == TRACED
    events = trace["traceEvents"]
    assert_valid_trace(trace)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == [0, 1] and all(" on " in n and "pp " in n and "tp " in n for n in names.values())
    assert {"step", "forward and backward", "optimizer step", "evaluation", "checkpoint save"} <= \
        {e["name"] for e in events}
    # Every message's arrow leaves its sender before its receive ends, within the clocks' error bound.
    error = max(max(pair) for pair in trace["otherData"]["clock"]["error_us"])
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts.keys() == ends.keys() and (layout != "pp2" or starts)
    assert all(ends[i]["ts"] >= starts[i]["ts"] - error for i in starts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_traced_bytes_are_the_counted_bytes(traced, layout):
    """Rank 0's collective and message bytes in each traced step are its comm_bytes."""
    trace, rows, _ = traced(layout)
    for it, step in steps_of(trace, 0).items():
        inside = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0 and e["cat"] == "comm"
                  and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        assert inside and sum(e["args"]["bytes"] for e in inside) == rows[it]["comm_bytes"], it


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_traced_step_is_the_measured_step(traced, layout):
    """metrics.jsonl's tokens/s is the global batch's tokens over the loop's own step time."""
    trace, rows, _ = traced(layout)
    steps = steps_of(trace, 0)
    assert sorted(steps) == TRACED
    for it, step in steps.items():
        measured_us = rows[it]["global_batch_size"] * 16 / rows[it]["tokens_per_s"] * 1e6
        assert abs(step["dur"] - measured_us) <= 0.02 * measured_us, (it, step["dur"], measured_us)


def test_the_pipeline_idle_share_is_the_executors_bubble(traced):
    """Both measure the schedule's operations against its wall time. The trace's clock
    starts at the first receive or operation, the executor's a few microseconds before
    (it builds its list and executor first), and stops at the gradients' finalisation,
    a few microseconds after the executor's; each operation's span starts a call later
    and ends a return earlier (about a microsecond each). So on a quiet machine they
    agree to better than 0.1 point of a step of tens of milliseconds; a loaded machine
    that suspends a rank inside those few microseconds moves one of them alone, and the
    2 points leave room for a suspension of ~1 ms."""
    from numpitron.trace.summary import summarize
    trace, rows, _ = traced("pp2")
    measured = {r["iteration"]: r["bubble"] for r in summarize(trace) if r["rank"] == 0}
    assert sorted(measured) == TRACED
    for it, bubble in measured.items():
        assert abs(bubble - rows[it]["bubble"]) <= BUBBLE_TOLERANCE, (it, bubble, rows[it]["bubble"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_summary_partitions_every_step(traced, layout):
    path = traced(layout)[2]
    result = subprocess.run([PYTHON, "-m", "numpitron.trace", "summary", str(path), "--json"], cwd=REPO,
                            capture_output=True, text=True, check=True)
    rows = json.loads(result.stdout)
    assert [(r["rank"], r["iteration"]) for r in rows] == [(rank, it) for rank in (0, 1) for it in TRACED]
    for r in rows:
        total = r["compute"] + r["idle"] + sum(r["exposed"].values()) + sum(r["hidden"].values())
        assert abs(total - 1) < 1e-9 and r["compute"] > 0, r
    if layout == "dp2":          # the buckets' all-reduces start during the backward
        assert any(r["hidden"].get("dp_cp", 0) + r["exposed"].get("dp_cp", 0) > 0 for r in rows)
    if layout == "tp2":
        assert all(r["exposed"].get("tp", 0) > 0 for r in rows)


def test_a_trace_rank_0_cannot_write_is_one_line(data_dir, tmp_path):
    result = train_script(data_dir, tmp_path / "out", "--max-iters", "2", "--trace", str(tmp_path / "no/such/t.json"))
    assert result.returncode != 0 and "is not a directory this process can write into" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parallel(nprocs=2)
def test_untraced_runs_carry_no_wrapper_and_a_trace_leaves_none(data_dir, shared_dir):
    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.distributed.topology import GROUPS, Topology
    from numpitron.trace.comm_probe import BLOCKING, STARTING
    from numpitron.trace.tracer import TraceRequest
    from numpitron.train import train
    model = ModelConfig(n_layers=2, n_heads=2, d_model=32, seq_len=16, dtype="float64")
    run = TrainConfig(micro_batch_size=2, global_batch_size=4, max_iters=2, eval_interval=100, eval_iters=1,
                      log_interval=100)
    topo = Topology.from_world(tensor=2)
    trainer = train(model, ParallelConfig(), run, topo, data_dir, shared_dir / "out", progress=False)["trainer"]
    comms = [topo.world] + [getattr(topo, f"{g}_comm") for g in GROUPS]
    objects = comms + [topo.stats, trainer.model, *trainer.model.layers, trainer.step_rule]
    methods = set(BLOCKING + STARTING) | {"wait", "test", "add", "forward", "backward", "backward_input",
                                          "backward_weights", "finalize_grads", "step"}

    def wrapped():
        return sum(len(methods & vars(o).keys()) for o in objects) + len(trainer.features)
    untraced = wrapped()
    tracer = TraceRequest(str(shared_dir / "t.json"), (4, 5)).install(trainer)
    tokens = np.random.default_rng(0).integers(0, 65, 5000).astype(np.uint16)
    counts = []
    for iteration in (3, 4, 5):         # before, inside and after the traced window
        tracer.begin_iteration(iteration)
        counts.append(wrapped())
        trainer.train_step(tokens)
        tracer.end_iteration()
    tracer.finish()
    assert_on_every_rank({"untraced": (untraced, 0), "before": (counts[0], 0), "inside": counts[1] > 20,
                          "after": (counts[2], 0), "left": (wrapped(), 0)})
    if topo.rank == 0:
        assert any(e["name"] == "tp.all_reduce" for e in json.loads((shared_dir / "t.json").read_text())["traceEvents"])


def test_a_trace_draws(traced, tmp_path):
    """Conditional on matplotlib alone (the `docs` extra): without it there is nothing to draw with."""
    import matplotlib  # noqa: F401  (the dev extra installs it: the drawing is tested, never skipped)
    from numpitron.trace.draw import draw, rows_of
    trace = traced("pp2")[0]
    rows, iteration, length = rows_of(trace, 3)
    assert iteration == 3 and length > 0 and [label for label, _ in rows if not label.startswith(" ")] == \
        ["rank 0", "rank 1"]
    draw(trace, tmp_path / "step.svg", 3)
    assert "<svg" in (tmp_path / "step.svg").read_text()


def test_a_measured_step_compares_with_the_planners(traced, tmp_path):
    """`plan --trace` of the same layout opens beside the measured trace: the same ranks,
    the same operation names, and compare sets them side by side."""
    measured_path = traced("pp2")[2]
    predicted_path = tmp_path / "predicted.json"
    flags = ["--n-layers", "2", "--n-heads", "2", "--d-model", "32", "--seq-len", "16", "--micro-batch-size", "4",
             "--dtype", "float64", "--pipeline-parallel-size", "2", "--global-batch-size", "16"]
    subprocess.run([PYTHON, "-m", "numpitron.plan", *flags, "--trace", str(predicted_path)], cwd=REPO, check=True,
                   capture_output=True)
    result = subprocess.run([PYTHON, "-m", "numpitron.trace", "compare", str(measured_path), str(predicted_path),
                             "--json"], cwd=REPO, check=True, capture_output=True, text=True)
    rows = json.loads(result.stdout)
    assert [(r["rank"], r["iteration"]) for r in rows] == [(0, 2), (1, 2)]
    assert all(set(r["operations"]) == {"F", "BW"} and len(r["parted_most"]) == 5 for r in rows)
