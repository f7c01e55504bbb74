"""The planner's figures the book quotes stay true: each case runs a command a page gives
(the planner, in-process) and checks every figure the page quotes from it, twice: the
phrase is in the page, and the command's output gives the figure to the rounding the
page uses. A change to the planner that moves a quoted figure fails here, naming the
page to correct, instead of silently falsifying a chapter.

A figure is (phrase, value, tolerance, getter): the phrase as the page writes it (line
breaks aside), the number it quotes, half a unit of its last digit (or the looser bound
an "about" allows), and what to read from the planner's JSON.
"""

import contextlib
import io
import json
from functools import lru_cache

import pytest

from numpitron.plan.__main__ import main
from numpitron.plan.devices import PAPER
from tests.conftest import REPO

A100 = PAPER["a100-80gb-node"]
GPT_1_3B = "--device a100-80gb-node --n-layers 24 --d-model 2048 --n-heads 16 --seq-len 2048 --vocab-size 51200"
GPT_18B = ("--device a100-80gb-node --n-layers 40 --d-model 6144 --n-heads 48 --seq-len 2048 --vocab-size 51200 "
           "--micro-batch-size 1 --global-batch-size 1024 --recompute full")
GPT_145B = ("--device a100-80gb-node --n-layers 80 --d-model 12288 --n-heads 96 --seq-len 2048 --vocab-size 51200 "
            "--micro-batch-size 1 --global-batch-size 2304 --recompute full --tensor-parallel-size 8")
GPT_036B = ("--device a100-80gb-node --n-layers 24 --d-model 1024 --n-heads 16 --seq-len 2048 --vocab-size 51200 "
            "--micro-batch-size 1 --global-batch-size 64")


