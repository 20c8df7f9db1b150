"""Block checksums: CRC-32C of every ``block_bytes`` block of a fragment's data.

Blocks let a rank verify exactly the part of a fragment it reads (reads are widened to
block boundaries) instead of re-reading whole fragments written by other ranks.

The same blocks are hashed with xxh3-128 (a strong, fast hash: about 16 GB/s per core
here, against 12 GB/s for CRC-32C) for a fragment's *identity*, which incremental saves
compare with their base's to write only what changed. CRC-32C stays the integrity check.
"""

from __future__ import annotations

import crc32c as _crc
import xxhash

_xxh3 = xxhash.xxh3_128_digest


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


def block_sums(data: memoryview, block_bytes: int) -> tuple[list[int], list[bytes]]:
    """CRC-32C and xxh3-128 of each ``block_bytes`` block of ``data``, in one pass (each
    block is hashed while it is in cache): the checksums, and the digests that make the
    data's identity (:func:`identity`)."""
    view = memoryview(data).cast("B")
    if view.nbytes == 0:
        return [crc32c(b"")], [_xxh3(b"")]
    crcs, digests = [], []
    for i in range(0, view.nbytes, block_bytes):
        block = view[i : i + block_bytes]
        crcs.append(crc32c(block))
        digests.append(_xxh3(block))
    return crcs, digests


def block_digests(data: memoryview, block_bytes: int) -> list[bytes]:
    """xxh3-128 of each ``block_bytes`` block of ``data`` (the blocks of :func:`block_crcs`)."""
    view = memoryview(data).cast("B")
    if view.nbytes == 0:
        return [_xxh3(b"")]
    return [_xxh3(view[i : i + block_bytes]) for i in range(0, view.nbytes, block_bytes)]


def identity(digests: list[bytes]) -> str:
    """A fragment's identity: the xxh3-128 (hex) of its blocks' xxh3-128 digests in order.
    Equal identities mean equal bytes (with the block size, dtype and shape equal)."""
    return xxhash.xxh3_128_hexdigest(b"".join(digests))


def block_digests_and_crc(data: memoryview, block_bytes: int) -> tuple[list[bytes], int]:
    """:func:`block_digests` of ``data`` and the CRC-32C of all of it, in one pass."""
    view = memoryview(data).cast("B")
    if view.nbytes == 0:
        return [_xxh3(b"")], crc32c(b"")
    digests, crc = [], 0
    for i in range(0, view.nbytes, block_bytes):
        block = view[i : i + block_bytes]
        digests.append(_xxh3(block))
        crc = _crc.crc32c(block, crc)
    return digests, crc
