"""Running an entry point on every rank so that failures never hang.

An exception on one mpi4py rank leaves the others waiting in a collective forever.
`run_main` catches it, prints one message, and aborts the whole world, so every
rank exits non-zero within moments:

* a `UserError` (bad flags, missing data, a corrupt checkpoint) is one line. When
  every rank raises it (configuration is validated identically everywhere), rank 0
  prints it and aborts; the others wait a moment first, so the message is usually
  printed once, not once per rank;
* anything else is a bug: the failing rank prints its traceback, tagged with its rank.
"""

import sys
import time
import traceback

from numpitron.errors import UserError

PEER_GRACE_S = 1.0
# MPI_Abort makes the launcher kill every rank at once, and MPICH's launcher can
# drop output a rank wrote just before (seen with stdin not a terminal, as in CI):
# give it a moment to forward the message first.
OUTPUT_DRAIN_S = 0.3


def world_rank_and_size() -> tuple[int, int]:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def run_main(main, argv=None) -> int:
    try:
        return main(argv) or 0
    except SystemExit as exit_:
        if exit_.code in (0, None):
            return 0
        _abort_others(f"exit status {exit_.code}", is_user_error=True, quiet=True)
    except KeyboardInterrupt:
        _abort_others("interrupted", is_user_error=True)
    except UserError as error:
        _abort_others(f"error: {error}", is_user_error=True)
    except BaseException:
        _abort_others(traceback.format_exc().rstrip(), is_user_error=False)
    return 1


def _abort_others(message: str, is_user_error: bool, quiet: bool = False) -> None:
    rank, size = world_rank_and_size()
    if size == 1:
        if not quiet:
            print(message, file=sys.stderr, flush=True)
        sys.exit(1)
    if is_user_error and rank != 0:
        time.sleep(PEER_GRACE_S)    # rank 0 most likely has the same message to give
    if not quiet:
        prefix = "" if rank == 0 and is_user_error else f"rank {rank}: "
        print(prefix + message, file=sys.stderr, flush=True)
        time.sleep(OUTPUT_DRAIN_S)
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(1)
