"""Intel's MKL, from the `mkl` wheel on PyPI, called through ctypes: its CBLAS `gemm` on
the same arrays NumPy's `@` takes.

    C = alpha op(A) op(B) + beta C,     op(X) = X or X^T         (BLAS's gemm)

NumPy hands its own BLAS (OpenBLAS in the PyPI wheel) every float32 or float64 product;
MKL is another implementation of the same sum, with other kernels, so only the order of
the additions (and with it the last bits) differs. A product reaches MKL only as arrays
it can read in place: each matrix row-major, or the transpose of a row-major one (a
`.T` view is passed as CblasTrans, never copied), with a stride between rows of at
least a row; and stacked matrices (attention's (B, H, T, hd)) equally spaced in memory,
so that one `cblas_?gemm_batch_strided` call runs the whole stack. Anything else (a
reversed or scattered view) is copied first; other dtypes go to NumPy.

MKL runs sequentially (one thread, no OpenMP runtime loaded) when --blas-threads is 1,
the library's default: several ranks share the cores (numpitron/runtime.py). The ILP64
entry points (`_64`) take 64-bit sizes, whatever MKL's default interface layer.
"""

import ctypes
import functools
import importlib.metadata
import math
import os
from pathlib import Path

import numpy as np

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112      # CBLAS's enums (cblas.h)
THREADING_INTEL, THREADING_SEQUENTIAL = 0, 1    # MKL_THREADING_* (mkl_service.h)
GEMMS = {np.dtype(np.float32): ("cblas_sgemm_64", "cblas_sgemm_batch_strided_64", ctypes.c_float),
         np.dtype(np.float64): ("cblas_dgemm_64", "cblas_dgemm_batch_strided_64", ctypes.c_double)}


def library_path() -> Path | None:
    """libmkl_rt (mkl_rt.N.dll on Windows) of the installed `mkl` wheel, or None."""
    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        name = Path(str(file)).name
        if name.startswith(("libmkl_rt.so", "libmkl_rt.", "mkl_rt.")) and not name.endswith((".lib", ".a")):
            path = Path(file.locate()).resolve()
            if path.exists():
                return path
    return None


class MklVersion(ctypes.Structure):
    """MKLVersion of mkl_service.h: Processor names the kernels chosen for this CPU."""
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("update", ctypes.c_int),
                ("status", ctypes.c_char_p), ("build", ctypes.c_char_p), ("processor", ctypes.c_char_p),
                ("platform", ctypes.c_char_p)]


class Mkl:
    """The loaded library: `gemm` for float32 and float64, and what it says it is."""

    def __init__(self, path: Path, threads: int = 1):
        lib = ctypes.CDLL(str(path))
        # Before any other MKL call, or MKL has picked its threading layer already.
        lib.MKL_Set_Threading_Layer(THREADING_SEQUENTIAL if threads == 1 else THREADING_INTEL)
        lib.MKL_Set_Num_Threads(ctypes.c_int(threads))
        self.threads = threads
        self.calls = {}
        size, ptr = ctypes.c_int64, ctypes.c_void_p
        for dtype, (single, batched, scalar) in GEMMS.items():
            one, many = getattr(lib, single), getattr(lib, batched)
            one.restype = many.restype = None
            # layout, trans a, trans b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc
            one.argtypes = [ctypes.c_int] * 3 + [size] * 3 + [scalar, ptr, size, ptr, size, scalar, ptr, size]
            # the same with each matrix's stride and the batch's size after the leading dimensions
            many.argtypes = ([ctypes.c_int] * 3 + [size] * 3 + [scalar, ptr, size, size, ptr, size, size, scalar,
                                                                 ptr, size, size, size])
            self.calls[dtype] = (one, many)
        version = MklVersion()
        lib.MKL_Get_Version(ctypes.byref(version))
        self.version = f"{version.major}.{version.minor}.{version.update}"
        self.kernel = (version.processor or b"").decode(errors="replace").strip()

    def describe(self) -> dict:
        return {"blas": "mkl", "version": self.version, "kernel": self.kernel, "threads": self.threads}

    def gemm(self, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None, beta: float = 0.0) -> np.ndarray:
        """out = a @ b + beta out, for matrices or equal stacks of them (NumPy's `@`
        without broadcasting); out is allocated when not given (beta must then be 0)."""
        calls = self.calls.get(a.dtype)
        shape = a.shape[:-1] + b.shape[-1:]
        if (calls is None or b.dtype != a.dtype or a.ndim != b.ndim or a.ndim < 2 or a.shape[:-2] != b.shape[:-2]
                or a.shape[-1] != b.shape[-2] or 0 in a.shape or 0 in b.shape
                or (out is not None and (out.shape != shape or out.dtype != a.dtype))):
            return _numpy_gemm(a, b, out, beta)            # NumPy's rules, and its errors
        target = out
        if out is None:
            target = np.empty(shape, a.dtype)
        elif np.may_share_memory(out, a) or np.may_share_memory(out, b) or not _writable_in_place(out):
            target = np.empty(shape, a.dtype)
            if beta:
                target[...] = out
        (a, trans_a, lda, stride_a), (b, trans_b, ldb, stride_b) = _readable(a), _readable(b)
        m, k, n = shape[-2], a.shape[-1], shape[-1]
        ldc, stride_c = target.strides[-2] // target.itemsize, _batch_stride(target)
        one, many = calls
        batch = math.prod(shape[:-2])
        if batch == 1:
            one(ROW_MAJOR, trans_a, trans_b, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb, beta,
                target.ctypes.data, ldc)
        else:
            many(ROW_MAJOR, trans_a, trans_b, m, n, k, 1.0, a.ctypes.data, lda, stride_a, b.ctypes.data, ldb,
                 stride_b, beta, target.ctypes.data, ldc, stride_c, batch)
        if target is not out and out is not None:
            out[...] = target
            return out
        return target


