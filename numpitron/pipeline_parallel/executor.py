"""Pipeline parallelism: one executor for every schedule (pipeline_parallel/schedules.py).

A schedule is plain data a reader can print: per stage, a list of operations
(F, BW, or the halves B and W; micro-batch; chunk). The executor walks this rank's
list (`Executor`); `PipelineStats` watches it run (what it records does not change
what runs). Inputs are received just before they are needed (blocking Recv) and outputs
sent as soon as they exist (non-blocking Isend, completed at the end of the
iteration): a schedule whose dependencies `timeline.simulate` can run to the end
cannot deadlock here, because the receives are the only waits.

The model's `placement` (pipeline_parallel/placement.py) says which rank holds each virtual
stage: activations go from j to j+1, gradients from j+1 to j, around the ring of pp
ranks when interleaving, down and back up the V in ZB-V and DualPipeV. Where both
stages live on this rank (the bottom of the V) the array is handed over in memory, not
sent. Every message has its own tag (activation or gradient, micro-batch, chunk), so
no two can be confused even when both neighbours are the same rank (p = 2).
"""

import time

import numpy as np

from numpitron.errors import UserError
from numpitron.nn.cache_bytes import cache_nbytes
from numpitron.pipeline_parallel.schedules import (BACKWARD, FORWARD, INPUT_GRAD, ONE_F_ONE_B, SPLIT_BACKWARD, WEIGHT_GRAD,
                                                   make_schedule)

ACTIVATION, GRADIENT = 0, 1            # what a message between virtual stages carries


class PipelineStats:
    """What one iteration of a schedule did on this stage: compute intervals (for the
    bubble and the timeline figure), the peak number of (micro-batch, chunk) pairs in
    flight and the peak bytes their forward caches kept alive (activation memory,
    counted, not guessed). The executor reports each operation once it has computed."""

    def __init__(self):
        self.events = []          # (op, micro-batch, start_s, end_s, chunk), relative to start
        self.peak_in_flight = 0
        self.peak_activation_bytes = 0
        self.wall_s = 0.0
        self._kept = {}           # (micro-batch, chunk) -> bytes its forward cache keeps alive
        self._t0 = time.perf_counter()

    def ran(self, op, start: float, caches: dict) -> None:
        """`op` computed from `start` (perf_counter) until now; `caches` are the forward
        caches alive after it."""
        self.events.append((op.action, op.microbatch, start - self._t0, time.perf_counter() - self._t0, op.chunk))
        key = (op.microbatch, op.chunk)
        if op.action == FORWARD:
            self.peak_in_flight = max(self.peak_in_flight, len(caches))
            self._kept[key] = cache_nbytes(caches[key])       # micro-batches share no buffers: a sum
            self.peak_activation_bytes = max(self.peak_activation_bytes, sum(self._kept.values()))
        elif key not in caches:
            self._kept.pop(key)

    def finish(self) -> None:
        self.wall_s = time.perf_counter() - self._t0

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
        self.placement = model.placement
        self.kept = {}            # tag -> array handed from one chunk of this rank to another

    def virtual_stage(self, chunk: int) -> int:
        return self.placement.stage(self.topo.pp_rank, chunk)

    def tag(self, receiving_stage: int, message: int, microbatch: int) -> int:
        """One tag per message of the iteration: (receiving virtual stage, micro-batch,
        ACTIVATION or GRADIENT)."""
        return 2 * (receiving_stage * self.m + microbatch) + message

    def receive(self, message: int, tokens, microbatch: int, chunk: int):
        """Activations from virtual stage j-1 (ACTIVATION) or the gradient from j+1 (GRADIENT)."""
        j = self.virtual_stage(chunk)
        source, tag = self.placement.rank_of(j - 1 if message == ACTIVATION else j + 1), self.tag(j, message, microbatch)
        if source == self.topo.pp_rank:
            return self.kept.pop(tag)
        B, T = tokens.shape
        buf = np.empty(self.model.input_shape(B, T), self.model.dtype)
        return self.topo.pp_comm.recv(buf, source, tag)

    def send(self, message: int, array, microbatch: int, chunk: int) -> list:
        """Activations on to virtual stage j+1, or the input gradient back to j-1.
        Returns the pending requests (none when j+1 or j-1 is on this rank)."""
        to = self.virtual_stage(chunk) + (1 if message == ACTIVATION else -1)
        rank, tag = self.placement.rank_of(to), self.tag(to, message, microbatch)
        if rank == self.topo.pp_rank:       # a copy, as a receive would give: neither side may alias the other
            self.kept[tag] = array.copy()
            return []
        return [self.topo.pp_comm.isend(array, rank, tag)]


