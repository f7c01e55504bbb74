"""Two pipeline operations of one rank run as one pair, each chunk's all-to-alls
travelling while the other chunk computes (DeepSeek-V3 report, §3.2.1, Figure 4).

A forward chunk and a backward chunk of different micro-batches do not need each
other's results, so their layers may run in any interleaving and give the same
numbers. The one that pays is this one: each MoE layer starts an all-to-all, computes
its filler (the shared experts, experts/moe.py), and must then wait for the rows. At
that wait the pair hands over to the other chunk, which computes until its own MoE
layer has started an all-to-all and wants to wait in turn; then the first takes over
again, its rows (most likely) arrived. Forward dispatch travels behind the backward's
experts and router, the backward's combine behind the forward's attention, and so on:
Figure 4's timeline, with the switches where the all-to-alls are.

Each chunk is a thread, and exactly one of them runs at any time: it holds the turn
and gives it away only at an all-to-all's wait (or when it ends). The threads are
coroutines, not parallel workers; the arithmetic runs in the same order on every rank
of a group, so the collectives are started in the same order everywhere, as MPI asks.
(Python's generators would need every layer rewritten to yield; a thread per chunk
leaves the layers as they are.)

MPI moves a non-blocking collective only inside MPI calls, so while one chunk computes,
the other's all-to-alls in flight are tested between its layers (`progress`), as the
data-parallel buckets are between a backward's layers. And before a chunk starts an
all-to-all, the other's are finished (`settle`): an all-to-all started after them, before
their wait, would hold them until its own rows had crossed too (measured on the cluster:
benchmarks/a2a_completion_probe.py), and the chunk resuming would wait for both.
"""

import threading
import time


class ChunkPair:
    """The hand-over point the experts' dispatchers call before each wait (`meanwhile`),
    and `run`, which runs two operations as a pair."""

    def __init__(self):
        self.turn = threading.Condition()
        self.running, self.alive = None, [False, False]
        self.slot = {}            # thread id -> 0 or 1, for the pair's two threads only
        self.in_flight = []       # (comm, pending): all-to-alls of the chunk not running
        self.held, self.since = [0.0, 0.0], [0.0, 0.0]     # seconds each chunk held the turn
        self.handovers = 0        # how often a chunk gave its turn away (tests read it)
        # The pair's own cost, read by benchmarks/a2a_overlap.py: the seconds no chunk held
        # the turn (the threads' start, the hand-overs, the join), and the tests' seconds.
        self.switching_s, self.testing_s, self.tests = 0.0, 0.0, 0

    def meanwhile(self, comm, pending) -> None:
        """A chunk's all-to-all has started and it is about to wait: the other chunk
        computes first, if it is still running. Outside a pair: nothing."""
        me = self.slot.get(threading.get_ident())
        if me is None or not self.alive[1 - me]:
            return
        self.in_flight.append((comm, pending))
        self.handovers += 1
        self.progress()
        self._give_turn(me, 1 - me)
        self.in_flight.remove((comm, pending))

    def settle(self) -> None:
        """Before this chunk starts an all-to-all: finish the other chunk's (their rows
        have most likely crossed while this one computed)."""
        for comm, pending in self.in_flight:
            comm.wait(pending)

    def progress(self) -> None:
        """Test the all-to-alls in flight of the chunk not running, so MPI moves them on."""
        if self.in_flight:
            start = time.perf_counter()
            for comm, pending in self.in_flight:
                comm.test([pending])
            self.testing_s += time.perf_counter() - start
            self.tests += len(self.in_flight)

    def _give_turn(self, me: int, to: int) -> None:
        with self.turn:
            self.held[me] += time.perf_counter() - self.since[me]
            self.running = to
            self.turn.notify_all()
            if self.alive[me]:
                self.turn.wait_for(lambda: self.running == me)
                self.since[me] = time.perf_counter()

    def run(self, first, second) -> tuple[list, list[float]]:
        """first(), second(): the two operations, `first` starting. Returns their results
        and the seconds each held the turn (together: the pair's time)."""
        results, errors = [None, None], []

        def chunk(i: int, work) -> None:
            self.slot[threading.get_ident()] = i
            with self.turn:
                self.turn.wait_for(lambda: self.running == i)
                self.since[i] = time.perf_counter()
            try:
                results[i] = work()
            except BaseException as error:      # re-raised below, on the caller's thread
                errors.append(error)
            finally:
                self.alive[i] = False
                self._give_turn(i, 1 - i)

        start = time.perf_counter()
        self.alive, self.running, self.held = [True, True], 0, [0.0, 0.0]
        threads = [threading.Thread(target=chunk, args=(i, work), name=f"paired chunk {i + 1}")
                   for i, work in enumerate((first, second))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.slot.clear()
        self.switching_s += time.perf_counter() - start - sum(self.held)
        if errors:
            raise errors[0]
        return results, self.held
