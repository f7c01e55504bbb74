"""Collectives over NumPy buffers, with a byte count for every call.

Thin wrappers over mpi4py's buffer methods (upper-case: no pickling). Each call
adds the bytes one rank moves under the usual ring algorithms to a shared
`CommStats`, so a run can report its communication volume and tests can check
it against the formula for each parallel strategy:

    all_reduce      2 (n-1)/n * bytes(buffer)     (reduce-scatter + all-gather)
    reduce_scatter    (n-1)/n * bytes(full input)
    all_gather        (n-1)/n * bytes(full output)
    send / recv               bytes(buffer)

On a communicator of size 1 every collective is a no-op that counts nothing, so a
single process runs the same code as a mesh.
"""

from collections import defaultdict

import numpy as np


class CommStats:
    """Bytes and calls per collective kind, shared by all communicators of a topology."""

    def __init__(self):
        self.bytes = defaultdict(float)
        self.calls = defaultdict(int)

    def add(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    def snapshot(self) -> dict:
        return {kind: {"bytes": self.bytes[kind], "calls": self.calls[kind]} for kind in sorted(self.bytes)}

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


class Comm:
    """One communicator (tp, dp, pp, ...) with the collectives the library uses."""

    def __init__(self, mpi_comm, stats: CommStats, name: str):
        self.mpi = mpi_comm
        self.stats = stats
        self.name = name
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        self.size = 1 if mpi_comm is None else mpi_comm.Get_size()

    def __repr__(self) -> str:
        return f"Comm({self.name}, rank {self.rank} of {self.size})"

    def _count(self, kind: str, nbytes: float) -> None:
        self.stats.add(f"{self.name}.{kind}", nbytes)

    def all_reduce(self, buf: np.ndarray, op: str = "sum") -> np.ndarray:
        """In-place reduction of `buf` over the group (op: sum or max)."""
        if self.size > 1:
            from mpi4py import MPI
            self.mpi.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX if op == "max" else MPI.SUM)
            self._count("all_reduce", 2 * (self.size - 1) / self.size * buf.nbytes)
        return buf

    def reduce_scatter(self, full: np.ndarray, shard: np.ndarray) -> np.ndarray:
        """Sum `full` over the group; this rank receives its 1/n slice into `shard`."""
        if self.size > 1:
            from mpi4py import MPI
            self.mpi.Reduce_scatter_block(full, shard, op=MPI.SUM)
            self._count("reduce_scatter", (self.size - 1) / self.size * full.nbytes)
        else:
            shard[...] = full
        return shard

    def all_gather(self, full: np.ndarray) -> np.ndarray:
        """In place: rank r's slice r of `full` is filled in on every rank."""
        if self.size > 1:
            from mpi4py import MPI
            self.mpi.Allgather(MPI.IN_PLACE, full)
            self._count("all_gather", (self.size - 1) / self.size * full.nbytes)
        return full

    def gather(self, shard: np.ndarray, full: np.ndarray | None, root: int = 0):
        """Concatenate every rank's `shard` along axis 0 into `full` on `root`."""
        if self.size > 1:
            self.mpi.Gather(shard, full, root=root)
            self._count("gather", shard.nbytes)
        else:
            full[...] = shard
        return full

    def broadcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        if self.size > 1:
            self.mpi.Bcast(buf, root=root)
            self._count("broadcast", buf.nbytes)
        return buf

    def broadcast_object(self, obj, root: int = 0):
        """Small control data only (a config, an error message): never in a hot path."""
        return obj if self.size == 1 else self.mpi.bcast(obj, root=root)

    def all_reduce_object_max(self, value: int) -> int:
        """Control flow agreement (e.g. "did any rank fail?"): never in a hot path."""
        if self.size == 1:
            return value
        from mpi4py import MPI
        return self.mpi.allreduce(value, op=MPI.MAX)

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        self.mpi.Send(buf, dest=dest, tag=tag)
        self._count("send", buf.nbytes)

    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> np.ndarray:
        self.mpi.Recv(buf, source=source, tag=tag)
        self._count("recv", buf.nbytes)
        return buf

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0):
        """Non-blocking send; the caller keeps `buf` alive until the request completes."""
        self._count("send", buf.nbytes)
        return self.mpi.Isend(buf, dest=dest, tag=tag)

    def irecv(self, buf: np.ndarray, source: int, tag: int = 0):
        self._count("recv", buf.nbytes)
        return self.mpi.Irecv(buf, source=source, tag=tag)

    def barrier(self) -> None:
        if self.size > 1:
            self.mpi.Barrier()


def wait_all(requests) -> None:
    """Complete a list of non-blocking requests (a no-op for an empty list)."""
    if requests:
        from mpi4py import MPI
        MPI.Request.Waitall(list(requests))
