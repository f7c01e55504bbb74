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

from numpitron.distributed.comm import wait_all

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


class PipelineStats:
    """What one iteration of a schedule did on this stage: compute intervals (for the
    bubble and the timeline figure) and the peak number of micro-batches in flight."""

    def __init__(self):
        self.events = []          # (op, micro-batch, start_s, end_s), relative to start
        self.peak_in_flight = 0
        self.wall_s = 0.0

    @property
    def busy_s(self) -> float:
        return sum(end - start for _, _, start, end in self.events)

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


def run_schedule(model, topo, microbatches, schedule: str, loss_weight: float):
    """Forward and backward every micro-batch of this dp rank through this stage.

    microbatches: list of (tokens, targets), each (B, T); every stage gets them for
    their shape, only the first uses tokens and only the last targets. Gradients
    accumulate into the model's flat gradient buffer. Returns (losses, stats), the
    losses (one per micro-batch) on the last stage only.
    """
    pp = topo.pp_comm
    ops = SCHEDULES[schedule](len(microbatches), topo.pp, topo.pp_rank)
    in_flight, pending_sends, losses = {}, [], []
    stats = PipelineStats()
    t0 = time.perf_counter()
    for op, i in ops:
        tokens, targets = microbatches[i]
        B, T = tokens.shape
        if op == FORWARD:
            if model.first:
                inputs = tokens
            else:
                inputs = pp.recv(np.empty(model.input_shape(B, T), model.dtype), topo.prev_stage, ACTIVATION_TAG)
            start = time.perf_counter()
            out, in_flight[i] = model.forward(inputs, B, T, targets if model.last else None)
            stats.events.append((op, i, start - t0, time.perf_counter() - t0))
            stats.peak_in_flight = max(stats.peak_in_flight, len(in_flight))
            if model.last:
                losses.append(out)
            else:
                pending_sends.append(pp.isend(out, topo.next_stage, ACTIVATION_TAG))
        else:
            if model.last:
                dout = loss_weight
            else:
                dout = pp.recv(np.empty(model.input_shape(B, T), model.dtype), topo.next_stage, GRADIENT_TAG)
            start = time.perf_counter()
            dinputs = model.backward(dout, in_flight.pop(i))
            stats.events.append((op, i, start - t0, time.perf_counter() - t0))
            if not model.first:
                pending_sends.append(pp.isend(dinputs, topo.prev_stage, GRADIENT_TAG))
    wait_all(pending_sends)
    stats.wall_s = time.perf_counter() - t0
    return losses, stats


def forward_only(model, topo, microbatches):
    """Evaluation: forward every micro-batch through the pipeline, keeping no caches.
    Returns the losses on the last stage (an empty list elsewhere)."""
    pp, losses, pending_sends = topo.pp_comm, [], []
    for tokens, targets in microbatches:
        B, T = tokens.shape
        if model.first:
            inputs = tokens
        else:
            inputs = pp.recv(np.empty(model.input_shape(B, T), model.dtype), topo.prev_stage, ACTIVATION_TAG)
        out, _ = model.forward(inputs, B, T, targets if model.last else None)
        if model.last:
            losses.append(out)
        else:
            pending_sends.append(pp.isend(out, topo.next_stage, ACTIVATION_TAG))
    wait_all(pending_sends)
    return losses


def sync_tied_embedding(model, topo) -> None:
    """Sum the token embedding's gradient over its two copies (first and last stage),
    so both apply the same update and never drift apart (as Megatron does)."""
    if model.first or model.last:
        topo.embedding_comm.all_reduce(model.token_embedding.weight.grad)
