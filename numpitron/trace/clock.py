"""One clock for every rank. Each process reads its own `perf_counter`; on one host the
kernel's monotonic clock is shared and the offsets are zero, across hosts they are not.
Rank 0 measures each rank's offset by ping-pongs (Cristian's method): it sends, the rank
answers with its clock, and the answer is taken to be read halfway through the round
trip. Of a few rounds the shortest trip wins; half of it bounds the error. The trace
measures before and after the traced iterations and interpolates between the two,
which also corrects a drift."""

import numpy as np

from numpitron.trace.recorder import now

TAG = 4747          # the world communicator carries no other point-to-point message with it
ROUNDS = 8


def measure_offsets(world, rounds: int = ROUNDS) -> list[dict] | None:
    """On rank 0: per rank {"at": rank 0's clock, "offset_s": its clock minus rank 0's,
    "error_s": the bound}; None elsewhere. Collective over `world` (a Comm)."""
    world.barrier()
    buf = np.zeros(1)
    if world.rank != 0:
        for _ in range(rounds):
            world.recv(buf, 0, TAG)
            buf[0] = now()
            world.send(buf, 0, TAG)
        return None
    out = [{"at": now(), "offset_s": 0.0, "error_s": 0.0}]
    for rank in range(1, world.size):
        best = None
        for _ in range(rounds):
            sent = now()
            world.send(buf, rank, TAG)
            world.recv(buf, rank, TAG)
            back = now()
            if best is None or back - sent < 2 * best["error_s"]:
                best = {"at": (sent + back) / 2, "offset_s": float(buf[0]) - (sent + back) / 2,
                        "error_s": (back - sent) / 2}
        out.append(best)
    return out


def to_rank_zero(before: dict, after: dict):
    """A function taking this rank's clock to rank 0's, linear between two measurements."""
    t0, t1 = before["at"] + before["offset_s"], after["at"] + after["offset_s"]     # on the rank's clock
    o0, o1 = before["offset_s"], after["offset_s"]
    slope = (o1 - o0) / (t1 - t0) if t1 > t0 else 0.0
    return lambda t: t - (o0 + slope * (t - t0))
