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
