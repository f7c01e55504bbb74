"""numpitron/reference.py, the whole GPT in plain NumPy, against the library: the same
run, iteration by iteration, and its own backward against finite differences."""

import ast
import json
import subprocess
import sys

import numpy as np

from numpitron import reference
from tests.conftest import REPO
from tests.harness import PYTHON, TINY_FLAGS, train_script
from tests.layer_checks import numeric_grad
from tests.tolerances import EQUIV_RTOL_FLOAT64, FD_ATOL, FD_RTOL, rel_diff

# Two micro-batches of 4 per step (accumulation); eval at 5 and at the end (6).
RUN = ["--max-iters", "6", "--global-batch-size", "8"]
COMPARED = ("train_loss", "lr", "grad_norm", "val_loss", "eval_train_loss")


def reference_flags():
    """TINY_FLAGS without the two about logging, which the reference has no use for."""
    flags = list(TINY_FLAGS)
    flags.remove("--no-progress")
    at = flags.index("--log-interval")
    return flags[:at] + flags[at + 2:]


def test_reference_trains_as_train_shakespeare_does_in_float64(data_dir, tmp_path):
    assert train_script(data_dir, tmp_path, *RUN).returncode == 0
    logged = {r["iter"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    command = [PYTHON, "-m", "numpitron.reference", *reference_flags(), *RUN, "--data-dir", str(data_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    ours = {r["iter"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert sorted(ours) == sorted(logged) == list(range(1, 7))
    for key in COMPARED:
        rows = [i for i in logged if key in logged[i]]
        assert rows == [i for i in ours if key in ours[i]], key
        assert rel_diff([ours[i][key] for i in rows], [logged[i][key] for i in rows]) <= EQUIV_RTOL_FLOAT64, key
    assert max(r["grad_norm"] for r in ours.values()) > 1.0        # clipping took part


def test_reference_backward_equals_finite_differences():
    cfg = reference.GPTConfig(vocab_size=11, seq_len=6, n_layers=2, n_heads=2, d_model=8)
    rng = np.random.default_rng(0)
    params = reference.init_params(cfg, seed=3, dtype=np.float64)
    for p in params.values():                  # away from init: gains off 1, biases off 0
        p += 0.1 * rng.normal(size=p.shape)
    ids = rng.integers(0, cfg.vocab_size, size=(3, cfg.seq_len + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    loss, cache = reference.gpt_forward(params, cfg, x, y)
    grads = reference.gpt_backward(params, cfg, cache, dloss=1.0)
    assert grads.keys() == params.keys()
    moved = 0
    for name, p in params.items():
        indices = rng.choice(p.size, size=min(p.size, 4), replace=False)
        numeric = numeric_grad(lambda: reference.gpt_forward(params, cfg, x, y)[0], 1.0, p, indices)
        np.testing.assert_allclose(grads[name].flat[indices], numeric, rtol=FD_RTOL, atol=FD_ATOL, err_msg=name)
        moved += np.any(numeric != 0)
    assert moved > len(params) // 2, "finite differences mostly zero: the check is vacuous"


def test_reference_stands_alone():
    """NumPy and the standard library only, and under the 800 lines its issue allows."""
    source = (REPO / "numpitron/reference.py").read_text()
    assert len(source.splitlines()) < 800
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) == {"numpy"}, imported
