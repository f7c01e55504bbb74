"""Chapter 20's worked examples stay true: each row of its tables is what the planner
prints for that layout on the H100 profile, formatted as the page writes it, and the
one-node --search it checks its first choice against ranks the layouts as the page
says. Run this file as a script to print the tables to paste into the page."""

import contextlib
import io
import sys

import pytest

from numpitron.plan.__main__ import main
from tests.test_book_figures import page_text, planned, rank_of

PAGE = "21-at-todays-scale.md"
H100 = "--device h100-80gb-node --precision bf16 --micro-batch-size 1"
LLAMA = {"8B": f"{H100} --vocab-size 128256 --n-layers 32 --d-model 4096 --n-heads 32",
         "70B": f"{H100} --vocab-size 128256 --n-layers 80 --d-model 8192 --n-heads 64",
         "405B": f"{H100} --vocab-size 128256 --n-layers 126 --d-model 16384 --n-heads 128"}
DEEPSEEK = (f"{H100} --vocab-size 129280 --n-layers 64 --d-model 7168 --n-heads 128 --seq-len 4096 "
            "--num-experts 256 --moe-top-k 8 --moe-shared-experts 1 --moe-expert-hidden 2048 "
            "--moe-load-balancing bias --moe-capacity-factor 0 --zero-stage 1 --pipeline-parallel-size 16 "
            "--data-parallel-size 128 --global-batch-size 4096 --recompute full")
L8K = "--seq-len 8192"
L128K = "--seq-len 131072"

TABLES = {   # the page's tables: (label as the page writes it, the flags after the model's)
    "8B, 8K": (LLAMA["8B"] + f" {L8K} --global-batch-size 512 --recompute selective", [
        ("dp = 64, ZeRO-0", "--data-parallel-size 64"),
        ("dp = 64, ZeRO-1", "--data-parallel-size 64 --zero-stage 1"),
        ("tp = 2, dp = 32, ZeRO-1", "--tensor-parallel-size 2 --data-parallel-size 32 --zero-stage 1"),
        ("pp = 2, dp = 32, ZeRO-1", "--pipeline-parallel-size 2 --data-parallel-size 32 --zero-stage 1")]),
    "8B, 128K": (LLAMA["8B"] + f" {L128K} --global-batch-size 32 --zero-stage 1", [
        ("cp = 8, dp = 8, selective", "--context-parallel-size 8 --data-parallel-size 8 --recompute selective"),
        ("cp = 8, dp = 8, ZeRO-3, selective",
         "--context-parallel-size 8 --data-parallel-size 8 --recompute selective --zero-stage 3"),
        ("cp = 16, dp = 4, selective", "--context-parallel-size 16 --data-parallel-size 4 --recompute selective"),
        ("tp = 2, cp = 8, dp = 4, selective", "--tensor-parallel-size 2 --sequence-parallel --context-parallel-size 8 "
         "--data-parallel-size 4 --recompute selective"),
        ("cp = 8, dp = 8, full", "--context-parallel-size 8 --data-parallel-size 8 --recompute full")]),
    "70B, 8K": (LLAMA["70B"] + f" {L8K} --global-batch-size 512 --recompute selective", [
        ("ZeRO-3, dp = 512", "--data-parallel-size 512 --zero-stage 3"),
        ("tp = 8, dp = 64, ZeRO-1", "--tensor-parallel-size 8 --sequence-parallel --data-parallel-size 64 --zero-stage 1"),
        ("tp = 8, pp = 2, dp = 32, ZeRO-1", "--tensor-parallel-size 8 --sequence-parallel --pipeline-parallel-size 2 "
         "--data-parallel-size 32 --zero-stage 1"),
        ("tp = 4, pp = 4, dp = 32, ZeRO-1", "--tensor-parallel-size 4 --sequence-parallel --pipeline-parallel-size 4 "
         "--data-parallel-size 32 --zero-stage 1")]),
    "405B": (LLAMA["405B"] + " --tensor-parallel-size 8 --sequence-parallel --pipeline-parallel-size 14 --zero-stage 1", [
        ("8K, 1F1B, selective", f"{L8K} --global-batch-size 3584 --data-parallel-size 128 --recompute selective"),
        ("8K, interleaved v = 3, selective", f"{L8K} --global-batch-size 3584 --data-parallel-size 128 "
         "--recompute selective --pipeline-schedule interleaved --virtual-stages 3"),
        ("8K, interleaved v = 3, full", f"{L8K} --global-batch-size 3584 --data-parallel-size 128 "
         "--recompute full --pipeline-schedule interleaved --virtual-stages 3"),
        ("8K, interleaved v = 3, cp = 2, selective", f"{L8K} --global-batch-size 3584 --data-parallel-size 64 "
         "--context-parallel-size 2 --recompute selective --pipeline-schedule interleaved --virtual-stages 3"),
        ("128K, interleaved v = 3, cp = 16, full", f"{L128K} --global-batch-size 224 --data-parallel-size 8 "
         "--context-parallel-size 16 --recompute full --pipeline-schedule interleaved --virtual-stages 3")]),
    "DeepSeek": (DEEPSEEK, [
        ("ep = 64, 1F1B", "--expert-parallel-size 64"),
        ("ep = 64, DualPipeV", "--expert-parallel-size 64 --pipeline-schedule dualpipev"),
        ("ep = 8, DualPipeV", "--expert-parallel-size 8 --pipeline-schedule dualpipev"),
        ("tp = 8, ep = 16, DualPipeV", "--tensor-parallel-size 8 --sequence-parallel --data-parallel-size 16 "
         "--expert-parallel-size 16 --pipeline-schedule dualpipev")]),
}


