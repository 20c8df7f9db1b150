"""XOR parity across nodes (m = 1), laid out like RAID-5.

With ``n`` nodes, each node's blob (its rank files of a step, concatenated in name order)
is cut into ``k = n - 1`` stripes. Node ``j`` holds the parity of group ``j``: the XOR of
one stripe of every other node, stripe :func:`stripe_of` ``(i, j, n)`` of node ``i``. Every
stripe of a node lies in a different group and no group's parity sits on a member, so the
loss of any one node is repaired: each of its stripes is the XOR of a surviving parity with
the other members' stripes of that group. Memory: ``1 + 1/k`` of the data (2x for copies).
Stripes of different lengths are zero-padded to the longest inside the XOR.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import SnapshotError


def check_parity(parity: int, nodes: int) -> int:
    """The parity the job can use: ``parity`` (0 or 1), or 0 when there is a single node.
    Reed-Solomon (m >= 2) is not implemented: a SnapshotError says so."""
    if parity < 0:
        raise SnapshotError(f"parity must be 0 or 1, not {parity}")
    if parity >= 2:
        raise SnapshotError(
            f"parity {parity} needs Reed-Solomon coding, which this version does not implement; "
            "use --parity 1 (XOR: survives the loss of any one node) or --parity 0 (local memory only)"
        )
    return parity if nodes > 1 else 0


def stripe_of(i: int, j: int, n: int) -> int:
    """Which stripe of node ``i``'s blob belongs to the parity group held by node ``j`` (j != i)."""
    if i == j:
        raise ValueError("a node holds no parity over its own data")
    return (j - i - 1) % n


def stripe_range(blob_bytes: int, s: int, k: int) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of stripe ``s`` of ``k`` of a blob of ``blob_bytes``."""
    size = -(-blob_bytes // k) if k else 0
    lo = min(blob_bytes, s * size)
    return lo, min(blob_bytes, lo + size)


def blob_parts(sdir: str, files: list[tuple[str, int]], offset: int, length: int) -> list[tuple[str, int, int]]:
    """The (path, offset, count) file ranges holding bytes ``[offset, offset + length)`` of
    the blob made of ``files`` (name, size) in ``sdir``."""
    parts, at, end = [], 0, offset + length
    for name, size in files:
        lo, hi = max(offset, at), min(end, at + size)
        if lo < hi:
            parts.append((os.path.join(sdir, name), lo - at, hi - lo))
        at += size
    if end > at:
        raise SnapshotError(f"blob of {sdir} ends at byte {at}, before {end}")
    return parts


def read_blob(sdir: str, files: list[tuple[str, int]], offset: int, out: memoryview) -> None:
    """Fill ``out`` with bytes ``offset..`` of the blob made of ``files`` (name, size) in ``sdir``."""
    view = memoryview(out).cast("B")
    at = 0
    for name, size in files:
        if view.nbytes == 0:
            break
        if offset < at + size:
            lo = offset - at
            n = min(size - lo, view.nbytes)
            with open(os.path.join(sdir, name), "rb", buffering=0) as f:
                f.seek(lo)
                got = f.readinto(view[:n])
            if got != n:
                raise SnapshotError(f"{name} in {sdir} is shorter than recorded")
            view = view[n:]
            offset += n
        at += size
    if view.nbytes:
        raise SnapshotError(f"blob of {sdir} ends before byte {offset + view.nbytes}")


def xor_into(acc: np.ndarray, data: memoryview | bytes) -> None:
    """``acc[:len(data)] ^= data`` (the rest of ``acc`` is the zero padding)."""
    src = np.frombuffer(data, dtype=np.uint8)
    if src.size > acc.size:
        raise SnapshotError(f"stripe of {src.size} bytes is longer than its parity ({acc.size})")
    np.bitwise_xor(acc[: src.size], src, out=acc[: src.size])
