"""The all-to-all overlap's benchmarks on one node, without the cluster:
benchmarks/a2a_overlap_worker.py's paired, unpaired and layer-only steps take turns in one
run, each kind reports its steps and waits, and the paired trace's hidden share is a share
of the all-to-alls' time in flight; benchmarks/a2a_completion_probe.py times its cases."""

import json

from tests.harness import run_script

FLAGS = ["--warmup", "1", "--iters", "2", "--traced", "1", "--d-model=32", "--n-layers=2", "--n-heads=2",
         "--seq-len=16", "--micro-batch-size=2", "--num-experts", "4", "--moe-top-k", "2", "--moe-shared-experts", "1",
         "--global-batch-size=16", "--no-overlap-grad-reduce", "--pipeline-parallel-size", "1",
         "--data-parallel-size", "2", "--expert-parallel-size", "2", "--pipeline-schedule", "1f1b"]


def test_the_three_kinds_of_step_take_turns_in_one_run():
    done = run_script([*FLAGS, "--moe-a2a-overlap"], nprocs=2, script="benchmarks/a2a_overlap_worker.py")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for kind in ("paired", "unpaired", "layer-only"):
        assert len(out[kind]["ms_steps"]) == 2 and out[kind]["ms_median"] > 0
        assert len(out[kind]["per_rank"]) == 2 and all(r["waited_s"] >= 0 for r in out[kind]["per_rank"])
    for rank in out["paired_trace"]:
        assert 0 <= rank["hidden_s"] <= rank["in_flight_s"] > 0
        assert rank["a2a_waited_behind_dp_s"] == 0.0                 # dp reduces after the backward
        # 16 / (2 x 2) = 4 micro-batches, 3 pairs; a hand-over at each of a pair's 2 x 2 x 2 all-to-alls
        assert rank["pair_per_paired_step"]["handovers"] == 3 * 8


def test_a_run_that_cannot_pair_is_refused():
    done = run_script([*FLAGS, "--no-moe-a2a-overlap"], nprocs=2, script="benchmarks/a2a_overlap_worker.py")
    assert done.returncode != 0 and done.stderr.count("must pair chunks") == 1


def test_the_completion_probe_times_each_case_on_one_node():
    """benchmarks/a2a_completion_probe.py's ranks, without the cluster: one JSON line with
    the wait of each case (alone, followed, tested)."""
    done = run_script(["--worker", "--bytes", "8192", "--compute", "2", "--reps", "2"], nprocs=2,
                      script="benchmarks/a2a_completion_probe.py")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["bytes_each_way"] == 8192 and set(out["wait_ms"]) == {"alone", "followed", "tested"}
    assert all(0 <= w < 1000 for w in out["wait_ms"].values())