@lru_cache(maxsize=None)
def planned(flags: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(flags.split() + ["--json"]) == 0
    return json.loads(out.getvalue())


def stage(key, scale=1e3, at=0):
    """A stage's time of one kind, in ms (scale 1e3) or s (1)."""
    return lambda r: scale * r["stages"][at]["time_s"][key]


def ratio(a, b):
    return lambda r: r["stages"][0]["time_s"][a] / r["stages"][0]["time_s"][b]


def intra_bytes_ms(r):
    """What a stage's intra-host bytes take at NVLink's bandwidth, alpha aside."""
    return 1e3 * r["stages"][0]["tiers"]["intra"]["bytes"] / A100.intra_bandwidth


def peak_gib(r):
    return max(s["total_peak"] for s in r["stages"]) / 2**30


def activations(s):
    return lambda r: r["stages"][s]["activations_peak"] / 2**20


def rank_of(mesh: dict):
    """1-based place of a layout in a --search's ranking, and its tokens/s."""
    def get(r):
        for place, fit in enumerate(r["fits"], 1):
            if all(fit["mesh"][k] == v for k, v in mesh.items()):
                return place
        raise AssertionError(f"{mesh} is not among the fits")
    return get


def tokens_of(mesh: dict):
    return lambda r: r["fits"][rank_of(mesh)(r) - 1]["tokens_per_s"]


CASES = [
    ("03-data-parallelism.md", GPT_1_3B + " --data-parallel-size 32 --micro-batch-size 1 --global-batch-size 32 "
     "--no-overlap-grad-reduce", [
         ("It prints 57 ms of matmuls", 57, 0.5, stage("matmul")),
         ("and 45 ms of exposed communication", 45, 0.5, stage("exposed_comm")),
         ("Against 2,048 tokens that is two thirds of the compute", 2 / 3, 0.07,   # the bytes, alpha aside
          lambda r: (1e3 * r["stages"][0]["tiers"]["intra"]["bytes"] / A100.intra_bandwidth
                     + 1e3 * r["stages"][0]["tiers"]["inter"]["bytes"] / A100.inter_bandwidth)
          / stage("matmul")(r))]),
    ("03-data-parallelism.md", GPT_1_3B + " --data-parallel-size 32 --micro-batch-size 1 --global-batch-size 512", [
        ("the matmuls take 915 ms", 915, 0.5, stage("matmul")),
        ("the same 45 ms hide inside the backward", 0, 1, stage("exposed_comm"))]),
    ("04-tensor-parallelism.md", GPT_1_3B + " --tensor-parallel-size 8 --data-parallel-size 4 --micro-batch-size 1 "
     "--global-batch-size 512", [
         ("It gives 915 ms of matmuls", 915, 0.5, stage("matmul")),
         ("1,164 ms of exposed communication", 1164, 0.5, stage("exposed_comm")),
         ("1.27 times the matmuls", 1.27, 0.005, ratio("exposed_comm", "matmul")),
         ("The bytes alone take 614 ms", 614, 0.5, intra_bytes_ms),
         ("a ratio of 0.67", 0.67, 0.005, lambda r: intra_bytes_ms(r) / stage("matmul")(r))]),
    ("04-tensor-parallelism.md", GPT_1_3B + " --tensor-parallel-size 16 --data-parallel-size 2 --micro-batch-size 1 "
     "--global-batch-size 512", [
         ("the communication takes 3.9 s", 3.9, 0.05, stage("exposed_comm", 1)),
         ("4.2 times the matmuls", 4.2, 0.05, ratio("exposed_comm", "matmul"))]),
    ("04-tensor-parallelism.md", GPT_1_3B + " --tensor-parallel-size 8 --data-parallel-size 4 --micro-batch-size 1 "
     "--global-batch-size 512 --d-model 8192 --n-heads 64", [
         ("communication is 25% of the matmuls", 0.25, 0.005, ratio("exposed_comm", "matmul")),
         ("its bytes 19%", 0.19, 0.005, lambda r: intra_bytes_ms(r) / stage("matmul")(r))]),
    ("05-pipeline-parallelism.md", GPT_1_3B + " --pipeline-parallel-size 4 --data-parallel-size 8 --micro-batch-size 1 "
     "--global-batch-size 512", [
         ("beside the first stage's 915 ms of matmuls", 915, 0.5, stage("matmul")),
         ("43 ms at 25 GB/s", 43, 0.5,
          lambda r: 1e3 * sum(r["stages"][0]["comm_bytes"][k] for k in ("pp.send", "pp.recv")) / A100.inter_bandwidth),
         ("The planner prints 2.3 ms of exposed communication", 2.3, 0.05, stage("exposed_comm")),
         ("3/67 of the step, is 91 ms", 91, 0.5, stage("bubble")),
         ("3/67 of the step", 3 / 67, 1e-9, lambda r: r["bubble"]),
         ("forty times what the messages cost", 40, 2, lambda r: stage("bubble")(r) / stage("exposed_comm")(r))]),
    ("05-pipeline-parallelism.md", "--pipeline-parallel-size 4 --micro-batch-size 4 --global-batch-size 32", [
        ("gives 8.8, 6.6, 4.4 and 2.5 MiB under 1F1B", v, 0.05, activations(s))
        for s, v in enumerate((8.8, 6.6, 4.4, 2.5))]),
    ("05-pipeline-parallelism.md", "--pipeline-parallel-size 4 --micro-batch-size 4 --global-batch-size 32 "
     "--pipeline-schedule gpipe", [
         ("17.6, 17.6, 17.6 and 20.1 MiB under GPipe", v, 0.05, activations(s))
         for s, v in enumerate((17.6, 17.6, 17.6, 20.1))]),
    ("08-zero.md", GPT_1_3B + " --data-parallel-size 32 --micro-batch-size 1 --global-batch-size 512", [
        ("falls from 24.4 GiB (ZeRO-0)", 24.4, 0.05, peak_gib),
        ("from under a millisecond", 0.5, 0.5, stage("exposed_comm"))]),
    ("08-zero.md", GPT_1_3B + " --data-parallel-size 32 --micro-batch-size 1 --global-batch-size 512 --zero-stage 1", [
        ("to 10.1 GiB", 10.1, 0.05, peak_gib),
        ("from 12 to 0.4 bytes a parameter", 0.4, 0.05, lambda r: r["stages"][0]["optimizer_state"] / 1_317_654_528),
        ("the whole reduction, 35 ms", 35, 0.5, stage("exposed_comm")),
        ("It is under 2% of the step", 0.01, 0.01, lambda r: r["stages"][0]["time_s"]["exposed_comm"] / r["step_s"])]),
    ("08-zero.md", "--data-parallel-size 4 --zero-stage 1", [
        ("prints an optimizer of 1.5 MiB", 1.5, 0.05, lambda r: r["stages"][0]["optimizer_state"] / 2**20),
        ("beside 3.1 MiB of parameters", 3.1, 0.05, lambda r: r["stages"][0]["params"] / 2**20)]),
]

def state_mib(r):
    """A rank's parameters, gradients, optimizer state and in-pass buffers: chapter 9's bars."""
    s = r["stages"][0]
    return sum(s[k] for k in ("params", "grads", "optimizer_state", "gathered_params_peak",
                              "backward_grads_peak")) / 2**20


MUON = "--data-parallel-size 2 --zero-stage 1 --micro-batch-size 6 --global-batch-size 12"
CASES += [
    ("09-zero-2-and-3.md", "--data-parallel-size 4 --zero-stage 2", [
        ("prints 8.50 MiB for ZeRO-2", 8.50, 0.005, state_mib)]),
    ("09-zero-2-and-3.md", "--data-parallel-size 4 --zero-stage 3", [
        ("and 6.24 MiB for ZeRO-3", 6.24, 0.005, state_mib)]),
]
for page, step, ns, adam in (("10-muon.md", "predicts 54 ms a step", "15 of them in Newton-Schulz",
                              "against 40 ms with AdamW: c = 1.37"),
                             ("appendix-a-speed-on-a-cpu.md", "and 54 ms with `--optimizer muon`",
                              "15 ms of it in the busiest owner's iterations", "predicts 40 ms a step with AdamW")):
    CASES += [(page, f"{MUON} --optimizer muon", [
        (step, 54, 0.5, lambda r: 1e3 * r["step_s"]), (ns, 15, 0.5, stage("newton_schulz"))]),
              (page, MUON, [(adam, 40, 0.5, lambda r: 1e3 * r["step_s"])])]
CASES.append(("10-muon.md", f"{MUON} --optimizer muon", [
    ("c = 1.37", 1.37, 0.005, lambda r: r["step_s"] / planned(MUON)["step_s"])]))


TABLE_14 = [  # layout flags, the row's exposed communication and bubble (s) as chapter 14 writes them
    ("--tensor-parallel-size 8 --data-parallel-size 32", "| t = 8 (the paper's) | 4.0 s | 1.7 s | 0 |", 1.7, 0),
    ("--tensor-parallel-size 16 --data-parallel-size 16", "| t = 16, across two nodes | 4.0 s | 5.3 s | 0 |", 5.3, 0),
    ("--pipeline-parallel-size 8 --data-parallel-size 32", "| p = 8, d = 32 | 4.0 s | 0.02 s | 1.4 s |", 0.02, 1.4),
    ("--tensor-parallel-size 2 --pipeline-parallel-size 4 --data-parallel-size 32",
     "| t = 2, p = 4, d = 32 | 4.0 s | 0.2 s | 0.6 s |", 0.2, 0.6),
    ("--data-parallel-size 256 --zero-stage 3", "| ZeRO-3, d = 256 | 4.0 s | 3.6 s | 0 |", 3.6, 0),
]
for flags, row, exposed, bubble in TABLE_14:
    digits = 0.005 if exposed < 0.1 else 0.05
    CASES.append(("14-putting-it-together.md", f"{GPT_18B} {flags}", [
        (row, 4.0, 0.05, stage("matmul", 1)), (row, exposed, digits, stage("exposed_comm", 1)),
        (row, bubble, 0.05, stage("bubble", 1))]))
CASES += [
    ("14-putting-it-together.md", f"{GPT_18B} --tensor-parallel-size 16 --data-parallel-size 16", [
        ("from the flat ring's seven times the matmuls to 1.3", 1.3, 0.05, ratio("exposed_comm", "matmul"))]),
    ("14-putting-it-together.md", f"{GPT_18B} --data-parallel-size 256 --zero-stage 3", [
        ("and ZeRO-3 from six times to 0.9", 0.9, 0.05, ratio("exposed_comm", "matmul"))]),
    ("14-putting-it-together.md", f"{GPT_18B} --tensor-parallel-size 8 --data-parallel-size 32", [
        ("which lifts its quarter to about 0.4", 0.4, 0.05, ratio("exposed_comm", "matmul"))]),
    ("14-putting-it-together.md", "--search --devices 4", [
        ("pp = 2 x dp = 2 already ranks second", 2, 0, rank_of({"pp": 2, "dp": 2})),
        ("(18,022 tokens/s predicted)", 18022, 0.5, tokens_of({"pp": 2, "dp": 2})),
        ("and ranks eighth", 8, 0, rank_of({"pp": 4})),
        ("dp = 4 stays first in both", 1, 0, rank_of({"dp": 4}))]),
    ("14-putting-it-together.md", "--search --devices 4 --global-batch-size 96", [
        ("climbs to third", 3, 0, rank_of({"pp": 4})),
        ("pp = 2 x dp = 2 (m = 4) stays second", 2, 0, rank_of({"pp": 2, "dp": 2})),
        ("dp = 4 stays first in both", 1, 0, rank_of({"dp": 4}))]),
    ("14-putting-it-together.md", f"{GPT_036B} --data-parallel-size 8", [
        ("dp = 8 runs a step in 476 ms", 476, 0.5, lambda r: 1e3 * r["step_s"]),
        ("with 8 ms of all-reduce hidden", 8, 0.5, lambda r: 1e3 * r["stages"][0]["tiers"]["intra"]["seconds"]),
        ("with 8 ms of all-reduce hidden", 0, 0.5, stage("exposed_comm"))]),
    ("14-putting-it-together.md", f"{GPT_036B} --tensor-parallel-size 8", [
        ("tp = 8 takes 1,248 ms", 1248, 0.5, lambda r: 1e3 * r["step_s"]),
        ("with 425 ms of exposed all-reduces", 425, 0.5, stage("exposed_comm")),
        ("against 134 ms of matmuls", 134, 0.5, stage("matmul")),
        ("three times and not one and a half", 3, 0.25, ratio("exposed_comm", "matmul"))]),
    ("15-planning-a-run.md", "--search --devices 8", [
        ("in its 304 ms step", 304, 0.5, lambda r: 1e3 * r["fits"][rank_of({"dp": 8})(r) - 1]["step_s"]),
        ("only 24 in 139 ms", 139, 0.5, lambda r: 1e3 * r["fits"][rank_of({"tp": 4, "dp": 2})(r) - 1]["step_s"])]),
    ("15-planning-a-run.md", "--search --devices 8 --global-batch-size 96", [
        ("dp = 8 still leads (20,201 tokens/s)", 1, 0, rank_of({"dp": 8})),
        ("dp = 8 still leads (20,201 tokens/s)", 20201, 0.5, tokens_of({"dp": 8})),
        ("pipelines pp = 2 x dp = 4 and pp = 4 x dp = 2", 2, 0, rank_of({"pp": 2, "dp": 4})),
        ("pipelines pp = 2 x dp = 4 and pp = 4 x dp = 2", 3, 0, rank_of({"pp": 4, "dp": 2})),
        ("tp = 2 x dp = 4 (about 16,000)", 16000, 500, tokens_of({"tp": 2, "dp": 4})),
        ("then cp = 2 x dp = 4", 16000, 500, tokens_of({"cp": 2, "dp": 4}))]),
    ("15-planning-a-run.md", f"{GPT_145B} --pipeline-parallel-size 4 --data-parallel-size 48", [
        ("Stage 0 peaks at 74,570 MiB (72.8 GiB)", 74570, 0.5, lambda r: r["stages"][0]["total_peak"] / 2**20),
        ("take 69 GiB of it", 69, 0.5,
         lambda r: sum(r["stages"][0][k] for k in ("params", "grads", "optimizer_state")) / 2**30),
        ("5.9% against 6.8% at p = 8", 0.059, 0.0005, lambda r: r["bubble"]),
        ("The step is 23.1 s against 23.2 s", 23.1, 0.05, lambda r: r["step_s"])]),
    ("15-planning-a-run.md", f"{GPT_145B} --pipeline-parallel-size 8 --data-parallel-size 24", [
        ("5.9% against 6.8% at p = 8", 0.068, 0.0005, lambda r: r["bubble"]),
        ("The step is 23.1 s against 23.2 s", 23.2, 0.05, lambda r: r["step_s"])]),
    ("15-planning-a-run.md", GPT_1_3B.replace("--d-model 2048 --n-heads 16", "--d-model 2304 --n-heads 24")
     + " --micro-batch-size 1 --global-batch-size 512 --recompute full --data-parallel-size 32", [
         ("spends 1.99 s of its step in element-wise passes", 1.99, 0.005, stage("elementwise", 1)),
         ("against 1.48 s of matmuls", 1.48, 0.005, stage("matmul", 1))]),
]

H100 = PAPER["h100-80gb-node"]
TP8 = f"{GPT_1_3B} --tensor-parallel-size 8 --data-parallel-size 4 --global-batch-size 512"


def alpha_ms(device):
    """What per-message latency adds to a stage's intra-host time: its seconds less its bytes over the link."""
    return lambda r: 1e3 * (r["stages"][0]["tiers"]["intra"]["seconds"]
                            - r["stages"][0]["tiers"]["intra"]["bytes"] / device.intra_bandwidth)


def bytes_ms(device):
    return lambda r: 1e3 * r["stages"][0]["tiers"]["intra"]["bytes"] / device.intra_bandwidth


CASES += [
    ("20-roofline.md", f"{TP8} --micro-batch-size 1", [
        ("it predicts 915 ms of matmuls", 915, 0.5, stage("matmul")),
        ("and 2.46 s of element-wise passes", 2.46, 0.005, stage("elementwise", 1)),
        ("of its 1,164 ms of exposed communication", 1164, 0.5, stage("exposed_comm")),
        ("the bytes take 614 ms and alpha 543 ms", 614, 0.5, bytes_ms(A100)),
        ("the bytes take 614 ms and alpha 543 ms", 543, 0.5, alpha_ms(A100)),
        ("900 KB x 8 / 8.4 MB = 0.86", 0.86, 0.03,      # the loss's three small all-reduces: alpha, few bytes
         lambda r: alpha_ms(A100)(r) / bytes_ms(A100)(r))]),
    ("20-roofline.md", f"{TP8} --micro-batch-size 16", [
        ("the exposed communication falls to 648 ms", 648, 0.5, stage("exposed_comm")),
        ("of which alpha is 34 ms", 34, 0.5, alpha_ms(A100))]),
    ("20-roofline.md", f"{TP8.replace('a100-80gb-node', 'h100-80gb-node')} --micro-batch-size 1", [
        ("gives 289 ms of matmuls and 958 ms of exposed communication", 289, 0.5, stage("matmul")),
        ("gives 289 ms of matmuls and 958 ms of exposed communication", 958, 0.5, stage("exposed_comm")),
        ("409 ms of bytes and the same 543 ms of alpha", 409, 0.5, bytes_ms(H100)),
        ("409 ms of bytes and the same 543 ms of alpha", 543, 0.5, alpha_ms(H100)),
        ("almost twice the matmuls", 1.9, 0.1, lambda r: alpha_ms(H100)(r) / stage("matmul")(r))]),
] + [("20-roofline.md", f"{TP8} --micro-batch-size {mb}", [
    ("gives those three figures", ms, 0.5, alpha_ms(A100)),
    ("271, 136 and 68 ms", ms, 0.5, alpha_ms(A100))]) for mb, ms in ((2, 271), (4, 136), (8, 68))]


def page_text(page: str) -> str:
    return " ".join((REPO / "docs" / page).read_text().split())


@pytest.mark.parametrize("page, flags, figures", CASES, ids=[f"{p}: {f[-60:]}" for p, f, _ in CASES])
def test_each_quoted_figure_is_what_the_planner_prints(page, flags, figures):
    text, result = page_text(page), planned(flags)
    wrong = []
    for phrase, value, tolerance, get in figures:
        assert phrase in text, f"{page} no longer says {phrase!r}: update this test with the page"
        got = get(result)
        if abs(got - value) > tolerance:
            wrong.append(f"{phrase!r}: the page quotes {value}, `python -m numpitron.plan {flags}` gives {got:.4g}")
    assert not wrong, f"{page}:\n" + "\n".join(wrong)


def test_chapter_15s_table_is_the_paper_reproduced():
    """Every row of chapter 15's Megatron-LM table, as plan/paper.py's reproduce gives it."""
    from numpitron.plan.paper import reproduce
    text = (REPO / "docs" / "15-planning-a-run.md").read_text()
    errors, rows = [], reproduce()
    for r in rows:
        row = (f"| {r['params_b']:.1f} / {r['params_b_eq2']:.1f} | {r['layout']} | {r['tflops_paper']} | "
               f"{r['tflops_predicted']:.0f} | {100 * r['error']:+.0f}% | {r['memory_gb'] * 1e9 / 2**30:.1f} GiB |")
        if row.replace("+0%", "0%").replace("-0%", "0%") not in text:
            errors.append(row)
    assert not errors, "docs/15-planning-a-run.md's table should have these rows:\n" + "\n".join(errors)
    worst = max(abs(r["error"]) for r in rows)
    assert "within 13% of every row" in " ".join(text.split()) and 0.12 < worst <= 0.135


def test_chapter_15s_plan_line_by_line_is_what_the_planner_prints():
    """The report chapter 15 explains line by line, verbatim (this-machine's profile is
    the repository's, so the figures do not depend on where the test runs)."""
    text = (REPO / "docs" / "15-planning-a-run.md").read_text()
    start = text.index("```text\nmodel: 809,856 parameters") + len("```text\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--tensor-parallel-size", "2", "--data-parallel-size", "2"])
    assert text[start:text.index("```", start)] == out.getvalue()
