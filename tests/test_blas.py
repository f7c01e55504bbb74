"""--blas: another BLAS for the layers' products (numpitron/blas/), held to NumPy's `@`.

The mkl wheel is in the dev extra on x86-64, where it exists; elsewhere these tests
have nothing to run."""

import json
import platform

import numpy as np
import pytest

from numpitron.blas import mkl, setting
from numpitron.blas.products import BlasMatmul, layers_with_products, numpy_blas
from numpitron.config import ParallelConfig
from numpitron.errors import UserError
from numpitron.nn.matmul import PLAIN
from numpitron.runtime import blas_threads_from_argv
from tests.harness import SMALLER, make_trainer, run, tiny_model, tiny_train, train_script
from tests.tolerances import KERNEL_RTOL_FLOAT32, rel_diff

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the mkl wheel exists for x86-64 only")
FLOAT64_RTOL = 1e-12          # the same sums in another order: a few float64 roundings apart


def operands(dtype, rng):
    """(a, b) pairs of every layout a product meets: row-major, transposed views, row
    slices, column slices (a stride wider than a row), a reversed view (copied), and
    stacks of attention's shapes with sliced and transposed keys."""
    a, b = rng.standard_normal((9, 7)).astype(dtype), rng.standard_normal((7, 5)).astype(dtype)
    q, k = (rng.standard_normal((2, 3, 12, 4)).astype(dtype) for _ in range(2))
    return [(a, b), (a.T.copy().T, b), (a, b.T.copy().T), (a[2:7], b), (a[:, :6], b[:6]), (a[::-1], b[:, ::2]),
            (a[:, 3:4], b[3:4]), (q[:, :, 4:9], k[:, :, :7].transpose(0, 1, 3, 2)),
            (q.transpose(1, 0, 2, 3), k.transpose(1, 0, 3, 2)), (q[:, :1, :5], k[:, :1, :5].transpose(0, 1, 3, 2))]


@pytest.mark.parametrize("dtype, rtol", [(np.float64, FLOAT64_RTOL), (np.float32, KERNEL_RTOL_FLOAT32)])
def test_mkl_gemm_equals_numpy_on_every_layout(dtype, rtol):
    library = mkl.load()
    assert library is not None, "pip install mkl (the dev extra)"
    for a, b in operands(dtype, np.random.default_rng(0)):
        got = library.gemm(a, b)
        assert got.dtype == dtype and got.shape == (a @ b).shape
        assert rel_diff(got, a @ b) <= rtol, (a.shape, a.strides, b.strides)


@pytest.mark.parametrize("dtype, rtol", [(np.float64, FLOAT64_RTOL), (np.float32, KERNEL_RTOL_FLOAT32)])
def test_mkl_writes_into_and_adds_to_views(dtype, rtol):
    library, rng = mkl.load(), np.random.default_rng(1)
    q, k = (rng.standard_normal((2, 3, 12, 4)).astype(dtype) for _ in range(2))
    start = rng.standard_normal((2, 3, 16, 4)).astype(dtype)
    scores = q[:, :, 3:8] @ k.transpose(0, 1, 3, 2)                       # (2, 3, 5, 12)
    for beta in (0.0, 1.0):
        out = start.copy()
        library.gemm(scores, k, out[:, :, 6:11], beta=beta)               # rows 6..10 only
        expected = start.copy()
        expected[:, :, 6:11] = beta * start[:, :, 6:11] + scores @ k
        assert rel_diff(out, expected) <= rtol
    grad = rng.standard_normal((7, 5)).astype(dtype)
    x, dy = rng.standard_normal((9, 7)).astype(dtype), rng.standard_normal((9, 5)).astype(dtype)
    expected = grad + x.T @ dy
    BlasMatmul(library).add_weight_grad(x, dy, grad)                     # accumulated by the gemm (beta 1)
    assert rel_diff(grad, expected) <= rtol
    a = rng.standard_normal((4, 4)).astype(dtype)
    b = a.copy()
    library.gemm(a, a, a)                                                 # out is an input: still a @ a
    assert rel_diff(a, b @ b) <= rtol


