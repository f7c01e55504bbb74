"""Process set-up that must happen before NumPy or MPI is initialised.

Imports nothing heavy, so entry points can call it first thing.

* One BLAS thread per process: several ranks share the cores, and two ranks that
  each run BLAS on two threads collapse to a fraction of one thread's speed.
  `--blas-threads N` (on the command line or in its --config file) or an already-set
  OPENBLAS_NUM_THREADS/OMP_NUM_THREADS wins.
* When a host runs more ranks than it has cores, MPICH ranks waiting in MPI spin
  a whole core and starve the ones doing work; MPIR_CVAR_ENABLE_HEAVY_YIELD makes
  them yield instead. It slows small collectives, so it is only set when
  oversubscribed (and never if the user set it; benchmarks/README.md has the measurement).
* glibc is told to keep freed memory instead of handing it back to the OS. With its
  defaults every step's activations (several MB) are unmapped when freed and
  page-faulted in again by the next step, in the kernel (the speed appendix of docs/).
"""

import argparse
import ctypes
import ctypes.util
import os

from numpitron.config_fields import parsed_toml       # the standard library only, as errors.py: safe before NumPy
from numpitron.errors import UserError

BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
YIELD_VAR = "MPIR_CVAR_ENABLE_HEAVY_YIELD"


def blas_threads_from_argv(argv: list[str]) -> str | None:
    """--blas-threads from the command line, else [mesh] blas_threads of its --config
    file. The file is read by the argument parser's own reader (config_fields.py), which
    keeps what it parsed for the parser. None when neither sets it, or when the command
    line or the file cannot be read: the parser reports that, in one line."""
    try:
        # --blas (blas/setting.py) named too: argparse would take it for short for --blas-threads
        given = prescan(argv, "--blas-threads", "--config", "--blas")
        if given.blas_threads is not None or given.config is None:
            return given.blas_threads
        mesh = parsed_toml(given.config).get("mesh")
    except UserError:
        return None
    value = mesh.get("blas_threads") if isinstance(mesh, dict) else None
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else None


def prescan(argv, *options: str) -> argparse.Namespace:
    """These options' values in a command line (None when absent), read before the real
    parse: --blas-threads and --config here, --config for the argument parser (cli.py)."""
    parser = _Prescan(add_help=False)
    for option in options:
        parser.add_argument(option)
    return parser.parse_known_args(argv)[0]


class _Prescan(argparse.ArgumentParser):
    def error(self, message):                   # e.g. --config without its file: one line, not an exit
        raise UserError(message)


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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8       # from glibc's <malloc.h>


def keep_freed_memory() -> bool:
    """Pin glibc's mmap and trim thresholds (32 MiB, 1 GiB), so that freed buffers
    stay in the heap for the next step. Both at once: setting either one turns off
    glibc's dynamic adjustment of both. And one arena for every thread: a paired chunk's
    new thread (chunk_pairing/pair.py) would get an arena whose freed memory glibc gives
    back, to fault in again at the next pair. False where it does not apply (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
                    and libc.mallopt(M_ARENA_MAX, 1))
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


def launch_env(ranks: int) -> dict:
    """The environment in which to launch `ranks` ranks on this host for a measurement:
    this process's, less a yield setting inherited from the shell when the ranks fit the
    cores, so that each rank decides it as `configure_process` does. Inherited by two ranks
    on two cores, it made the default model's 3.24 MB gradient all-reduce three times
    slower and a one-value all-reduce fifteen (benchmarks/README.md)."""
    env = dict(os.environ)
    if ranks <= usable_cores():
        env.pop(YIELD_VAR, None)
    return env
