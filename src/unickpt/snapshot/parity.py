"""Erasure coding across nodes: XOR (m = 1), Reed-Solomon (m >= 2, zfec) and copies on
neighbours (replication), all in one rotated layout.

Each node's blob (its rank files of a step, concatenated in name order) is cut into ``k``
stripes. With ``n`` nodes there are ``n`` parity groups; group ``g`` holds

* ``k`` data stripes: stripe ``s`` of node ``(g - 1 - s) mod n``, for ``s = 0 .. k-1``;
* ``m`` parity blocks, block ``r`` held by node ``(g + r) mod n``, for ``r = 0 .. m-1``.

Members and holders are different nodes (``k + m <= n``), every node has one stripe in
``k`` groups and holds ``m`` parities, so the loss of any ``m`` nodes leaves every group
at least ``k`` of its ``k + m`` blocks: enough to rebuild. Memory: ``1 + m/k``. A group's
blocks lie on ``k + m`` consecutive nodes, so a lost node's stripes are rebuilt from its
``2k - 1`` neighbours, each byte from ``k`` bytes of input.

* ``--parity M`` (M >= 1): ``k = min(n - M, stripes)``, ``m = M``; ``stripes`` (default
  :data:`STRIPES`, 8) bounds the group: wider groups hold less parity (``m/k`` of the
  snapshot) but read ``k`` bytes for every byte rebuilt, from ``k`` nodes (with ``k = n - 1``
  at 2,048 nodes a rank would read 2,047 bytes per lost byte). ``m = 1`` is XOR (the RAID-5
  layout); ``m >= 2`` is Reed-Solomon (zfec's systematic Vandermonde code over GF(2^8):
  blocks ``0..k-1`` are the data stripes in stripe order, the parity blocks are
  ``k..k+m-1``).
* ``--snapshot-replicas R``: ``k = 1``, ``m = R - 1``: every parity block is a plain copy
  of one node's whole blob, on the next ``R - 1`` nodes (2x memory for R = 2).

Stripes of different lengths are zero-padded to the group's longest inside the code.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import SnapshotError
from .paths import unseal


def check_parity(parity: int, nodes: int) -> int:
    """The parity the job can use: ``parity``, at most ``nodes - 1`` (a job relaunched on
    fewer nodes than ``parity + 1`` keeps the strongest protection it can hold; 0 on a
    single node). A negative parity is a SnapshotError."""
    if parity < 0:
        raise SnapshotError(f"parity must be 0 or more, not {parity}")
    return min(parity, max(0, nodes - 1))


STRIPES = 8  # the most data stripes in a parity group by default (the rebuild reads k bytes per byte)


def layout(nodes: int, parity: int, replicas: int = 1, stripes: int = STRIPES) -> tuple[int, int]:
    """(k, m) of a job: ``k`` data stripes (at most ``stripes``) and ``m`` parity blocks
    per group. ``replicas`` R >= 2 means plain copies (k = 1, m = R - 1, at most one copy
    per other node) and excludes parity."""
    if stripes < 1:
        raise SnapshotError(f"a parity group needs at least 1 data stripe, not {stripes}")
    if replicas < 1:
        raise SnapshotError(f"--snapshot-replicas must be 1 (no copy) or more, not {replicas}")
    if replicas > 1:
        if parity:
            raise SnapshotError(
                f"--snapshot-replicas {replicas} and --parity {parity} exclude each other: "
                "choose copies on neighbour nodes or erasure coding (--parity 0 with replicas)"
            )
        return 1, min(replicas, nodes) - 1
    m = check_parity(parity, nodes)
    return (max(1, min(nodes - m, stripes)), m)


def code_name(k: int, m: int) -> str:
    """The code of a layout: ``none``, ``copy`` (k = 1), ``xor`` (m = 1) or ``rs``."""
    if m == 0:
        return "none"
    if k == 1:
        return "copy"
    return "xor" if m == 1 else "rs"


def group_of(i: int, s: int, n: int) -> int:
    """The parity group of stripe ``s`` of node ``i``."""
    return (i + 1 + s) % n


def members(g: int, k: int, n: int) -> list[tuple[int, int]]:
    """(node, stripe) of the data members of group ``g``, in block order (stripe s is block s)."""
    return [((g - 1 - s) % n, s) for s in range(k)]


def holders(g: int, m: int, n: int) -> list[int]:
    """The nodes holding parity blocks ``0..m-1`` of group ``g``."""
    return [(g + r) % n for r in range(m)]


def held_groups(j: int, m: int, n: int) -> list[tuple[int, int]]:
    """(group, r) of the parity blocks node ``j`` holds."""
    return [((j - r) % n, r) for r in range(m)]


def stripe_range(blob_bytes: int, s: int, k: int) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of stripe ``s`` of ``k`` of a blob of ``blob_bytes``."""
    size = -(-blob_bytes // k) if k else 0
    lo = min(blob_bytes, s * size)
    return lo, min(blob_bytes, lo + size)


def _padded(block, size: int) -> np.ndarray | memoryview:
    data = np.frombuffer(block, dtype=np.uint8)
    if data.size == size:
        return data
    out = np.zeros(size, np.uint8)
    out[: data.size] = data
    return out


def encode(blocks: dict[int, memoryview | bytes | np.ndarray], k: int, m: int, r: int) -> np.ndarray:
    """Parity block ``r`` of a group from its ``k`` data stripes (block index -> bytes)."""
    if sorted(blocks) != list(range(k)):
        raise SnapshotError(f"a parity needs stripes 0..{k - 1}, got {sorted(blocks)}")
    size = max(memoryview(b).nbytes for b in blocks.values())
    if k == 1:
        return np.frombuffer(blocks[0], dtype=np.uint8)  # a copy of the member's stripe: its received buffer
    if m == 1:
        acc = np.zeros(size, np.uint8)
        for b in blocks.values():
            xor_into(acc, b)
        return acc
    import zfec

    enc = zfec.Encoder(k, k + m)
    out = enc.encode(tuple(_padded(blocks[s], size) for s in range(k)), (k + r,))[0]
    return np.frombuffer(out, dtype=np.uint8)


def decode(blocks: dict[int, np.ndarray], k: int, m: int, want: list[int]) -> dict[int, np.ndarray]:
    """The data stripes ``want`` (block indices < k) of a group from ``k`` of its blocks
    (block index -> bytes: data stripes 0..k-1, parity blocks k..k+m-1; data stripes may
    be shorter than the parity, the zero padding is implied). With XOR the parity block
    is overwritten with the result."""
    if len(blocks) < k:
        raise SnapshotError(f"a group needs {k} of its blocks to be rebuilt, {len(blocks)} are left")
    if all(w in blocks for w in want):
        return {w: blocks[w] for w in want}
    size = max(b.size for b in blocks.values() if b is not None)
    if k == 1:
        return {0: next(b for b in blocks.values())}
    if m == 1:
        acc = blocks[k]  # XORed in place: the caller's parity buffer becomes the rebuilt stripe
        for s, b in blocks.items():
            if s != k:
                xor_into(acc, b)
        return {want[0]: acc}
    import zfec

    nums = sorted(blocks)[:k]
    got = zfec.Decoder(k, k + m).decode(tuple(_padded(blocks[b], size) for b in nums), tuple(nums))
    return {w: np.frombuffer(got[w], dtype=np.uint8) for w in want}


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


def xor_into(acc: np.ndarray, data: memoryview | bytes | np.ndarray) -> None:
    """``acc[:len(data)] ^= data`` (the rest of ``acc`` is the zero padding)."""
    src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    if src.size > acc.size:
        raise SnapshotError(f"stripe of {src.size} bytes is longer than its parity ({acc.size})")
    np.bitwise_xor(acc[: src.size], src, out=acc[: src.size])


_INT_FIELDS = ("step", "group", "r", "k", "m", "holder", "nodes", "nbytes", "crc")
_MEMBER_FIELDS = ("stripe", "len", "crc", "blob")


def open_record(raw: bytes) -> dict[str, Any]:
    """A parity block's record (``parity_g<group>_r<block>.json``, stored with
    :func:`.paths.seal`), checked: its digest, and the type and range of every field
    recovery reads (the members' stripes, lengths, crc32c, files and blob sizes). A
    SnapshotError says what is wrong."""
    meta = unseal(raw)
    if not all(_is_count(meta.get(f)) for f in _INT_FIELDS):
        raise SnapshotError(f"one of {', '.join(_INT_FIELDS)} is not a count")
    members = meta.get("members")
    if not isinstance(members, dict) or not members:
        raise SnapshotError("no members")
    for i, rec in members.items():
        if not (i.isdigit() and isinstance(rec, dict) and all(_is_count(rec.get(f)) for f in _MEMBER_FIELDS)
                and isinstance(rec.get("files"), list)
                and all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and _is_count(f[1])
                        for f in rec["files"])):
            raise SnapshotError(f"member {i!r:.20} is malformed")
    return meta


def _is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v < 1 << 63
