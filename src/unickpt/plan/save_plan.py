"""Who writes what, decided locally: replica shares and write chunking.

No rank needs another rank's plan. Replicas of the same shards lay the replicated tensors
they hold end to end, in an order they all compute alike (by name and shard), and cut
that line into as many equal parts as there are replicas; replica ``i`` writes part
``i``, cut at whole rows. Every replicated byte is written once, and every replica
writes the same share (within a row per cut), whatever the tensors' sizes.
"""

from __future__ import annotations

import zlib


def replica_owner(name: str, shard_key: tuple[int, ...], replicas: int) -> int:
    """Index (0..replicas-1) of the one replica chosen for the shard of ``name`` at
    ``shard_key`` (a hash: spreads whole tensors over replicas; load's broadcast of
    replicated tensors uses it)."""
    if replicas <= 1:
        return 0
    return zlib.crc32(f"{name}@{','.join(map(str, shard_key))}".encode()) % replicas


def replica_shares(sizes: list[int], rows: list[int], replicas: int, index: int) -> list[tuple[int, int, int]]:
    """The rows replica ``index`` of ``replicas`` writes of a line of tensors.

    ``sizes[k]`` and ``rows[k]``: bytes and rows (first-dimension length; 1 for a tensor
    that cannot be cut) of the line's k-th tensor, in the order every replica uses. The
    line (``T`` bytes) is cut at ``i * T // replicas``; a cut falling inside a tensor
    moves to its nearest row boundary, the same on every replica, so the shares tile
    every tensor exactly. Returns ``(k, first_row, end_row)`` for each non-empty share.
    """
    total = sum(sizes)
    lo_cut, hi_cut = index * total // replicas, (index + 1) * total // replicas
    out = []
    at = 0
    for k, (size, n) in enumerate(zip(sizes, rows)):
        start, at = at, at + size
        if n <= 0:
            continue
        if size == 0:  # an empty-bodied tensor: its rows go with the replica whose cut holds its start
            if lo_cut <= start < hi_cut or (start == total and index == replicas - 1):
                out.append((k, 0, n))
            continue
        a, b = _row_at(lo_cut, start, size, n), _row_at(hi_cut, start, size, n)
        if a < b:
            out.append((k, a, b))
    return out


def _row_at(cut: int, start: int, size: int, rows: int) -> int:
    """The row boundary of a tensor (``size`` bytes from ``start``, ``rows`` rows) nearest
    the line position ``cut``, clamped to ``[0, rows]``."""
    return min(rows, max(0, ((cut - start) * rows * 2 + size) // (2 * size)))


def write_chunks(nbytes: int, chunk_bytes: int, block_bytes: int) -> list[tuple[int, int]]:
    """Split ``[0, nbytes)`` into chunks of about ``chunk_bytes`` aligned to ``block_bytes``,
    so each chunk's checksums are whole blocks."""
    step = max(block_bytes, (chunk_bytes // block_bytes) * block_bytes)
    if nbytes == 0:
        return [(0, 0)]
    return [(s, min(nbytes, s + step)) for s in range(0, nbytes, step)]
