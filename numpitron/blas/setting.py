"""--blas: which BLAS runs the linear layers' and attention's products.

numpy: NumPy's `@` (OpenBLAS in the PyPI wheel), the reference every other is tested
against. mkl: the `mkl` wheel's CBLAS through ctypes (blas/mkl.py; `pip install
numpitron[mkl]`). auto: mkl when it is installed and the CPU is Intel's, else numpy: on
other CPUs MKL runs its generic path, which on an AMD EPYC with AVX-512 made the default
model's step 0.93 as fast as OpenBLAS's (appendix A, "Which BLAS"). The check runs on every rank
alike, before any communication, so a missing library is one line and no hang.
"""

from dataclasses import dataclass

from numpitron.blas.mkl import library_path
from numpitron.config_fields import setting
from numpitron.errors import UserError

BLAS_CHOICES = ("numpy", "mkl", "auto")


@dataclass(frozen=True)
class BlasSetting:
    """A config's --blas (config.py's ParallelConfig takes it)."""

    blas: str = setting("numpy", "the BLAS of the layers' products: NumPy's, MKL's (the mkl wheel), or auto: MKL "
                                 "when installed on an Intel CPU", choices=BLAS_CHOICES)

    def check_blas(self) -> None:
        if self.blas not in BLAS_CHOICES:
            raise UserError(f"unknown --blas {self.blas!r}; choose one of {', '.join(BLAS_CHOICES)}")
        if self.blas == "mkl" and library_path() is None:
            raise UserError("--blas mkl: the mkl package is not installed (pip install mkl), or use --blas numpy")

    def resolved_blas(self) -> str:
        """numpy or mkl: what --blas auto comes to on this machine."""
        if self.blas != "auto":
            return self.blas
        return "mkl" if library_path() is not None and intel_cpu() else "numpy"


def intel_cpu() -> bool:
    """Whether MKL would find its own vendor's CPU (Linux's /proc/cpuinfo; False elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in cpuinfo)
    except OSError:
        return False
