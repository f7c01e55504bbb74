"""Collectives over NumPy buffers, with a byte count for every call.

Thin wrappers over mpi4py's buffer methods (upper-case: no pickling). Each call
adds the bytes one rank moves under the usual ring algorithms to a shared
`CommStats`, so a run can report its communication volume and tests can check
it against the formula for each parallel strategy:

    all_reduce      2 (n-1)/n * bytes(buffer)     (reduce-scatter + all-gather)
    reduce_scatter    (n-1)/n * bytes(full input)
    all_gather        (n-1)/n * bytes(full output)
    send / recv               bytes(buffer)
    all_to_all(v)             bytes this rank sends to the others (its own block stays)

A reduction or gather may travel in a `wire` format MPI does not know (bf16, fp16 of a
mixed-precision run, docs/07-numbers.md): the buffer is cast to it, moved as 2-byte
integers (so the bytes counted are the format's), summed by `low_format_sum` (each
addition in fp32, rounded back to the format, as a 16-bit add on a device gives), and
cast back into the buffer when the call completes (distributed/wire.py).

Each call also adds its seconds (for non-blocking calls: the seconds spent waiting).
On a communicator of size 1 every collective is a no-op that counts nothing, so a
single process runs the same code as a mesh. Every call that can block tells the
`Watchdog` (watchdog.py) which collective it waits in, so a rank that stops answering
ends the job instead of hanging it.
"""

import time

import numpy as np

from numpitron.distributed.comm_stats import CommStats  # noqa: F401  (imported from here by callers)
from numpitron.distributed.watchdog import Watchdog
from numpitron.distributed.wire import on_wire, sum_op


class Pending:
    """A non-blocking collective in flight: `Comm.wait` completes it (and counts the
    seconds spent waiting, then runs `then`: a wire format's result cast back),
    `Comm.test` lets MPI progress it without blocking.

    It holds every buffer MPI reads or writes (`buffers`) until it is waited for:
    mpi4py's request does not, so a temporary (a transposed copy, a wire format's
    cast) would be freed at once and its memory reused while MPI still reads it."""

    def __init__(self, request, collective: str, then=None, buffers=()):
        self.request, self.collective, self.done = request, collective, request is None
        self.then, self.buffers = then, buffers


