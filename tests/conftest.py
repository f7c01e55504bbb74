"""Test set-up shared by the whole suite.

Multi-rank tests use mpi-pytest: `@pytest.mark.parallel(nprocs=N)` re-runs the test
under `mpiexec -n N`. A deadlock must fail fast rather than hang CI, so every test
has a time limit, shorter inside the spawned ranks (whose timeout kills one rank
and MPICH then tears down the rest) than in the parent that waits for them.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# mpi-pytest launches `mpiexec` from PATH: use the one installed beside this Python.
os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")

IN_SPAWNED_RANK = "_PYTEST_MPI_CHILD_PROCESS" in os.environ
RANK_TIMEOUT_S = 120
PARENT_TIMEOUT_S = 180
REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(RANK_TIMEOUT_S if IN_SPAWNED_RANK else PARENT_TIMEOUT_S,
                                                method="thread" if IN_SPAWNED_RANK else "signal"))


def shakespeare_text_path() -> Path:
    """The Tiny Shakespeare text beside the checkout (CI) or in data/."""
    for candidate in (REPO.parent / "shared/data/tinyshakespeare.txt", REPO / "data/tinyshakespeare.txt"):
        if candidate.exists():
            return candidate
    pytest.fail("tinyshakespeare.txt not found in ../shared/data or data/; see README")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A data directory holding only tinyshakespeare.txt, for the command-line tests."""
    path = tmp_path_factory.mktemp("data")
    shutil.copy(shakespeare_text_path(), path / "tinyshakespeare.txt")
    return path


@pytest.fixture
def shared_dir(request):
    """One directory for all ranks (tmp_path differs per rank): made by rank 0 under
    /tmp from the test's name, its path broadcast, removed once every rank is done."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    path = None
    if comm.rank == 0:
        path = Path(tempfile.gettempdir()) / f"numpitron-{request.node.name}-{os.getpid()}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    path = Path(comm.bcast(str(path) if path else None, root=0))
    yield path
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
