"""The pieces of a store's flat buffer a compressor treats one by one: every parameter
(its local shape, this rank's tensor-parallel slice) and the padding after the last
one, if any (a vector of zeros). A segment is a matrix when weight decay applies to it
(Param.decay: the linear layers' weights and the embeddings); qkv's bias is (3, C) but
a bias, LayerNorm's gains are vectors."""

from typing import NamedTuple


class Segment(NamedTuple):
    name: str
    lo: int
    hi: int
    shape: tuple
    matrix: bool


def segments(store) -> list[Segment]:
    out = sorted((Segment(p.name, *store.offsets[p.name], tuple(p.local_shape), p.decay and len(p.local_shape) >= 2)
                  for p in store.params), key=lambda s: s.lo)
    end = out[-1].hi if out else 0
    if end < store.size:
        out.append(Segment("<padding>", end, store.size, (store.size - end,), False))
    return out
