"""Block checksums: CRC-32C of every ``block_bytes`` block of a fragment's data.

Blocks let a rank verify exactly the part of a fragment it reads (reads are widened to
block boundaries) instead of re-reading whole fragments written by other ranks.
"""

from __future__ import annotations

import crc32c as _crc


def crc32c(data) -> int:
    """CRC-32C of a bytes-like object (hardware-accelerated where the CPU has it)."""
    return _crc.crc32c(data)


def block_count(nbytes: int, block_bytes: int) -> int:
    """Number of checksum blocks of a fragment of ``nbytes`` (at least one)."""
    return max(1, -(-nbytes // block_bytes))


def block_crcs(data: memoryview, block_bytes: int) -> list[int]:
    """Checksums of consecutive ``block_bytes`` blocks of ``data`` (the last may be short)."""
    view = memoryview(data).cast("B")
    if view.nbytes == 0:
        return [crc32c(b"")]
    return [crc32c(view[i : i + block_bytes]) for i in range(0, view.nbytes, block_bytes)]
