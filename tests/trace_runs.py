"""Traced runs shared by the trace tests: train_shakespeare.py on two ranks with
iterations 2-4 of 5 traced, run once per layout and kept for the module."""

import json

from tests.harness import train_script

TRACED = [2, 3, 4]


def traced_runs(data_dir, tmp_path_factory, layouts: dict, eval_interval: int):
    """A function layout -> (trace, metrics rows by iteration, trace path)."""
    runs = {}

    def run(layout):
        if layout not in runs:
            out = tmp_path_factory.mktemp(layout)
            result = train_script(data_dir, out / "run", "--max-iters", "5", "--eval-interval", str(eval_interval),
                                  "--trace", str(out / "trace.json"), "--trace-iters", "2:5", *layouts[layout],
                                  nprocs=2)
            assert result.returncode == 0, result.stderr
            rows = [json.loads(line) for line in (out / "run/metrics.jsonl").read_text().splitlines()]
            runs[layout] = (json.loads((out / "trace.json").read_text()), {r["iter"]: r for r in rows},
                            out / "trace.json")
        return runs[layout]
    return run


def steps_of(trace, pid):
    """Iteration -> the step span of process `pid`."""
    return {e["args"]["iteration"]: e for e in trace["traceEvents"]
            if e["ph"] == "X" and e["pid"] == pid and e["name"] == "step" and e["cat"] == "step"}
