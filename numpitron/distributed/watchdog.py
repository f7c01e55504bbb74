"""A deadline on every blocking collective: a rank that waits too long ends the job.

MPI has no timeouts. If one rank stops (SIGSTOP, a host that no longer answers), its
peers wait in their next collective forever. So every blocking call of a `Comm`
marks the collective it enters and clears the mark when it returns: one tuple and
one clock read, and nothing on the hot path polls. A daemon thread wakes a few times
per timeout; when a mark has stood for longer than the timeout, it prints one line
naming this rank and the collective, and ends this process. MPICH's launcher then
ends every other rank, the stopped one too. mpi4py releases the GIL inside blocking
MPI calls, so the thread runs while the main thread waits.

The process ends with `os._exit` rather than MPI_Abort: the launcher tears the job
down just the same, and the user reads one line instead of MPICH's abort banner.
"""

import os
import sys
import threading
import time

DEFAULT_TIMEOUT_S = 300.0
# The shortest deadline a run may ask for (0 aside): below it a rank that is merely busy,
# or descheduled on a shared machine, would be taken for a lost peer.
MIN_TIMEOUT_S = 1.0
OUTPUT_DRAIN_S = 0.3        # let the launcher forward the line before the job is torn down


class Watchdog:
    """timeout_s None or 0: no deadline (no thread; marking still costs nothing)."""

    def __init__(self, timeout_s: float | None = None, rank: int = 0, on_timeout=None):
        self.timeout_s, self.rank = timeout_s or None, rank
        self.waiting = None                 # (collective, since) while in one, else None
        self.on_timeout = on_timeout or _end_process
        if self.timeout_s:
            threading.Thread(target=self._watch, name="collective-watchdog", daemon=True).start()

    def enter(self, collective: str) -> None:
        self.waiting = (collective, time.monotonic())

    def leave(self) -> None:
        self.waiting = None

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while True:
            time.sleep(period)
            waiting = self.waiting
            if waiting is None or time.monotonic() - waiting[1] <= self.timeout_s or self.waiting is not waiting:
                continue
            collective, since = waiting
            self.on_timeout(f"error: rank {self.rank} waited {time.monotonic() - since:.0f} s in {collective} "
                            f"(--collective-timeout {self.timeout_s:g}): a rank of its group stopped answering")
            return


def _end_process(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    time.sleep(OUTPUT_DRAIN_S)
    os._exit(1)
