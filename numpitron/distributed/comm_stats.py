"""The byte, call and second counters every `Comm` adds to (distributed/comm.py)."""

from collections import defaultdict


class CommStats:
    """Bytes, calls and seconds per collective ("tp.all_reduce", "pp.send", ...), shared
    by the communicators of a topology. For a non-blocking call the seconds are those
    spent waiting for it: the part of its time that computation did not hide."""

    def __init__(self):
        self.bytes = defaultdict(float)
        self.calls = defaultdict(int)
        self.seconds = defaultdict(float)

    def add(self, collective: str, nbytes: float, seconds: float = 0.0) -> None:
        self.bytes[collective] += nbytes
        self.calls[collective] += 1
        self.seconds[collective] += seconds

    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def snapshot(self) -> dict:
        return {name: {"bytes": self.bytes[name], "calls": self.calls[name], "seconds": self.seconds[name]}
                for name in sorted(self.bytes)}

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.seconds.clear()
