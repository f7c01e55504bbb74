"""Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication"): the outer step of diloco/outer.py, taken one fragment of the
parameters at a time, each fragment's exchange overlapped with the inner steps that
follow it and merged with them by the paper's mixing factor.

Fragments. The stage's flat buffer (every optimizer's store) is cut into F equal runs
of elements, fragment p = [p S / F, (p + 1) S / F): consecutive blocks' parameters,
the paper's "sequential" fragments. We cut at elements, not at blocks, so the fragments
are equal whatever the layers, and every rank's piece of fragment p is where it meets
the slice its optimizer updates (ZeRO or not). The paper's strided fragments (block i
in fragment i mod F) did slightly better there; ours keep each piece one run.

Schedule. Fragment p leaves after iteration s whenever s ≡ t_p (mod H), its offset
t_p = ⌊p H / F⌋ spread evenly over the round, so F = 1 is DiLoCo's every H-th step.
Each fragment still syncs once per H steps, and no two at once (F ≤ H makes the
offsets differ): the peak message falls from the whole stage to S / F.

Overlap. With τ = --diloco-overlap-steps the exchange is a non-blocking collective and
the replica trains on for τ steps; the mean Δ is applied after iteration s + τ (or
after the run's last iteration, whichever is first), from the fragment's θ_start:

    θ_global = θ_start - η (Δ + μ m)                the outer step (diloco/outer.py)
    θ        = α θ + (1 - α) θ_global               the merge, α = --diloco-merge-alpha

(τ = 0: θ = θ_global, plain DiLoCo.) The merge keeps α of the replica's own θ, which
moved on for the τ steps Δ spent on the wire (the paper's mixing factor; 0.5 is our
default). θ_start becomes θ_global.

After a load the exchanges in flight are rebuilt from the iteration: those that left
at s in (i - τ, i], their means from the checkpoint (diloco/outer.py's `received`).
"""

from numpitron.diloco.exchange import Exchange, send
from numpitron.diloco.outer import apply_outer, gather_stage, held_slice
from numpitron.distributed.sharding import balanced_bounds


class Streaming:
    def __init__(self, optimizers, across, cfg):
        self.optimizers, self.across = optimizers, across
        self.inner_steps, self.overlap = cfg.diloco_inner_steps, cfg.diloco_overlap_steps
        self.count, self.outer_lr = cfg.diloco_fragments, cfg.diloco_outer_lr
        self.momentum, self.alpha = cfg.diloco_outer_momentum, cfg.diloco_merge_alpha
        self.outer_dtype, self.last = cfg.diloco_outer_dtype, cfg.max_iters
        self.offsets = [p * self.inner_steps // self.count for p in range(self.count)]
        self.seen = 0               # the iteration the exchanges in flight belong to

    def due(self, iteration: int) -> list[int]:
        """The fragments whose exchange leaves after `iteration` (counted from 1)."""
        return [p for p, offset in enumerate(self.offsets) if iteration % self.inner_steps == offset]

    def piece(self, optimizer, fragment: int) -> tuple[int, int]:
        """Where fragment `fragment` meets this optimizer's slice, as [a, b) of the slice."""
        lo, hi = balanced_bounds(optimizer.store.size, self.count, fragment)
        return max(lo, optimizer.lo) - optimizer.lo, min(hi, optimizer.hi) - optimizer.lo

    def lands(self, sent: int) -> int:
        return min(sent + self.overlap, self.last)

    def end_step(self, iteration: int) -> None:
        """Send the fragments due after this iteration, then apply those that land."""
        if iteration != self.seen + 1:
            self.rebuild(iteration - 1)
        self.seen = iteration
        for fragment in self.due(iteration):
            for optimizer in self.optimizers:
                a, b = self.piece(optimizer, fragment)
                if a >= b:
                    continue
                state = optimizer.adam
                exchange = Exchange(fragment, a, b, self.lands(iteration), self.across)
                delta = state.start[a:b] - held_slice(optimizer)[a:b]
                state.in_flight.append(send(exchange, delta, self.outer_dtype, exchange.lands == iteration))
        landing = any(self.due(sent) and self.lands(sent) == iteration
                      for sent in range(max(1, iteration - self.overlap), iteration + 1))
        for optimizer in self.optimizers:
            state = optimizer.adam
            for exchange in list(state.in_flight):
                if exchange.lands > iteration:
                    exchange.progress()          # MPI moves a non-blocking collective only inside MPI calls
                    continue
                state.in_flight.remove(exchange)
                alpha = self.alpha if self.overlap else None
                apply_outer(held_slice(optimizer), state, exchange.a, exchange.b, exchange.settle(),
                            self.outer_lr, self.momentum, alpha)
            if landing:         # on every rank of the replica, whether its slice met the fragments or not
                gather_stage(optimizer)

    def rebuild(self, iteration: int) -> None:
        """The exchanges in flight after `iteration`, as a checkpoint saved them (settled)."""
        for optimizer in self.optimizers:
            state = optimizer.adam
            for exchange in state.in_flight:
                exchange.settle()                # no collective is left open
            state.in_flight = []
            if state.received is None:
                continue
            for sent in range(max(1, iteration - self.overlap + 1), iteration + 1):
                for fragment in self.due(sent):
                    a, b = self.piece(optimizer, fragment)
                    if a < b and self.lands(sent) > iteration:
                        state.in_flight.append(Exchange(fragment, a, b, self.lands(sent), self.across,
                                                        mean=state.received[a:b].copy()))
