"""Process set-up that must happen before NumPy or MPI is initialised.

Imports nothing heavy, so entry points can call it first thing.

* One BLAS thread per process: several ranks share the cores, and two ranks that
  each run BLAS on two threads collapse to a fraction of one thread's speed.
  `--blas-threads N` or an already-set OPENBLAS_NUM_THREADS/OMP_NUM_THREADS wins.
* When a host runs more ranks than it has cores, MPICH ranks waiting in MPI spin
  a whole core and starve the ones doing work; MPIR_CVAR_ENABLE_HEAVY_YIELD makes
  them yield instead. It slows small collectives, so it is only set when
  oversubscribed (and never if the user set it; benchmarks/README.md has the measurement).
* glibc is told to keep freed memory instead of handing it back to the OS. With its
  defaults every step's activations (several MB) are unmapped when freed and
  page-faulted in again by the next step, in the kernel (the speed appendix of docs/).
"""

import ctypes
import ctypes.util
import os

BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
YIELD_VAR = "MPIR_CVAR_ENABLE_HEAVY_YIELD"


def blas_threads_from_argv(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--blas-threads" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--blas-threads="):
            return arg.split("=", 1)[1]
    return _blas_threads_in_config(argv)


def _blas_threads_in_config(argv: list[str]) -> str | None:
    """[mesh] blas_threads of a --config file (config_file.py); a file that cannot be
    read is left for the argument parser to report."""
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if path is not None:
            try:
                import tomllib
                with open(path, "rb") as f:
                    value = tomllib.load(f).get("mesh", {}).get("blas_threads")
            except Exception:           # missing file, bad TOML, old Python: the parser says which
                return None
            return str(value) if isinstance(value, int) and not isinstance(value, bool) else None
    return None


def ranks_on_this_host() -> int:
    """Ranks the launcher placed on this host (MPICH: MPI_LOCALNRANKS; Open MPI:
    OMPI_COMM_WORLD_LOCAL_SIZE); 1 when run without a launcher."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3       # from glibc's <malloc.h>


def keep_freed_memory() -> bool:
    """Pin glibc's mmap and trim thresholds (32 MiB, 1 GiB), so that freed buffers
    stay in the heap for the next step. Both at once: setting either one turns off
    glibc's dynamic adjustment of both. False where it does not apply (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError, TypeError):
        return False


def configure_process(argv: list[str], tune_malloc: bool = True) -> None:
    if tune_malloc:
        keep_freed_memory()
    threads = blas_threads_from_argv(argv)
    for var in BLAS_VARS:
        if threads is not None:
            os.environ[var] = threads
        else:
            os.environ.setdefault(var, "1")
    if ranks_on_this_host() > usable_cores():
        os.environ.setdefault(YIELD_VAR, "1")
