"""Who writes what, decided locally: replica ownership and write chunking.

No rank needs another rank's plan. Every replica of a shard computes the same owner from
the tensor name and the shard's position, so exactly one replica writes it, and the
choice spreads replicated tensors over the replicas instead of piling them on rank 0.
"""

from __future__ import annotations

import zlib


def replica_owner(name: str, shard_key: tuple[int, ...], replicas: int) -> int:
    """Index (0..replicas-1) of the replica that writes the shard of ``name`` at ``shard_key``."""
    if replicas <= 1:
        return 0
    return zlib.crc32(f"{name}@{','.join(map(str, shard_key))}".encode()) % replicas


def write_chunks(nbytes: int, chunk_bytes: int, block_bytes: int) -> list[tuple[int, int]]:
    """Split ``[0, nbytes)`` into chunks of about ``chunk_bytes`` aligned to ``block_bytes``,
    so each chunk's checksums are whole blocks."""
    step = max(block_bytes, (chunk_bytes // block_bytes) * block_bytes)
    if nbytes == 0:
        return [(0, 0)]
    return [(s, min(nbytes, s + step)) for s in range(0, nbytes, step)]
