"""The one place that decides how a dimension splits over ranks."""


def shard_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """Half-open range [start, stop) of `index`'s equal share of `size` elements.

    Every caller that needs a slice of a tensor-parallel dimension or of a ZeRO
    flat buffer goes through here; `size` must divide (callers pad first).
    """
    if size % parts:
        raise ValueError(f"cannot split {size} into {parts} equal parts")
    step = size // parts
    return index * step, (index + 1) * step


def pad_to_multiple(size: int, multiple: int) -> int:
    """Smallest n >= size divisible by `multiple` (Megatron's make_vocab_size_divisible_by)."""
    return -(-size // multiple) * multiple


def pieces_of_range(lo: int, hi: int, size: int, parts: int) -> list[int]:
    """How [lo, hi) of a buffer of `size` elements falls over the equal slices of
    `parts` ranks: the number of its elements in each rank's slice (ZeRO-2/3 reduce or
    gather one bucket or layer where the ranks' slices of the whole buffer fall)."""
    step = size // parts
    return [max(0, min(hi, (r + 1) * step) - max(lo, r * step)) for r in range(parts)]
