"""Random training windows drawn straight from the memory-mapped token files.

The batch of iteration i is a pure function of (seed, stream, i): a resumed run
draws exactly the same data without having to save any generator state.
"""

import zlib
from pathlib import Path

import numpy as np

from numpitron.errors import UserError

TOKEN_DTYPE = np.uint16


def load_tokens(path) -> np.memmap:
    """Map a uint16 token file read-only, so only the sampled windows touch memory."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"token file not found: {path}; run `python -m numpitron.data.prepare` first"
        )
    size = path.stat().st_size
    if size % np.dtype(TOKEN_DTYPE).itemsize:
        raise UserError(f"corrupt token file {path}: {size} bytes is not a whole number of uint16 tokens")
    if size == 0:
        raise UserError(f"corrupt token file {path}: it is empty")
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def sample_windows(tokens, batch_size: int, seq_len: int, rng: np.random.Generator):
    """Draw batch_size windows; y is x shifted one token ahead. Both int64 (B, T)."""
    if batch_size < 1 or seq_len < 1:
        raise UserError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    n_tokens = len(tokens)
    if n_tokens < seq_len + 1:
        raise UserError(
            f"token file has {n_tokens} tokens, too short for seq_len {seq_len} (needs {seq_len + 1})"
        )
    # Highest start is n - T - 1 so that y = tokens[s+1 : s+T+1] stays in range.
    starts = rng.integers(0, n_tokens - seq_len, size=batch_size)
    # One fancy-indexing gather reads just B*(T+1) tokens from the memmap.
    index = starts[:, None] + np.arange(seq_len + 1)
    windows = np.asarray(tokens[index], dtype=np.int64)
    # Separate contiguous arrays, so a caller editing x in place cannot change y.
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


def batch_rng(seed: int, stream: str, index: int) -> np.random.Generator:
    """A generator fixed by (seed, stream, index); crc32 is stable across runs, unlike hash()."""
    if seed < 0 or index < 0:
        raise UserError(f"seed and batch index must be non-negative, got {seed} and {index}")
    stream_id = zlib.crc32(stream.encode("utf-8"))
    return np.random.default_rng([int(seed), stream_id, int(index)])


def global_batch(tokens, seed: int, stream: str, index: int, batch_size: int, seq_len: int):
    """The (x, y) batch of iteration `index` of `stream` ("train", "val", ...)."""
    return sample_windows(tokens, batch_size, seq_len, batch_rng(seed, stream, index))
