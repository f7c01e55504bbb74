"""Bytes one rank sends in a collective over `ranks` ranks, by the ring algorithms'
formulas (docs/02-collectives-and-the-mesh.md)."""


def all_reduce_bytes(nbytes: float, ranks: int) -> float:
    """A ring all-reduce of a buffer of nbytes: a reduce-scatter, then an all-gather."""
    return 2 * (ranks - 1) / ranks * nbytes


def half_bytes(nbytes: float, ranks: int) -> float:
    """An all-gather or a reduce-scatter of a full buffer of nbytes."""
    return (ranks - 1) / ranks * nbytes
