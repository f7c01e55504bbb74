"""`--trace FILE.json [--trace-iters A:B]`: the loop's side of a trace. The entry point
turns the flags into a `TraceRequest`; the loop (train.py) installs it on the built
trainer and calls its hooks (an iteration begins and ends, a span around the step, the
evaluation and a checkpoint save), then `finish`, on every rank: the clocks are measured
again, rank 0 gathers every rank's recording and writes the merged file (chrome.py)."""

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from numpitron.distributed.agree import on_every_rank
from numpitron.diloco.replicas import replicas_of
from numpitron.errors import UserError
from numpitron.trace.chrome import merge
from numpitron.trace.clock import ROUNDS, measure_offsets, to_rank_zero
from numpitron.trace.comm_probe import CommProbe
from numpitron.trace.recorder import COMPUTE, Recorder, now
from numpitron.trace.stage_probe import StageProbe

TRACED_BY_DEFAULT = 3      # iterations, after the first of the run (which warms up)


def parse_iterations(text: str | None) -> tuple[int, int] | None:
    """"A:B": the iterations A, A+1, ..., B-1, numbered as metrics.jsonl numbers them."""
    if text is None:
        return None
    try:
        first, stop = (int(part) for part in text.split(":"))
    except ValueError:
        raise UserError(f"--trace-iters takes A:B (iterations A to B-1, as metrics.jsonl numbers them), got {text!r}")
    if not 1 <= first < stop:
        raise UserError(f"--trace-iters {text}: need 1 <= A < B")
    return first, stop


class TraceRequest(NamedTuple):
    path: str
    iterations: tuple[int, int] | None = None      # None: TRACED_BY_DEFAULT after the run's first

    @classmethod
    def from_flags(cls, path: str | None, iterations: str | None):
        if path is None:
            if iterations is not None:
                raise UserError("--trace-iters needs --trace FILE.json")
            return None
        return cls(path, parse_iterations(iterations))

    def install(self, trainer) -> "Tracer":
        """Collective: every rank learns if rank 0, which writes the file, cannot."""
        def writable():
            parent = Path(self.path).resolve().parent
            if trainer.topo.job.rank == 0 and not (parent.is_dir() and os.access(parent, os.W_OK)):
                raise UserError(f"--trace {self.path}: {parent} is not a directory this process can write into")
        on_every_rank(trainer.topo.job, writable)
        first = trainer.iteration + 2
        window = self.iterations or (first, first + TRACED_BY_DEFAULT)
        return Tracer(self.path, window, trainer)


class Tracer:
    """The wrappers exist only during the traced iterations: installed as the first
    begins, removed as the last ends, so the other iterations run exactly as untraced."""

    def __init__(self, path, window: tuple[int, int], trainer):
        self.path, self.window, self.topo = path, window, trainer.topo
        self.rec = Recorder()
        self.clock_before = measure_offsets(self.topo.job)         # collective: every rank builds its Tracer
        self.comm = CommProbe(self.rec, self.topo, trainer.features)
        self.stage = StageProbe(self.rec, trainer)
        self.installed = False
        self.traced = []               # the iterations recorded

    def install(self) -> None:
        if not self.installed:
            self.comm.install()
            self.stage.install()
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            self.comm.uninstall()
            self.stage.uninstall()
            self.installed = False

    def begin_iteration(self, iteration: int) -> None:
        """`iteration`: the number metrics.jsonl will give the step about to run."""
        self.rec.iteration = iteration
        self.rec.active = self.window[0] <= iteration < self.window[1]
        if self.rec.active:
            self.traced.append(iteration)
            self.install()

    def end_iteration(self) -> None:
        if self.rec.active and self.rec.iteration == self.window[1] - 1:
            self.uninstall()
        self.rec.active = False

    @contextmanager
    def span(self, name: str):
        """A span of the loop: "step", "evaluation" or "checkpoint save"."""
        rec = self.rec
        if not rec.active:
            yield
            return
        rec.phase = "eval" if name == "evaluation" else "train"
        start = now()
        try:
            yield
        finally:
            rec.add(name, "step" if name == "step" else "loop", COMPUTE, start, now(), {"iteration": rec.iteration})
            rec.phase = "train"

    def finish(self) -> None:
        """Collective: measure the clocks again, gather, and rank 0 writes the file."""
        self.rec.active = False
        for span in self.rec.spans:          # in flight but never waited for: ends where it started
            if span[4] is None:
                span[4] = span[3]
            if span[1] == "comm" and not span[5]["blocking"]:
                span[5]["hidden_ms"] = max(0.0, (span[4] - span[3]) * 1e3 - span[5]["waited_ms"])
        topo = self.topo
        self.uninstall()
        clock_after = measure_offsets(topo.job)
        replicas = replicas_of(topo)         # DiLoCo: the job is every replica's ranks, a process each
        coords = {"pp": topo.pp_rank, "dp": topo.dp_rank, "cp": topo.cp_rank, "tp": topo.tp_rank}
        record = {"rank": topo.job.rank, "host": topo.hostnames[topo.rank], "spans": self.rec.spans,
                  "flows": self.rec.flows, "coords": {"replica": replicas.index, **coords} if replicas.count > 1
                  else coords}
        records = topo.job.gather_object(record)
        on_every_rank(topo.job, lambda: self._write(records, clock_after, replicas.count) if topo.job.rank == 0
                      else None)

    def _write(self, records: list, clock_after: list, replicas: int) -> None:
        clocks = [to_rank_zero(b, a) for b, a in zip(self.clock_before, clock_after)]
        other = {"iterations": self.traced, "mesh": dict(self.topo.mesh._asdict()), "diloco_replicas": replicas,
                 "clock": {"method": f"ping-pong against rank 0, the shortest of {ROUNDS} round trips; the error "
                                     f"bound is half of it",
                           "offset_us": [[round(b["offset_s"] * 1e6, 3), round(a["offset_s"] * 1e6, 3)]
                                         for b, a in zip(self.clock_before, clock_after)],
                           "error_us": [[round(b["error_s"] * 1e6, 3), round(a["error_s"] * 1e6, 3)]
                                        for b, a in zip(self.clock_before, clock_after)]}}
        trace = merge(records, clocks, self.clock_before[0]["at"], other)
        Path(self.path).write_text(json.dumps(trace))