def test_other_dtypes_and_mismatches_are_numpys():
    library = mkl.load()
    ints = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(library.gemm(ints, ints.T), ints @ ints.T)
    with pytest.raises(ValueError):
        library.gemm(np.ones((2, 3)), np.ones((2, 3)))                   # NumPy's own error


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_training_with_mkl_equals_numpy_in_float64(optimizer):
    """Every product of a few steps (linear layers, attention, the weight gradients
    summed in place) through MKL: the run is NumPy's to float64 roundings. The
    parameters are compared under SGD: AdamW divides each gradient by its own RMS, and
    the key bias's gradient is zero but for roundings (softmax ignores a shift of a
    whole row of scores), which AdamW's step scales up to the learning rate."""
    model, train = tiny_model(**SMALLER), tiny_train(max_iters=4, optimizer=optimizer)
    losses, norms, params, _ = run(make_trainer(model, train), steps=4)
    trainer = make_trainer(model, train, blas="mkl")
    assert trainer.blas["blas"] == "mkl" and trainer.blas["version"]
    swapped = layers_with_products(trainer.model)
    assert len(swapped) == 2 * 5 and all(isinstance(layer.matmul, BlasMatmul) for layer in swapped)
    got_losses, got_norms, got_params, _ = run(trainer, steps=4)
    assert rel_diff(got_losses, losses) <= FLOAT64_RTOL and rel_diff(got_norms, norms) <= FLOAT64_RTOL
    if optimizer == "sgd":
        assert max(rel_diff(got_params[name], params[name]) for name in params) <= FLOAT64_RTOL


def test_numpy_is_the_default_and_leaves_the_plain_products():
    trainer = make_trainer(tiny_model(**SMALLER), tiny_train())
    assert trainer.blas["blas"] == "numpy"
    assert all(layer.matmul is PLAIN for layer in layers_with_products(trainer.model))


def test_auto_takes_mkl_when_installed_on_an_intel_cpu_and_numpy_when_not(monkeypatch):
    monkeypatch.setattr(setting, "intel_cpu", lambda: True)
    assert ParallelConfig(blas="auto").resolved_blas() == "mkl"
    monkeypatch.setattr(setting, "intel_cpu", lambda: False)
    assert ParallelConfig(blas="auto").resolved_blas() == "numpy"
    monkeypatch.setattr(setting, "intel_cpu", lambda: True)
    monkeypatch.setattr(setting, "library_path", lambda: None)
    assert ParallelConfig(blas="auto").validate().resolved_blas() == "numpy"


def test_mkl_asked_for_but_absent_is_one_line(monkeypatch):
    monkeypatch.setattr(setting, "library_path", lambda: None)
    with pytest.raises(UserError, match=r"^--blas mkl: the mkl package is not installed") as error:
        ParallelConfig(blas="mkl").validate()
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="unknown --blas"):
        ParallelConfig(blas="blis").validate()


def test_the_blas_flag_is_not_taken_for_blas_threads():
    assert blas_threads_from_argv(["--blas", "mkl"]) is None
    assert blas_threads_from_argv(["--blas", "mkl", "--blas-threads", "2"]) == "2"


def test_numpy_names_its_library_and_kernel():
    info = numpy_blas()
    assert info["blas"] == "numpy" and info["library"]
    if "openblas" in info["library"]:
        assert info["kernel"] and info["threads"] >= 1              # e.g. Haswell, SkylakeX, Zen


def test_the_first_metrics_row_names_the_blas(data_dir, tmp_path):
    result = train_script(data_dir, tmp_path, "--max-iters", "2", "--blas", "mkl")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["blas"]["blas"] == "mkl" and rows[0]["blas"]["kernel"]
    assert all("blas" not in row for row in rows[1:])
