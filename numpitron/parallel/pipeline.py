"""Pipeline parallelism: one executor for every schedule (parallel/schedules.py).

A schedule is plain data a reader can print: per stage, a list of operations
(F, BW, or the halves B and W; micro-batch; chunk). The executor walks this rank's
list. Inputs are received just before they are needed (blocking Recv) and outputs
sent as soon as they exist (non-blocking Isend, completed at the end of the
iteration): a schedule whose dependencies `schedules.simulate` can run to the end
cannot deadlock here, because the receives are the only waits.

Virtual stage j (chunk j // p) lives on pp rank j mod p: activations go from j to
j+1, gradients from j+1 to j, around the ring of pp ranks when interleaving. Every
message has its own tag (kind, micro-batch, chunk), so no two can be confused even
when both neighbours are the same rank (p = 2).
"""

import time

import numpy as np

from numpitron.errors import UserError
from numpitron.nn.layer import cache_nbytes, splits_backward
from numpitron.parallel.schedules import (BACKWARD, FORWARD, INPUT_GRAD, SPLIT_BACKWARD, WEIGHT_GRAD,
                                         make_schedule)

ACTIVATION, GRADIENT = 0, 1


class PipelineStats:
    """What one iteration of a schedule did on this stage: compute intervals (for the
    bubble and the timeline figure), the peak number of (micro-batch, chunk) pairs in
    flight and the peak bytes their forward caches kept alive (activation memory,
    counted, not guessed)."""

    def __init__(self):
        self.events = []          # (op, micro-batch, start_s, end_s, chunk), relative to start
        self.peak_in_flight = 0
        self.peak_activation_bytes = 0
        self.wall_s = 0.0

    @property
    def busy_s(self) -> float:
        return sum(event[3] - event[2] for event in self.events)

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


class _Route:
    """Where this rank's chunk of a micro-batch comes from and goes to."""

    def __init__(self, model, topo, m: int):
        self.model, self.topo, self.m = model, topo, m
        self.p = topo.pp

    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.p + self.topo.pp_rank

    def tag(self, receiving_stage: int, kind: int, microbatch: int) -> int:
        """One tag per message of the iteration: (receiving virtual stage, micro-batch, kind)."""
        return 2 * (receiving_stage * self.m + microbatch) + kind

    def receive(self, kind: int, tokens, microbatch: int, chunk: int):
        """Activations from virtual stage j-1 (kind ACTIVATION) or the gradient from j+1."""
        j = self.virtual_stage(chunk)
        source = (j - 1 if kind == ACTIVATION else j + 1) % self.p
        B, T = tokens.shape
        buf = np.empty(self.model.input_shape(B, T), self.model.dtype)
        return self.topo.pp_comm.recv(buf, source, self.tag(j, kind, microbatch))

    def send(self, kind: int, array, microbatch: int, chunk: int):
        """Activations on to virtual stage j+1, or the input gradient back to j-1."""
        to = self.virtual_stage(chunk) + (1 if kind == ACTIVATION else -1)
        return self.topo.pp_comm.isend(array, to % self.p, self.tag(to, kind, microbatch))


def check_backward_splits(model, schedule: str) -> None:
    """A schedule with separate W passes needs every layer to expose both halves."""
    if schedule in SPLIT_BACKWARD:
        whole = [type(layer).__name__ for layer in model.layers if not splits_backward(layer)]
        if whole:
            raise UserError(f"the {schedule} schedule runs each backward as two halves, and "
                            f"{', '.join(sorted(set(whole)))} has only a whole backward (no backward_input "
                            f"and backward_weights): choose --pipeline-schedule 1f1b")


def last_weight_ops(ops) -> set[int]:
    """Indices of each chunk's last operation that adds to its weight gradients: after
    it, the chunk's gradients are final for this iteration."""
    last = {}
    for index, op in enumerate(ops):
        if op.kind in (BACKWARD, WEIGHT_GRAD):
            last[op.chunk] = index
    return set(last.values())


