"""A job in which rank 1 fails while every other rank waits in a collective."""

import sys

from numpitron.distributed.launch import run_main


def main(argv=None):
    from mpi4py import MPI
    import numpy as np

    world = MPI.COMM_WORLD
    if world.Get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1")
    world.Allreduce(MPI.IN_PLACE, np.ones(4))   # would wait forever without the abort
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
