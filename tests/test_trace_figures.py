"""The chapters' traced timelines (benchmarks/trace_figures.py, run by `make figures`):
every figure the script lists is drawn, stands in its chapter, and pairs a measured
step with the planner's predicted one; the numbers a chapter quotes beside its figure
are those of the runs that drew it (docs/figures/trace_figures.json), to the rounding
the page uses; and the script draws a figure from a fresh run end to end."""

import json
import sys

import pytest

from numpitron.trace.summary import share_sum
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import trace_figures  # noqa: E402  (benchmarks/ is a folder of scripts)

NUMBERS = json.loads((REPO / "docs/figures/trace_figures.json").read_text())


def panel(figure, label, kind="measured", rank=0):
    return next(r for r in NUMBERS[figure][label][kind] if r["rank"] == rank)


def percent(figure, label, key, group=None, rank=0, kind="measured"):
    row = panel(figure, label, kind, rank)
    return lambda: 100 * (row[key] if group is None else row[key].get(group, 0.0))


def exposed_ms(figure, label, group, kind="measured"):
    row = panel(figure, label, kind)
    return lambda: row["step_ms"] * row["exposed"][group]


SCHEDULES, SLOW = trace_figures.CASES["trace_schedules"][2], trace_figures.CASES["trace_slow_link"][2]
# (chapter, phrase as the page writes it, the number it quotes, tolerance, where it comes from)
QUOTES = [
    ("03-data-parallelism.md", "hidden behind the backward for 19% of rank 0's step", 19, 0.5,
     percent("trace_buckets", trace_figures.CASES["trace_buckets"][2][0][0], "hidden", "dp_cp")),
    ("04-tensor-parallelism.md", "waited 68% of its step in tp's collectives", 68, 0.5,
     percent("trace_tp_overlap", trace_figures.CASES["trace_tp_overlap"][2][0][0], "exposed", "tp")),
    ("09-zero-2-and-3.md", "a gather in flight for 40% of rank 0's step", 40, 0.5,
     percent("trace_zero3", trace_figures.CASES["trace_zero3"][2][0][0], "hidden", "dp_shard")),
    ("11-pipeline-schedules.md", "1F1B's measured bubble, 41%", 41, 0.5,
     percent("trace_schedules", SCHEDULES[0][0], "bubble")),
    ("11-pipeline-schedules.md", "the planner's timeline 15%", 15, 0.5,
     percent("trace_schedules", SCHEDULES[0][0], "bubble", kind="predicted")),
    ("12-context-parallelism.md", "still waits 45% of its step on the ring", 45, 0.5,
     percent("trace_ring", trace_figures.CASES["trace_ring"][2][0][0], "exposed", "cp_ring")),
    ("18-across-slow-links.md", "plain dp waits 74 ms a step", 74, 0.5, exposed_ms("trace_slow_link", SLOW[0][0], "dp_cp")),
    ("18-across-slow-links.md", "DiLoCo's round-end waits 68 ms", 68, 0.5,
     exposed_ms("trace_slow_link", SLOW[1][0], "diloco")),
    ("18-across-slow-links.md", "the planner's 35 ms a step", 35, 0.5,
     exposed_ms("trace_slow_link", SLOW[1][0], "all", "predicted")),
]


def page_text(page: str) -> str:
    return " ".join((REPO / "docs" / page).read_text().split())


@pytest.mark.parametrize("name", trace_figures.CASES)
def test_every_trace_figure_is_drawn_beside_its_prediction_and_in_its_chapter(name):
    chapter, _, runs = trace_figures.CASES[name]
    assert f"figures/{name}.svg" in (REPO / "docs" / chapter).read_text(), f"{chapter} does not show {name}.svg"
    drawn = (REPO / "docs/figures" / f"{name}.svg").read_text()
    assert "<svg" in drawn and "predicted by the planner" in drawn and "CPU: " in drawn, name
    assert "benchmarks/trace_figures.py" in (REPO / "benchmarks/figures.py").read_text()      # `make figures` runs it
    assert f"    {name}.svg " in trace_figures.__doc__          # the list tests/test_docs.py reads
    assert sorted(NUMBERS[name]) == sorted(label for label, *_ in runs)
    for label, ranks, _, iterations in runs:
        measured, predicted = NUMBERS[name][label]["measured"], NUMBERS[name][label]["predicted"]
        assert [r["rank"] for r in measured] == list(range(ranks)) and len({r["iteration"] for r in measured}) == 1
        assert measured[0]["iteration"] in iterations
        assert predicted and all(abs(share_sum(r) - 1) < 1e-9 for r in measured + predicted)


@pytest.mark.parametrize("page, phrase, value, tolerance, get", QUOTES, ids=[q[1][:40] for q in QUOTES])
def test_each_quoted_number_is_the_figures_run(page, phrase, value, tolerance, get):
    assert phrase in page_text(page), f"{page} no longer says {phrase!r}: update this test with the page"
    assert abs(get() - value) <= tolerance, f"{page}: {phrase!r} quotes {value}, trace_figures.json gives {get():.3g}"


def test_the_script_draws_a_figure_from_fresh_runs(data_dir, tmp_path):
    """Conditional on matplotlib alone (the dev extra installs it), as test_trace.py's drawing."""
    import matplotlib  # noqa: F401
    trace_figures.main(["--data-dir", str(data_dir), "--only", "trace_buckets", "--out-dir", str(tmp_path)])
    numbers = json.loads((tmp_path / "trace_figures.json").read_text())
    label = trace_figures.CASES["trace_buckets"][2][0][0]
    assert [r["rank"] for r in numbers["trace_buckets"][label]["measured"]] == [0, 1]
    text = (tmp_path / "trace_buckets.svg").read_text()
    assert "<svg" in text and "predicted by the planner" in text and "CPU: " in text
