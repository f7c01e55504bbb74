"""What one rank records while it is traced: spans on named tracks, in seconds of its own
clock (time.perf_counter), and the ends of point-to-point messages, for arrows.

A span is a list [name, category, track, start, end, args] (a list: an in-flight
collective gets its end when it is waited for). Categories:

    step         the loop's containers: "step", "forward and backward"
    compute      a pipeline operation (F, BW, B, W of one micro-batch and chunk), the
                 gradients' finalisation, the optimizer step: the rank computes
    layer        one layer's pass inside an operation (nested in it)
    comm         a collective or message: blocking on the group's track, in flight on
                 the group's "in flight" track (args: bytes, group, waited_ms, hidden_ms)
    wait         the wait that completes an in-flight one, on the group's track
    loop         evaluation, checkpoint saves
"""

import threading
import time
from contextlib import contextmanager

now = time.perf_counter

COMPUTE = "compute"          # the computation track's name


def compute_track() -> str:
    """The computation track; inside a pair of chunks (chunk_pairing/) each chunk's own,
    since the two chunks take turns and their spans would overlap on one track."""
    thread = threading.current_thread()
    return COMPUTE if thread is threading.main_thread() else f"{COMPUTE}, {thread.name}"


class Recorder:
    def __init__(self):
        self.active = False            # inside a traced iteration
        self.iteration = None
        self.phase = "train"           # "train", or "eval" while evaluating
        self.spans = []
        self.flows = []                # ("out" | "in", key, index of the span it leaves or enters)

    def add(self, name, category, track, start, end, args=None) -> list:
        span = [name, category, track, start, end, args or {}]
        self.spans.append(span)
        return span

    @contextmanager
    def span(self, name, category, track=COMPUTE, **args):
        """A span around the block, when recording (else nothing)."""
        if not self.active:
            yield
            return
        start = now()
        try:
            yield
        finally:
            self.add(name, category, track, start, now(), args)

    def flow(self, end: str, key: tuple) -> None:
        """One end of a message's arrow on the span just added: it sends the message
        ("out") or receives it ("in")."""
        self.flows.append((end, key, len(self.spans) - 1))


class Patches:
    """Instance-level wrappers, undone in reverse: an object's class is never touched,
    and an object nobody wrapped keeps no trace of tracing."""

    def __init__(self):
        self.done = []

    def wrap(self, obj, name: str, make) -> None:
        """obj.name becomes make(obj.name), on this instance only."""
        before = obj.__dict__.get(name, Patches)          # Patches: there was none on the instance
        setattr(obj, name, make(getattr(obj, name)))
        self.done.append((obj, name, before))

    def undo(self) -> None:
        for obj, name, before in reversed(self.done):
            if before is Patches:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
        self.done.clear()