def check_backward_splits(model, schedule: str) -> None:
    """A schedule with separate W passes needs every layer to expose both halves."""
    if schedule in SPLIT_BACKWARD:
        whole = [type(layer).__name__ for layer in model.whole_backward_layers()]
        if whole:
            raise UserError(f"the {schedule} schedule runs each backward as two halves, and "
                            f"{', '.join(sorted(set(whole)))} has only a whole backward (no backward_input "
                            f"and backward_weights): choose --pipeline-schedule 1f1b")


def last_weight_ops(ops) -> set[int]:
    """Indices of each chunk's last operation that adds to its weight gradients: after
    it, the chunk's gradients are final for this iteration."""
    last = {}
    for index, op in enumerate(ops):
        if op.action in (BACKWARD, WEIGHT_GRAD):
            last[op.chunk] = index
    return set(last.values())


class Executor:
    """One iteration's operations on this stage: each receives its input (blocking),
    computes, and sends its output on (non-blocking)."""

    def __init__(self, model, topo, microbatches, loss_weight: float):
        self.model, self.topo, self.microbatches, self.loss_weight = model, topo, microbatches, loss_weight
        self.route = _Route(model, topo, len(microbatches))
        self.caches, self.losses, self.pending_sends = {}, [], []

    def receive(self, op):
        """What `op` starts from: the tokens or the previous virtual stage's activations
        (F), the loss weight or the next virtual stage's gradient (BW, B); W needs none."""
        tokens, chunk = self.microbatches[op.microbatch][0], op.chunk
        if op.action == FORWARD:
            return tokens if self.model.holds_embeddings(chunk) else \
                self.route.receive(ACTIVATION, tokens, op.microbatch, chunk)
        if op.action == WEIGHT_GRAD:
            return None
        return self.loss_weight if self.model.holds_head(chunk) else \
            self.route.receive(GRADIENT, tokens, op.microbatch, chunk)

    def compute(self, op, inputs, grads_ready=None):
        """Run `op` on this stage's chunk; returns what it sends on (None for W)."""
        model, key, chunk = self.model, (op.microbatch, op.chunk), op.chunk
        if op.action == FORWARD:
            out, self.caches[key] = model.forward(inputs, self.microbatches[op.microbatch][1], chunk=chunk)
            return out
        if op.action == BACKWARD:          # both halves, layer by layer
            return model.backward(inputs, self.caches.pop(key), grads_ready, chunk=chunk)
        if op.action == INPUT_GRAD:        # the cache stays for the weight half
            return model.backward_input(inputs, self.caches[key], chunk=chunk)
        model.backward_weights(self.caches.pop(key), grads_ready, chunk=chunk)
        return None

    def send(self, op, output) -> None:
        """Activations on, the loss kept (last virtual stage), the input gradient back."""
        key = (op.microbatch, op.chunk)
        if op.action == FORWARD:
            if self.model.holds_head(op.chunk):
                self.losses.append(output)
            else:
                self.pending_sends += self.route.send(ACTIVATION, output, *key)
        elif op.action != WEIGHT_GRAD and not self.model.holds_embeddings(op.chunk):
            self.pending_sends += self.route.send(GRADIENT, output, *key)

    def finish(self) -> list:
        self.topo.pp_comm.wait_all(self.pending_sends)
        return self.losses


def run_schedule(model, topo, microbatches, schedule: str, loss_weight: float, grads_ready=None):
    """Forward and backward every micro-batch of this dp rank through this stage.

    microbatches: list of (tokens, targets), each (B, T); every stage gets them for
    their shape, only the first virtual stage uses tokens and only the last targets.
    Gradients accumulate into the model's flat gradient buffer; each chunk's last
    weight-gradient operation reports its finished gradients to `grads_ready`.
    Returns (losses, stats), the losses (one per micro-batch) on the last stage only.
    """
    ops = make_schedule(schedule, len(microbatches), topo.pp, topo.pp_rank, model.virtual_stages)
    final = last_weight_ops(ops)
    executor, stats = Executor(model, topo, microbatches, loss_weight), PipelineStats()
    for index, op in enumerate(ops):
        inputs = executor.receive(op)
        start = time.perf_counter()
        output = executor.compute(op, inputs, grads_ready if index in final else None)
        stats.ran(op, start, executor.caches)
        executor.send(op, output)
    losses = executor.finish()
    stats.finish()
    return losses, stats


def forward_only(model, topo, microbatches, schedule: str = ONE_F_ONE_B):
    """Evaluation: the schedule's forwards only, in its order, keeping no caches.
    Returns the losses on the last stage (an empty list elsewhere)."""
    executor = Executor(model, topo, microbatches, loss_weight=1.0)
    ops = make_schedule(schedule, len(microbatches), topo.pp, topo.pp_rank, model.virtual_stages)
    for op in (op for op in ops if op.action == FORWARD):
        executor.send(op, executor.compute(op, executor.receive(op)))
        executor.caches.clear()
    return executor.finish()