class Comm:
    """One communicator (tp, dp, pp, ...) with the collectives the library uses."""

    def __init__(self, mpi_comm, stats: CommStats, name: str, watchdog: Watchdog | None = None):
        self.mpi = mpi_comm
        self.stats = stats
        self.name = name
        self.watchdog = watchdog or Watchdog()
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        self.size = 1 if mpi_comm is None else mpi_comm.Get_size()

    def __repr__(self) -> str:
        return f"Comm({self.name}, rank {self.rank} of {self.size})"

    def _timed(self, collective: str, nbytes: float, call) -> None:
        start = time.perf_counter()
        self._watched(f"{self.name}.{collective}", call)
        self.stats.add(f"{self.name}.{collective}", nbytes, time.perf_counter() - start)

    def _watched(self, collective: str, call):
        """call(), under the watchdog's deadline."""
        self.watchdog.enter(collective)
        try:
            return call()
        finally:
            self.watchdog.leave()

    def all_reduce(self, buf: np.ndarray, op: str = "sum", wire: np.dtype | None = None) -> np.ndarray:
        """In-place reduction of `buf` over the group (op: sum or max; a sum may travel
        and add in a `wire` format)."""
        if self.size > 1:
            from mpi4py import MPI
            packed, unpack = on_wire(buf, wire)
            mpi_op = MPI.MAX if op == "max" else sum_op(packed, buf, wire)
            self._timed("all_reduce", 2 * (self.size - 1) / self.size * packed.nbytes,
                        lambda: self.mpi.Allreduce(MPI.IN_PLACE, packed, op=mpi_op))
            unpack()
        return buf

    def iall_reduce(self, buf: np.ndarray, wire: np.dtype | None = None) -> Pending:
        """Start an in-place sum of `buf` over the group; `wait` before reading it."""
        if self.size == 1:
            return Pending(None, "")
        from mpi4py import MPI
        packed, unpack = on_wire(buf, wire)
        collective = f"{self.name}.all_reduce"
        self.stats.add(collective, 2 * (self.size - 1) / self.size * packed.nbytes)
        return Pending(self.mpi.Iallreduce(MPI.IN_PLACE, packed, op=sum_op(packed, buf, wire)), collective, unpack,
                       (packed, buf))

    def wait(self, pending: Pending) -> None:
        if not pending.done:
            start = time.perf_counter()
            self._watched(pending.collective, pending.request.Wait)
            pending.done = True
            self.stats.seconds[pending.collective] += time.perf_counter() - start
        pending.buffers = ()
        if pending.then is not None:
            pending.then, then = None, pending.then
            then()

    def test(self, pending: list[Pending]) -> None:
        """MPI progresses a non-blocking collective only inside MPI calls: a cheap
        test between two layers' backward keeps the in-flight ones moving."""
        for p in pending:
            if not p.done:
                p.done = p.request.Test()

    def reduce_scatter(self, full: np.ndarray, shard: np.ndarray, wire: np.dtype | None = None) -> np.ndarray:
        """Sum `full` over the group; this rank receives its 1/n slice into `shard`."""
        if self.size > 1:
            packed, _ = on_wire(full, wire)
            received, unpack = on_wire(shard, wire)
            self._timed("reduce_scatter", (self.size - 1) / self.size * packed.nbytes,
                        lambda: self.mpi.Reduce_scatter_block(packed, received, op=sum_op(packed, full, wire)))
            unpack()
        else:
            shard[...] = full
        return shard

    def ireduce_scatter(self, full: np.ndarray, mine: np.ndarray, counts: list[int],
                        wire: np.dtype | None = None) -> Pending:
        """Start summing `full` over the group; rank r receives the r-th piece (pieces of
        `counts` elements, in rank order) into `mine`. Uneven pieces: ZeRO-2/3 cut a bucket
        or a layer where the ranks' 1/n slices of the whole stage fall, so a rank may own
        all of it, some or none. Counted as the bytes this rank does not keep."""
        if self.size == 1:
            mine[...] = full
            return Pending(None, "")
        packed, _ = on_wire(full, wire)
        received, unpack = on_wire(mine, wire)
        collective = f"{self.name}.reduce_scatter"
        self.stats.add(collective, packed.nbytes - received.nbytes)
        return Pending(self.mpi.Ireduce_scatter(packed, received, counts, op=sum_op(packed, full, wire)),
                       collective, unpack, (packed, received, full, mine, counts))

    def iall_gather(self, mine: np.ndarray, full: np.ndarray, counts: list[int],
                    wire: np.dtype | None = None) -> Pending:
        """Start filling `full` with every rank's piece (`counts` elements each, in rank
        order; this rank sends `mine`). Counted as the bytes this rank receives."""
        if self.size == 1:
            full[...] = mine
            return Pending(None, "")
        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        sent, _ = on_wire(mine, wire)
        received, unpack = on_wire(full, wire)
        collective = f"{self.name}.all_gather"
        self.stats.add(collective, received.nbytes - sent.nbytes)
        spec = (list(counts), displacements)
        return Pending(self.mpi.Iallgatherv(sent, [received, spec]), collective, unpack, (sent, received, mine, full, spec))

    def all_gather(self, full: np.ndarray, wire: np.dtype | None = None) -> np.ndarray:
        """In place: rank r's slice r of `full` is filled in on every rank."""
        if self.size > 1:
            from mpi4py import MPI
            packed, unpack = on_wire(full, wire)
            self._timed("all_gather", (self.size - 1) / self.size * packed.nbytes,
                        lambda: self.mpi.Allgather(MPI.IN_PLACE, packed))
            unpack()
        return full

    def gather(self, shard: np.ndarray, full: np.ndarray | None, root: int = 0):
        """Concatenate every rank's `shard` along axis 0 into `full` on `root`."""
        if self.size > 1:
            self._timed("gather", shard.nbytes, lambda: self.mpi.Gather(shard, full, root=root))
        else:
            full[...] = shard
        return full

    def gatherv(self, mine: np.ndarray, full: np.ndarray | None, counts: list[int], root: int) -> None:
        """Concatenate every rank's piece (`counts` elements each, in rank order) into
        `full` on `root` (None elsewhere). Counted as the bytes this rank sends to
        another rank: its piece, or nothing on the root (Muon's owners, docs/10-muon.md)."""
        if self.size == 1:
            full[...] = mine
            return
        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        spec = [full, (list(counts), displacements)] if self.rank == root else None
        self._timed("gather", 0 if self.rank == root else mine.nbytes, lambda: self.mpi.Gatherv(mine, spec, root=root))

    def scatterv(self, full: np.ndarray | None, mine: np.ndarray, counts: list[int], root: int) -> None:
        """The inverse of `gatherv`: rank r receives piece r of `full` (on `root`) into
        `mine`. Counted as the bytes this rank sends to another rank: on the root, every
        piece but its own."""
        if self.size == 1:
            mine[...] = full
            return
        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        spec = [full, (list(counts), displacements)] if self.rank == root else None
        sent = full.nbytes - mine.nbytes if self.rank == root else 0
        self._timed("scatter", sent, lambda: self.mpi.Scatterv(spec, mine, root=root))

    def all_to_all(self, send: np.ndarray) -> np.ndarray:
        """Equal blocks: send[r] goes to rank r; returns recv, recv[r] from rank r."""
        recv = np.empty_like(send) if self.size > 1 else send.copy()
        if self.size > 1:
            self._timed("all_to_all", (self.size - 1) / self.size * send.nbytes,
                        lambda: self.mpi.Alltoall(send, recv))
        return recv

    def all_to_allv(self, send: np.ndarray, send_rows, recv_rows) -> np.ndarray:
        """Blocks of different sizes along axis 0: rows [sum(send_rows[:r]), +send_rows[r])
        of `send` go to rank r; returns the rows received, rank 0's first. Every rank must
        know what it will receive (exchange the counts first, with `all_to_all`)."""
        recv, pending = self.iall_to_allv(send, send_rows, recv_rows)
        self.wait(pending)
        return recv

    def iall_to_allv(self, send: np.ndarray, send_rows, recv_rows) -> tuple[np.ndarray, Pending]:
        """Start `all_to_allv` (counted alike): the array the rows arrive in, read after `wait`."""
        row = int(np.prod(send.shape[1:]))
        recv = np.empty((int(np.sum(recv_rows)),) + send.shape[1:], send.dtype)
        if self.size == 1:
            recv[...] = send
            return recv, Pending(None, "")

        def spec(buf, rows):
            counts = np.asarray(rows, np.int64) * row
            return [buf, (counts, np.concatenate([[0], np.cumsum(counts)[:-1]]))]
        collective, specs = f"{self.name}.all_to_allv", (spec(send, send_rows), spec(recv, recv_rows))
        self.stats.add(collective, (int(np.sum(send_rows)) - int(send_rows[self.rank])) * row * send.itemsize)
        return recv, Pending(self.mpi.Ialltoallv(*specs), collective, buffers=(send, recv, specs))

    def broadcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        if self.size > 1:
            self._timed("broadcast", buf.nbytes, lambda: self.mpi.Bcast(buf, root=root))
        return buf

    def broadcast_object(self, obj, root: int = 0):
        """Small control data only (a config, an error message): never in a hot path."""
        return obj if self.size == 1 else self._watched(f"{self.name}.broadcast_object",
                                                          lambda: self.mpi.bcast(obj, root=root))

    def gather_object(self, obj, root: int = 0) -> list | None:
        """Small control data from every rank, a list on `root` (None elsewhere)."""
        return [obj] if self.size == 1 else self._watched(f"{self.name}.gather_object",
                                                          lambda: self.mpi.gather(obj, root=root))

    def all_reduce_object_max(self, value: int) -> int:
        """Control flow agreement (e.g. "did any rank fail?"): never in a hot path."""
        if self.size == 1:
            return value
        from mpi4py import MPI
        return self._watched(f"{self.name}.all_reduce_object_max", lambda: self.mpi.allreduce(value, op=MPI.MAX))

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        self._timed("send", buf.nbytes, lambda: self.mpi.Send(buf, dest=dest, tag=tag))

    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> np.ndarray:
        """Blocking: the seconds counted include waiting for the sender."""
        self._timed("recv", buf.nbytes, lambda: self.mpi.Recv(buf, source=source, tag=tag))
        return buf

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Pending:
        """Non-blocking send; the caller keeps `buf` alive until it is waited for."""
        self.stats.add(f"{self.name}.send", buf.nbytes)
        return Pending(self.mpi.Isend(buf, dest=dest, tag=tag), f"{self.name}.send", buffers=(buf,))

    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Pending:
        self.stats.add(f"{self.name}.recv", buf.nbytes)
        return Pending(self.mpi.Irecv(buf, source=source, tag=tag), f"{self.name}.recv", buffers=(buf,))

    def ring_pass(self, bufs: list[np.ndarray], tag: int = 0) -> tuple[list[np.ndarray], list[Pending]]:
        """Start sending `bufs` to the next rank of the ring and receiving the previous
        rank's into fresh arrays; returns those arrays and the requests to wait for
        (the caller keeps `bufs` unchanged until then). On one rank the block is its own
        next: the same arrays, nothing to wait for."""
        if self.size == 1:
            return bufs, []
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        received = [np.empty_like(b) for b in bufs]
        pending = [self.isend(b, nxt, tag + i) for i, b in enumerate(bufs)]
        pending += [self.irecv(r, prev, tag + i) for i, r in enumerate(received)]
        return received, pending

    def wait_all(self, pending: list[Pending]) -> None:
        for p in pending:
            self.wait(p)

    def barrier(self) -> None:
        if self.size > 1:
            self._watched(f"{self.name}.barrier", self.mpi.Barrier)
