"""Running an entry point on every rank so that failures never hang.

An exception on one mpi4py rank leaves the others waiting in a collective forever.
`run_main` catches it and ends the job with one message:

* a `UserError` (bad flags, missing data, a corrupt checkpoint) is one line. Such
  errors are found identically on every rank (configuration is validated everywhere
  before any communication; one-rank failures are agreed on first). The ranks check
  that they all failed with a barrier on a communicator kept for this alone, waiting
  at most AGREE_S: then rank 0 prints the line and every rank exits normally, so MPI
  finalizes and cleans up after itself (an aborted MPICH job leaves a shared-memory
  segment in /dev/shm behind). A rank that fails alone prints and aborts the world;
* the reader of our output gone (a broken pipe) ends the job without a word;
* anything else is a bug: the failing rank prints its traceback, tagged with its
  rank, and aborts the world.
"""

import os
import signal
import sys
import time
import traceback

from numpitron.errors import UserError

AGREE_S = 2.0          # how long a failing rank waits for the others to fail too
FINALIZE_S = 10        # seconds: a finalize that hangs (a send nobody receives) is cut short
# MPI_Abort makes the launcher kill every rank at once, and MPICH's launcher can
# drop output a rank wrote just before (seen with stdin not a terminal, as in CI):
# give it a moment to forward the message first.
OUTPUT_DRAIN_S = 0.3


def world_rank_and_size() -> tuple[int, int]:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def run_main(main, argv=None) -> int:
    from mpi4py import MPI
    failures = MPI.COMM_WORLD.Dup()          # used by nothing else, so never mid-collective
    try:
        return main(argv) or 0
    except SystemExit as exit_:
        if exit_.code in (0, None):
            return 0
        _fail(failures, "", is_user_error=True)
    except KeyboardInterrupt:
        _abort("interrupted", is_user_error=True)
    except BrokenPipeError:
        _reader_gone()
    except UserError as error:
        _fail(failures, f"error: {error}", is_user_error=True)
    except BaseException:
        _abort(traceback.format_exc().rstrip(), is_user_error=False)
    return 1


def _all_failed(comm, timeout_s: float) -> bool:
    """True when every rank reached this point within timeout_s."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if request.Test():
            return True
        time.sleep(0.005)
    return False


def _fail(comm, message: str, is_user_error: bool) -> None:
    rank, size = world_rank_and_size()
    if size > 1 and not _all_failed(comm, AGREE_S):
        _abort(message, is_user_error)
    if rank == 0 and message:
        print(message, file=sys.stderr, flush=True)
    # Exit through MPI's finalize; if a pending send keeps it waiting, the alarm's
    # default action ends the process anyway.
    if hasattr(signal, "alarm"):
        signal.alarm(FINALIZE_S)
    sys.exit(1)


def _reader_gone() -> None:
    """Whoever read our output has gone (`python sample.py | head`): end quietly, as a
    command that SIGPIPE ends does, with no traceback and no message. Standard output
    points to /dev/null so that no later flush fails again; the other ranks, perhaps in a
    collective, are ended by the launcher once this process exits."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if world_rank_and_size()[1] > 1:
        os._exit(1)


def _abort(message: str, is_user_error: bool) -> None:
    rank, size = world_rank_and_size()
    if message:
        prefix = "" if (rank == 0 or size == 1) and is_user_error else f"rank {rank}: "
        print(prefix + message, file=sys.stderr, flush=True)
    if size == 1:
        sys.exit(1)
    time.sleep(OUTPUT_DRAIN_S)
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(1)