def _numpy_gemm(a, b, out, beta):
    if out is None:
        return a @ b
    if beta:
        out += a @ b
        return out
    return np.matmul(a, b, out=out)


def _batch_stride(x: np.ndarray) -> int | None:
    """Elements between consecutive matrices of a stack whose leading axes flatten to one
    equally spaced axis; 0 for a single matrix; None when they do not."""
    if x.ndim == 2:                     # a linear layer's operands: most calls, kept cheap
        return 0
    lead = [(n, s) for n, s in zip(x.shape[:-2], x.strides[:-2]) if n > 1]
    if not lead:
        return 0
    matrix = x.strides[-2] * (x.shape[-2] - 1) + x.strides[-1] * (x.shape[-1] - 1) + x.itemsize
    step = lead[-1][1]
    for (_, outer), (n, inner) in zip(lead[:-1], lead[1:]):
        if outer != inner * n:
            return None
    # matrices must not overlap, nor run backwards
    return step // x.itemsize if step >= matrix and step % x.itemsize == 0 else None


def _matrix_layout(x: np.ndarray):
    """(trans, leading dimension) that describe x's last two axes to BLAS, or None."""
    rows, cols = x.shape[-2:]
    row_step, col_step = x.strides[-2], x.strides[-1]
    item = x.itemsize
    if (col_step == item or cols == 1) and row_step % item == 0 and row_step >= cols * item:
        return NO_TRANS, max(row_step // item, cols, 1)
    if (row_step == item or rows == 1) and col_step % item == 0 and col_step >= rows * item:
        return TRANS, max(col_step // item, rows, 1)        # a transposed row-major matrix
    return None


def _readable(x: np.ndarray):
    """(array, trans, leading dimension, batch stride) for BLAS to read in place, copying x when it must."""
    layout, stride = _matrix_layout(x), _batch_stride(x)
    if layout is None or stride is None:
        x = np.ascontiguousarray(x)
        layout, stride = _matrix_layout(x), _batch_stride(x)
    return (x, *layout, stride)


def _writable_in_place(out: np.ndarray) -> bool:
    """out is row-major matrices, equally spaced: BLAS can write it as it is."""
    layout = _matrix_layout(out)
    return (out.flags.writeable and layout is not None and layout[0] == NO_TRANS
            and out.strides[-2] // out.itemsize == layout[1] and _batch_stride(out) is not None)


@functools.cache
def load(threads: int | None = None) -> Mkl | None:
    """MKL from the installed wheel, or None when it is not installed. threads: the BLAS
    threads of this process (default: MKL_NUM_THREADS, else 1)."""
    path = library_path()
    if path is None:
        return None
    if threads is None:
        threads = int(os.environ.get("MKL_NUM_THREADS") or 1)
    return Mkl(path, threads)
