"""The safetensors container: an 8-byte little-endian header length, a JSON header, data.

unickpt writes the container itself (the header is a small JSON object) because it needs
what the ``safetensors`` library does not offer: the byte offset of every tensor known
before writing, so several threads can ``pwrite`` tensors in place and checksum them on
the way, without building the whole file in memory. Files stay readable by the
``safetensors`` library (tested).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from math import prod
from typing import Any

from .dtypes import DTYPES, itemsize
from .manifest import MAX_DIM, MAX_INT, MAX_NDIM
from ..errors import CorruptionError

ALIGN = 8
MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class Entry:
    """One tensor in a safetensors file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def build_header(entries: list[Entry], metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """The file's leading bytes (length + JSON header) and each entry's absolute data offset.

    Tensors are packed back to back in the given order, as the safetensors spec requires.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    rel = 0
    rel_offsets = []
    for e in entries:
        header[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [rel, rel + e.nbytes]}
        rel_offsets.append(rel)
        rel += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((-(8 + len(text))) % ALIGN)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, [len(prefix) + r for r in rel_offsets]


def parse_header(prefix8: bytes, read_more, where: str | None = None) -> tuple[dict[str, dict], int]:
    """Parse a safetensors header given its first 8 bytes and a ``read_more(n)`` callable
    returning the next n bytes. Returns (header dict, absolute offset of the data section).
    A damaged header is a CorruptionError, its message starting with ``where`` when given."""
    def bad(what: str) -> CorruptionError:
        return CorruptionError(f"{where}: {what}" if where else what)

    if len(prefix8) < 8:
        raise bad("file too short to be safetensors")
    (n,) = struct.unpack("<Q", prefix8[:8])
    if n > MAX_HEADER:
        raise bad(f"safetensors header of {n} bytes is implausible")
    raw = read_more(n)
    if len(raw) != n:
        raise bad("safetensors header truncated")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise bad(f"safetensors header is not JSON: {e}") from None
    except RecursionError:
        raise bad("safetensors header is not valid: JSON nested too deeply") from None
    return header, 8 + n


def read_header(reader: Any, where: str | None = None) -> tuple[dict[str, dict], int]:
    """:func:`parse_header` of a file open for ranged reads (``reader.size`` and
    ``reader.pread_into(offset, memoryview)``, as storage's readers have); reads past the
    end of the file come back short, so a truncated header is a CorruptionError (naming
    ``where`` when given)."""
    first = bytearray(min(8, reader.size))
    reader.pread_into(0, memoryview(first))

    def more(n: int) -> bytes:
        buf = bytearray(max(0, min(n, reader.size - 8)))
        reader.pread_into(8, memoryview(buf))
        return bytes(buf)

    return parse_header(bytes(first), more, where)


def _ints(v: Any, most: int, hi: int) -> tuple[int, ...] | None:
    """``v`` as a tuple when it is a list of at most ``most`` JSON integers (not bools, not
    floats) in ``[0, hi]``; None otherwise."""
    if type(v) is not list or len(v) > most or not all(type(x) is int and 0 <= x <= hi for x in v):
        return None
    return tuple(v)


def parse_entry(d: Any) -> tuple[str, tuple[int, ...], int, int]:
    """``(dtype, shape, begin, end)`` of one header entry (``data_offsets`` relative to the
    data section), each checked: a known dtype name, at most ``MAX_NDIM`` dimensions of at
    most ``MAX_DIM``, offsets in order below 2**63. ValueError saying what is wrong otherwise."""
    if type(d) is not dict:
        raise ValueError(f"{d!r:.40} is not an object")
    dtype, shape, offsets = d.get("dtype"), _ints(d.get("shape"), MAX_NDIM, MAX_DIM), _ints(d.get("data_offsets"), 2, MAX_INT)
    if type(dtype) is not str or dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r:.40}")
    if shape is None:
        raise ValueError(f"shape {d.get('shape')!r:.60} is not a list of at most {MAX_NDIM} integers in [0, {MAX_DIM}]")
    if offsets is None or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise ValueError(f"data_offsets {d.get('data_offsets')!r:.60} are not two integers 0 <= begin <= end < 2**63")
    return dtype, shape, offsets[0], offsets[1]


def header_tensors(header: dict[str, Any], data_start: int, file_size: int, where: str,
                   error: type[Exception] = CorruptionError) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """``{tensor: (dtype, shape, absolute data offset)}`` of a parsed header, each entry
    checked (:func:`parse_entry`) against its shape and the file's size, and no two
    entries' bytes overlapping; ``error(...)`` naming ``where`` and the tensor otherwise.

    The safetensors library also refuses bytes no entry owns (entries must tile the data
    section); such a hole is left to the ledger (``inspect``, ``verify`` report it, and
    ``convert`` refuses it): no tensor is read wrong because of it."""
    out = {}
    spans = []
    for key, d in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, begin, end = parse_entry(d)
        except ValueError as e:
            raise error(f"{where}: malformed safetensors entry for {key!r}: {e}") from None
        if end - begin != prod(shape) * itemsize(dtype) or data_start + end > file_size:
            raise error(f"{where}: tensor {key!r} has a byte range that does not fit its shape or the file")
        out[key] = (dtype, shape, data_start + begin)
        spans.append((data_start + begin, data_start + end, key))
    _check_disjoint(spans, where, error)
    return out


def _check_disjoint(spans: list[tuple[int, int, str]], where: str, error: type[Exception]) -> None:
    """No two ``(begin, end, key)`` byte ranges overlap (a tensor read from another's bytes
    would load wrong values without a word); ``error(...)`` naming both otherwise. Empty
    ranges own no bytes and overlap nothing."""
    prev = None
    for begin, end, key in sorted(s for s in spans if s[1] > s[0]):
        if prev is not None and begin < prev[1]:
            raise error(f"{where}: tensors {prev[2]!r} and {key!r} overlap: both claim bytes {begin}-{min(end, prev[1])}")
        prev = (begin, end, key)
