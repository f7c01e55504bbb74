"""Pipeline parallelism: schedules as lists of (op, micro-batch), and one executor.

A schedule is plain data a reader can print. For stage s of P with m micro-batches:

  GPipe (Huang et al. 2019): all m forwards, then all m backwards. A stage holds the
      activations of all m micro-batches at once.
  1F1B (Narayanan et al. 2021, PipeDream-Flush, Fig. 4): P-s-1 warm-up forwards,
      then alternate one forward, one backward, then the remaining backwards. A
      stage holds at most P-s micro-batches at once. With P = 1 it is the plain
      gradient-accumulation loop: forward, backward, next.

Both have the same bubble, (P-1)/(m+P-1) of an iteration. The executor receives
each input just before it is needed (blocking Recv) and sends each output as soon
as it exists (non-blocking Isend, completed at the end of the iteration), which is
enough to make both schedules deadlock-free.
"""

import time

import numpy as np

from numpitron.nn.layer import cache_nbytes

FORWARD, BACKWARD = "F", "B"
ACTIVATION_TAG, GRADIENT_TAG = 0, 1


def gpipe_schedule(m: int, stages: int, stage: int) -> list[tuple[str, int]]:
    return [(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)]


def one_f_one_b_schedule(m: int, stages: int, stage: int) -> list[tuple[str, int]]:
    warmup = min(stages - stage - 1, m)
    ops = [(FORWARD, i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [(FORWARD, warmup + i), (BACKWARD, i)]
    ops += [(BACKWARD, i) for i in range(m - warmup, m)]
    return ops


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of an iteration for GPipe and 1F1B: (p-1)/(m+p-1)."""
    return (stages - 1) / (microbatches + stages - 1)


class PipelineStats:
    """What one iteration of a schedule did on this stage: compute intervals (for the
    bubble and the timeline figure), the peak number of micro-batches in flight and the
    peak bytes their caches kept alive (activation memory, counted, not guessed)."""

    def __init__(self):
        self.events = []          # (op, micro-batch, start_s, end_s), relative to start
        self.peak_in_flight = 0
        self.peak_activation_bytes = 0
        self.wall_s = 0.0

    @property
    def busy_s(self) -> float:
        return sum(end - start for _, _, start, end in self.events)

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


def _receive_input(model, topo, tokens):
    """The first stage's input is the token ids; every other stage's arrives from the
    previous stage, received just before it is needed."""
    if model.first:
        return tokens
    B, T = tokens.shape
    return topo.pp_comm.recv(np.empty(model.input_shape(B, T), model.dtype), topo.prev_stage, ACTIVATION_TAG)


def run_schedule(model, topo, microbatches, schedule: str, loss_weight: float, grads_ready=None):
    """Forward and backward every micro-batch of this dp rank through this stage.

    microbatches: list of (tokens, targets), each (B, T); every stage gets them for
    their shape, only the first uses tokens and only the last targets. Gradients
    accumulate into the model's flat gradient buffer; the last backward of the
    iteration reports finished gradients to `grads_ready`. Returns (losses, stats),
    the losses (one per micro-batch) on the last stage only.
    """
    pp_comm = topo.pp_comm
    ops = SCHEDULES[schedule](len(microbatches), topo.pp, topo.pp_rank)
    last_backward = max(i for i, (op, _) in enumerate(ops) if op == BACKWARD)
    in_flight, pending_sends, losses = {}, [], []
    kept = {}                                   # bytes each in-flight micro-batch's caches keep
    stats = PipelineStats()
    t0 = time.perf_counter()
    for index, (op, i) in enumerate(ops):
        tokens, targets = microbatches[i]
        if op == FORWARD:
            inputs = _receive_input(model, topo, tokens)
            start = time.perf_counter()
            out, in_flight[i] = model.forward(inputs, targets)
            stats.events.append((op, i, start - t0, time.perf_counter() - t0))
            stats.peak_in_flight = max(stats.peak_in_flight, len(in_flight))
            kept[i] = cache_nbytes(in_flight[i])       # micro-batches share no buffers: a sum
            stats.peak_activation_bytes = max(stats.peak_activation_bytes, sum(kept.values()))
            if model.last:
                losses.append(out)
            else:
                pending_sends.append(pp_comm.isend(out, topo.next_stage, ACTIVATION_TAG))
        else:
            if model.last:
                dout = loss_weight
            else:
                B, T = tokens.shape
                dout = pp_comm.recv(np.empty(model.input_shape(B, T), model.dtype), topo.next_stage, GRADIENT_TAG)
            start = time.perf_counter()
            kept.pop(i)
            dinputs = model.backward(dout, in_flight.pop(i), grads_ready if index == last_backward else None)
            stats.events.append((op, i, start - t0, time.perf_counter() - t0))
            if not model.first:
                pending_sends.append(pp_comm.isend(dinputs, topo.prev_stage, GRADIENT_TAG))
    pp_comm.wait_all(pending_sends)
    stats.wall_s = time.perf_counter() - t0
    return losses, stats


def forward_only(model, topo, microbatches):
    """Evaluation: forward every micro-batch through the pipeline, keeping no caches.
    Returns the losses on the last stage (an empty list elsewhere)."""
    pp_comm, losses, pending_sends = topo.pp_comm, [], []
    for tokens, targets in microbatches:
        out, _ = model.forward(_receive_input(model, topo, tokens), targets)
        if model.last:
            losses.append(out)
        else:
            pending_sends.append(pp_comm.isend(out, topo.next_stage, ACTIVATION_TAG))
    pp_comm.wait_all(pending_sends)
    return losses
