"""The planner as a user runs it: `python -m numpitron.plan` rejects a layout that cannot
work with the one line training gives, its search ranks the layouts and says why the
others fail, and the paper's Table 1 is planned row by row."""

import pytest


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
