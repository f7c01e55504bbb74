"""Which parts of a store's flat buffers one optimizer keeps: what a checkpoint saves
and loads of it (checkpoint/sharded.py, load.py), and what an export gathers.

A checkpoint holds three flat buffers, each laid out like the store's parameters
(`ParamStore`): the parameters and Adam's two moments (`FLAT_BUFFERS`); with Muon a
fourth, its momentum (`MUON_BUFFER`, zero where AdamW updates, as Adam's moments are
zero on Muon's matrices: muon/muon.py); with plain SGD (optim/sgd.py) only the first;
a DiLoCo run's add its round's start, outer momentum and what is in flight
(`DILOCO_BUFFERS`). A *range* is a half-open [lo, hi) of that layout. The optimizer keeps each buffer on one range: the moments on the slice [lo, hi)
it updates, the parameters on the whole stage (every replica holds them) or, under
ZeRO-3, on the same slice. `buffers` names the ones this optimizer keeps.

    save_range()              the range this rank writes: its ZeRO slice (without
                              ZeRO the replicas split the writing the same way; under
                              HSDP the slice's copies split it again)
    values_in_range(lo, hi)   {buffer: its values on [lo, hi)}, inside what it keeps
    load_ranges()             [(buffer, lo, hi)]: every range it reads back
    load(read_range, t)       restore from read_range(buffer, lo, hi)
    whole(buffer)             a buffer over the whole stage, gathered (tests, exports)
"""

import numpy as np

from numpitron.distributed.sharding import balanced_bounds

FLAT_BUFFERS = ("params", "adam_m", "adam_v")
MUON_BUFFER = "muon_m"
# DiLoCo's θ_start, outer momentum and the mean Δ of fragments in flight (diloco/outer.py)
DILOCO_BUFFERS = ("diloco_start", "diloco_momentum", "diloco_received")
KNOWN_BUFFERS = FLAT_BUFFERS + (MUON_BUFFER,) + DILOCO_BUFFERS  # every kind a checkpoint may hold


class TrainingState:
    def __init__(self, store, comm, adam, lo: int, params: np.ndarray, params_lo: int = 0, after_load=None,
                 copies=None):
        """params: where the optimizer keeps parameter values, from `params_lo` of the
        flat layout on; adam: its moments, on [lo, lo + adam's size); comm: the ranks
        that share the store (they split the writing); copies: the ranks that hold the
        same values as this one besides (HSDP's replicas: they split this rank's part of
        the writing; default none); after_load: called once the values are in (ZeRO-3
        drops parameters it had gathered)."""
        self.store, self.comm, self.adam = store, comm, adam
        self.copies = copies
        self.lo, self.params, self.params_lo, self.after_load = lo, params, params_lo, after_load

    @property
    def buffers(self) -> tuple[str, ...]:
        return ("params",) + tuple(self.adam.flat_state())

    def _held(self, buffer: str, moments: dict | None = None) -> tuple[np.ndarray, int]:
        """The values the optimizer keeps of `buffer`, and where they start in the layout.
        A mixed-precision run's parameters are its fp32 master weights (on the moments'
        slice), never their low-format rounding: a checkpoint loads in any precision."""
        master = getattr(self.adam, "master", None)
        if buffer == "params" and master is not None:
            return master, self.lo
        if buffer == "params":
            return self.params, self.params_lo
        return (moments or self.adam.flat_state())[buffer], self.lo

    def save_range(self) -> tuple[int, int]:
        lo, hi = balanced_bounds(self.store.size, self.comm.size, self.comm.rank)
        copies, place = (self.copies.size, self.copies.rank) if self.copies else (1, 0)
        start, stop = balanced_bounds(hi - lo, copies, place)
        return lo + start, lo + stop

    def values_in_range(self, lo: int, hi: int) -> dict:
        moments, values = self.adam.flat_state(), {}
        for buffer in self.buffers:
            held, start = self._held(buffer, moments)
            if not (start <= lo <= hi <= start + held.size):
                raise ValueError(f"[{lo}, {hi}) is outside this rank's {buffer} [{start}, {start + held.size})")
            values[buffer] = held[lo - start:hi - start]
        return values

    def load_ranges(self) -> list[tuple[str, int, int]]:
        """The parameters over all this rank uses (a master copy lies within them)."""
        ranges, moments = [("params", self.params_lo, self.params_lo + self.params.size)], self.adam.flat_state()
        for buffer in self.buffers[1:]:
            held, start = self._held(buffer, moments)
            ranges.append((buffer, start, start + held.size))
        return ranges

    def load(self, read_range, step_count: int) -> None:
        """read_range(buffer, lo, hi) returns a buffer's values on [lo, hi) of the flat
        layout (zeros where it is padding)."""
        ranges = self.load_ranges()
        self.params[...] = read_range(*ranges[0])
        master = getattr(self.adam, "master", None)
        if master is not None:          # the saved values are the master; the layers use their rounding
            master[...] = self.params[self.lo - self.params_lo:self.lo - self.params_lo + master.size]
            self.adam.fmt.round_(self.params)
        self.adam.load_state(*[read_range(*r) for r in ranges[1:]], step_count)
        if self.after_load is not None:
            self.after_load()

    def whole(self, buffer: str) -> np.ndarray:
        """`buffer` over the whole stage on every rank of comm (a collective when the
        optimizer keeps only a slice of it)."""
        held, start = self._held(buffer)
        if held.size == self.store.size:
            return held
        whole = np.zeros(self.store.size, self.store.dtype)
        whole[start:start + held.size] = held
        return self.comm.all_gather(whole)