def row(label: str, r: dict) -> str:
    """One table row: the busiest stage's peak, whether it fits, and the stage-0 seconds
    of what differs between layouts (exposed communication, bubble), then tokens/s."""
    s = r["stages"][0]["time_s"]
    peak = max(st["total_peak"] for st in r["stages"]) / 2**30
    return (f"| {label} | {peak:.1f} GiB | {'yes' if r['fits'] else 'no'} | {s['exposed_comm']:.1f} s | "
            f"{s['bubble']:.1f} s | {r['tokens_per_s']:,.0f} |")


ROWS = [(table, label, f"{base} {flags}") for table, (base, layouts) in TABLES.items() for label, flags in layouts]


@pytest.mark.parametrize("table, label, flags", ROWS, ids=[f"{t}: {label}" for t, label, _ in ROWS])
def test_each_row_is_what_the_planner_prints(table, label, flags):
    expected = row(label, planned(flags))
    assert expected in page_text(PAGE), f"{PAGE}'s table {table!r} should hold the row\n{expected}"


SEARCH = LLAMA["8B"] + f" {L8K} --recompute selective --zero-stage 1 --global-batch-size 64 --search --devices 8"


def test_the_one_node_search_ranks_as_the_page_says():
    text, result = page_text(PAGE), planned(SEARCH)
    claims = [("plain dp = 8 ranks first", 1, rank_of({"dp": 8})), ("cp = 2 x dp = 4 second", 2, rank_of({"cp": 2, "dp": 4})),
              ("tp = 8 last", len(result["fits"]), rank_of({"tp": 8}))]
    for phrase, place, get in claims:
        assert phrase in text and get(result) == place, f"{phrase!r}: the search puts it {get(result)}"


def params(flags: str, key: str = "total") -> float:
    """The planner's parameter count (billions), as `plan` prints it on its first line."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(flags.split())
    first = out.getvalue().splitlines()[0]
    total, _, rest = first.removeprefix("model: ").partition(" parameters")
    active = rest.split(", ")[1].split(" active")[0] if "active" in rest else total
    return int((total if key == "total" else active).replace(",", "")) / 1e9


PROSE = [  # (phrase as the page writes it, the figure, half its last digit, what the planner gives)
    ("| 8B | 32 | 4,096 | 32 | 128,256 | 7.0 B |", 7.0, 0.05, lambda: params(LLAMA["8B"] + f" {L8K}")),
    ("| 70B | 80 | 8,192 | 64 | 128,256 | 65.6 B |", 65.6, 0.05, lambda: params(LLAMA["70B"] + f" {L8K}")),
    ("| 405B | 126 | 16,384 | 128 | 128,256 | 408.1 B |", 408.1, 0.05, lambda: params(LLAMA["405B"] + f" {L8K}")),
    ("The planner counts 497 B parameters", 497, 0.5, lambda: params(DEEPSEEK)),
    ("31 B of them active per token", 31, 0.5, lambda: params(DEEPSEEK, "active")),
    ("holds 10.5 GiB of parameters on stage 0", 10.5, 0.05, lambda: planned(
        f"{DEEPSEEK} --expert-parallel-size 8 --pipeline-schedule dualpipev")["stages"][0]["params"] / 2**30),
    ("against 4.4 GiB at ep = 64", 4.4, 0.05, lambda: planned(
        f"{DEEPSEEK} --expert-parallel-size 64 --pipeline-schedule dualpipev")["stages"][0]["params"] / 2**30),
]


@pytest.mark.parametrize("phrase, value, tolerance, get", PROSE, ids=[p[0][:40] for p in PROSE])
def test_each_figure_in_the_prose_is_what_the_planner_prints(phrase, value, tolerance, get):
    assert phrase in page_text(PAGE), f"{PAGE} no longer says {phrase!r}: update this test with the page"
    assert abs(get() - value) <= tolerance, f"{phrase!r}: the planner gives {get():.4g}"


if __name__ == "__main__":
    for table, (base, layouts) in TABLES.items():
        print(f"\n{table}\n| layout | peak | fits | exposed comm. | bubble | tokens/s |\n| --- | --- | --- | --- | --- | --- |")
        for label, flags in layouts:
            print(row(label, planned(f"{base} {flags}")))
    sys.exit(0)
