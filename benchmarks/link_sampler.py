"""Host 0's link counters sampled while a run trains (benchmarks/slow_links.py): the
link's busiest rate and its largest burst."""

import threading
import time

from numpitron.cluster.network import link_counters


def link_bytes(spec) -> int:
    """What host 0's link has carried both ways so far (every byte between the two hosts)."""
    return sum(link_counters(spec, 0)[key] for key in ("tx_bytes", "rx_bytes"))


class Sampler(threading.Thread):
    """Host 0's link counters every `period` seconds while a window runs."""

    def __init__(self, spec, period: float):
        super().__init__(daemon=True)
        self.spec, self.period, self.samples, self.stop = spec, period, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.samples.append((time.perf_counter(), link_bytes(self.spec)))
            self.stop.wait(self.period)

    def peak(self, window: float) -> float:
        """The most bytes per second the link carried over any `window` seconds. On a
        shaped link an exchange runs at the link's rate while it lasts, so over a window
        of a step DiLoCo's whole-stage exchange and a fragment differ by F only where the
        link is not the bottleneck: at the top rate."""
        best, j = 0.0, 0
        for i, (t1, b1) in enumerate(self.samples[1:], 1):
            while j < i - 1 and self.samples[j + 1][0] <= t1 - window:
                j += 1
            best = max(best, (b1 - self.samples[j][1]) / (t1 - self.samples[j][0]))
        return best

    def largest_burst(self, quiet: int = 1 << 16) -> int:
        """The most bytes carried by consecutive samples that each moved more than `quiet`
        bytes: one exchange, however long the link takes over it. Between DiLoCo's
        exchanges only the loss's 8 bytes cross, so a burst is one outer all-reduce (the
        whole stage) or one streaming fragment (a stage / F): their ratio is F at any rate."""
        best = run = 0
        for (_, b0), (_, b1) in zip(self.samples, self.samples[1:]):
            run = run + b1 - b0 if b1 - b0 > quiet else 0
            best = max(best, run)
        return best
