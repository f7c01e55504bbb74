"""The CRC-32 that checkpoints and prepared data record for every file they write."""

import zlib
from pathlib import Path

_CHUNK = 1 << 20


def file_crc32(path) -> str:
    """CRC-32 of a file's bytes as hex, read in chunks so large files never sit in memory twice."""
    crc = 0
    with open(Path(path), "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"
