"""The chosen BLAS, installed on a built stage.

Every product of a linear layer and of attention goes through its layer's `matmul`
object (nn/matmul.py's `PlainMatmul`, NumPy's `@`). `use_blas` gives each layer that
still has the plain one a `BlasMatmul` instead: the same products, each one call of
another library's gemm. The layers never know which ran; FP8's products, installed
earlier (precision/fp8.py), are kept. `describe` says which library and which of its
kernels ran: the same model runs at other speeds on other BLAS kernels, so a throughput
figure means little without them (metrics.jsonl's first row, benchmarks/benchmark.py).
"""

import ctypes
import os
from pathlib import Path

import numpy as np

from numpitron.blas import mkl
from numpitron.nn.layer import Layer
from numpitron.nn.matmul import PLAIN, PlainMatmul


class BlasMatmul(PlainMatmul):
    """PlainMatmul's products through `library.gemm` (out = a @ b + beta out)."""

    def __init__(self, library):
        self.library, self.gemm = library, library.gemm

    def forward(self, x, w):
        return self.gemm(x, w)

    def input_grad(self, dy, w):
        return self.gemm(dy, w.T)                       # W^T read in place (CblasTrans), not copied

    def weight_grad(self, x, dy):
        return self.gemm(x.T, dy)

    def add_weight_grad(self, x, dy, grad):
        self.gemm(x.T, dy, grad, beta=1.0)              # summed into the gradient by the gemm itself

    def product(self, a, b, out=None):
        return self.gemm(a, b, out)

    def add_product(self, a, b, out):
        self.gemm(a, b, out, beta=1.0)


def layers_with_products(root) -> list:
    """Every layer under root (itself included) that multiplies through a `matmul` object."""
    found, seen, todo = [], set(), [root]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (list, tuple)):
            todo += item
        elif isinstance(item, Layer) or hasattr(item, "layers"):
            if isinstance(getattr(item, "matmul", None), PlainMatmul):
                found.append(item)
            todo += [v for v in vars(item).values() if isinstance(v, (Layer, list, tuple)) or hasattr(v, "layers")]
    return found


def use_blas(model, name: str) -> dict:
    """Install BLAS `name` ("numpy" or "mkl", as BlasSetting.resolved_blas gives it) on
    the stage (and its experts); returns `describe`'s answer for it."""
    if name == "numpy":
        return numpy_blas()
    library = mkl.load()
    matmul = BlasMatmul(library)
    for layer in layers_with_products([model, model.experts]):
        if layer.matmul is PLAIN:
            layer.matmul = matmul
    return library.describe()


def gemm_of(name: str):
    """f(a, b, out=None): a @ b by BLAS `name` ("numpy" or "mkl"), to time it alone."""
    return np.matmul if name == "numpy" else mkl.load().gemm


def numpy_blas() -> dict:
    """NumPy's BLAS as its build names it, with OpenBLAS's kernel for this CPU (its core
    name: Haswell, SkylakeX, Zen...) when NumPy carries OpenBLAS."""
    info = {"blas": "numpy"}
    try:
        built = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        info.update(library=built.get("name"), version=built.get("version"))
    except Exception:               # an old NumPy, or a build that does not say: the kernel may still tell
        pass
    core = openblas_core()
    if core:
        info["kernel"], info["threads"] = core
    return info


def openblas_core() -> tuple[str, int] | None:
    """(core name, threads) from the OpenBLAS NumPy carries (numpy.libs/, numpy/.dylibs/), or None."""
    here = Path(np.__file__).parent
    for path in sorted([*here.parent.glob("numpy.libs/*openblas*"), *here.glob(".dylibs/*openblas*")]):
        try:
            lib = ctypes.CDLL(str(path))        # already loaded by NumPy: the same handle
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "64_"), ("openblas", "")):
            corename = getattr(lib, f"{prefix}_get_corename{suffix}", None)
            threads = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            if corename is not None:
                corename.restype = ctypes.c_char_p
                count = threads() if threads is not None else int(os.environ.get("OPENBLAS_NUM_THREADS") or 0)
                return corename().decode(errors="replace").strip(), count
    return None
