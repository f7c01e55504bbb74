"""The global batch of each iteration under a batch-size ramp-up (--rampup-batch-size
START INCREMENT SAMPLES, Megatron's semantics): the batch of an iteration is START plus
one INCREMENT for every SAMPLES / increments samples the iterations before it consumed,
until it reaches the global batch size, where it stays.

A ramp is a few stages of equal batches, so it is kept as stages (the first iteration
of each and its batch), found one after another only as far as an iteration asked for:
the cost grows with the stages passed, never with --max-iters.
"""

import bisect


class Ramp:
    def __init__(self, start: int, increment: int, samples: int, target: int):
        self.start, self.increment, self.target = start, increment, target
        self.per_increment = samples / max(1, (target - start) // increment)
        self.firsts, self.batches = [], []      # stage k: from iteration firsts[k], batch batches[k]
        self.next_first, self.consumed = 0, 0   # where the next stage starts, samples consumed before it

    def _increments(self, consumed: int) -> int:
        return int(consumed / self.per_increment)      # the same float expression, so the same batches

    def _batch(self, consumed: int) -> int:
        return min(self.target, self.start + self._increments(consumed) * self.increment)

    def at(self, iteration: int) -> int:
        """The global batch of `iteration` (0-based)."""
        while self.next_first <= iteration and (not self.batches or self.batches[-1] < self.target):
            batch, stage = self._batch(self.consumed), self._increments(self.consumed)
            self.firsts.append(self.next_first)
            self.batches.append(batch)
            if batch == self.target:
                break
            # The stage's length: the fewest steps j after which another increment is due
            # (the count of increments never falls as samples grow): doubling, then bisection.
            low, high = 1, 1
            while self._increments(self.consumed + high * batch) == stage:
                low, high = high + 1, 2 * high
            while low < high:
                middle = (low + high) // 2
                if self._increments(self.consumed + middle * batch) > stage:
                    high = middle
                else:
                    low = middle + 1
            self.next_first += low
            self.consumed += low * batch
        return self.batches[bisect.bisect_right(self.firsts, iteration) - 1]
