"""The one place that decides how a dimension splits over ranks.

Every split in the package comes from here: a tensor-parallel dimension (heads, the
MLP width, the vocabulary, the sequence under sequence parallelism), the experts over
ep, the layers over pipeline stages, a ZeRO slice of a flat buffer, the rows of a
batch over dp, the samples of a generation over dp, the writers of a checkpoint.
"""


def shard_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """Half-open range [start, stop) of `index`'s equal share of `size` elements.

    `size` must divide (callers pad first: `pad_to_multiple`).
    """
    step = shard_size(size, parts)
    return index * step, (index + 1) * step


def shard_size(size: int, parts: int) -> int:
    """How many of `size` elements each of `parts` ranks holds; `size` must divide."""
    if size % parts:
        raise ValueError(f"cannot split {size} into {parts} equal parts")
    return size // parts


def balanced_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of `index`'s share when `size` need not divide: shares differ by at
    most one element, the larger ones last (equal to `shard_bounds` when it divides)."""
    return index * size // parts, (index + 1) * size // parts


def pad_to_multiple(size: int, multiple: int) -> int:
    """Smallest n >= size divisible by `multiple` (Megatron's make_vocab_size_divisible_by)."""
    return -(-size // multiple) * multiple


def pieces_of_range(lo: int, hi: int, size: int, parts: int) -> list[int]:
    """How [lo, hi) of a buffer of `size` elements falls over the equal slices of
    `parts` ranks: the number of its elements in each rank's slice (ZeRO-2/3 reduce or
    gather one bucket or layer where the ranks' slices of the whole buffer fall: the
    counts of that reduce-scatter or all-gather)."""
    step = shard_size(size, parts)
    return [max(0, min(hi, (r + 1) * step) - max(lo, r * step)) for r in range(parts)]


def piece_in_slice(lo: int, hi: int, size: int, parts: int, index: int) -> slice:
    """Where rank `index`'s piece of [lo, hi) lies within its own slice of the buffer:
    the part of its slice that a reduce-scatter of [lo, hi) fills, or that an
    all-gather of [lo, hi) sends (empty when the range misses the slice)."""
    first, last = shard_bounds(size, parts, index)
    start, stop = min(max(lo, first), last), max(min(hi, last), first)
    return slice(start - first, max(start, stop) - first)