def run_schedule(model, topo, microbatches, schedule: str, loss_weight: float, grads_ready=None):
    """Forward and backward every micro-batch of this dp rank through this stage.

    microbatches: list of (tokens, targets), each (B, T); every stage gets them for
    their shape, only the first virtual stage uses tokens and only the last targets.
    Gradients accumulate into the model's flat gradient buffer; each chunk's last
    weight-gradient operation reports its finished gradients to `grads_ready`.
    Returns (losses, stats), the losses (one per micro-batch) on the last stage only.
    """
    route = _Route(model, topo, len(microbatches))
    ops = make_schedule(schedule, len(microbatches), topo.pp, topo.pp_rank, model.virtual_stages)
    final = last_weight_ops(ops)
    caches, kept, pending_sends, losses = {}, {}, [], []
    stats = PipelineStats()
    t0 = time.perf_counter()
    for index, op in enumerate(ops):
        (tokens, targets), key, chunk = microbatches[op.microbatch], (op.microbatch, op.chunk), op.chunk
        ready = grads_ready if index in final else None
        if op.kind == FORWARD:
            inputs = tokens if model.opens(chunk) else route.receive(ACTIVATION, tokens, *key)
            start = time.perf_counter()
            out, caches[key] = model.forward(inputs, targets, chunk=chunk)
            stats.events.append((op.kind, op.microbatch, start - t0, time.perf_counter() - t0, chunk))
            stats.peak_in_flight = max(stats.peak_in_flight, len(caches))
            kept[key] = cache_nbytes(caches[key])       # micro-batches share no buffers: a sum
            stats.peak_activation_bytes = max(stats.peak_activation_bytes, sum(kept.values()))
            if model.closes(chunk):
                losses.append(out)
            else:
                pending_sends.append(route.send(ACTIVATION, out, *key))
            continue
        if op.kind in (BACKWARD, INPUT_GRAD):
            dout = loss_weight if model.closes(chunk) else route.receive(GRADIENT, tokens, *key)
        start = time.perf_counter()
        if op.kind == BACKWARD:          # both halves, layer by layer
            dinputs = model.backward(dout, caches.pop(key), ready, chunk=chunk)
        elif op.kind == INPUT_GRAD:      # the cache stays for the weight half
            dinputs = model.backward_input(dout, caches[key], chunk=chunk)
        else:
            model.backward_weights(caches.pop(key), ready, chunk=chunk)
        stats.events.append((op.kind, op.microbatch, start - t0, time.perf_counter() - t0, chunk))
        if op.kind != WEIGHT_GRAD and not model.opens(chunk):
            pending_sends.append(route.send(GRADIENT, dinputs, *key))
        if key not in caches:
            kept.pop(key)
    topo.pp_comm.wait_all(pending_sends)
    stats.wall_s = time.perf_counter() - t0
    return losses, stats


def forward_only(model, topo, microbatches, schedule: str = "1f1b"):
    """Evaluation: the schedule's forwards only, in its order, keeping no caches.
    Returns the losses on the last stage (an empty list elsewhere)."""
    route = _Route(model, topo, len(microbatches))
    ops = make_schedule(schedule, len(microbatches), topo.pp, topo.pp_rank, model.virtual_stages)
    losses, pending_sends = [], []
    for op in (op for op in ops if op.kind == FORWARD):
        (tokens, targets), key = microbatches[op.microbatch], (op.microbatch, op.chunk)
        inputs = tokens if model.opens(op.chunk) else route.receive(ACTIVATION, tokens, *key)
        out, _ = model.forward(inputs, targets, chunk=op.chunk)
        if model.closes(op.chunk):
            losses.append(out)
        else:
            pending_sends.append(route.send(ACTIVATION, out, *key))
    topo.pp_comm.wait_all(pending_sends)
    return losses
