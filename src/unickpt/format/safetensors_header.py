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

from .dtypes import itemsize
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


def parse_header(prefix8: bytes, read_more) -> tuple[dict[str, dict], int]:
    """Parse a safetensors header given its first 8 bytes and a ``read_more(n)`` callable
    returning the next n bytes. Returns (header dict, absolute offset of the data section)."""
    if len(prefix8) < 8:
        raise CorruptionError("file too short to be safetensors")
    (n,) = struct.unpack("<Q", prefix8[:8])
    if n > MAX_HEADER:
        raise CorruptionError(f"safetensors header of {n} bytes is implausible")
    raw = read_more(n)
    if len(raw) != n:
        raise CorruptionError("safetensors header truncated")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise CorruptionError(f"safetensors header is not JSON: {e}") from None
    except RecursionError:
        raise CorruptionError("safetensors header is not valid: JSON nested too deeply") from None
    return header, 8 + n


def read_header(reader: Any) -> tuple[dict[str, dict], int]:
    """:func:`parse_header` of a file open for ranged reads (``reader.size`` and
    ``reader.pread_into(offset, memoryview)``, as storage's readers have); reads past the
    end of the file come back short, so a truncated header is a CorruptionError."""
    first = bytearray(min(8, reader.size))
    reader.pread_into(0, memoryview(first))

    def more(n: int) -> bytes:
        buf = bytearray(max(0, min(n, reader.size - 8)))
        reader.pread_into(8, memoryview(buf))
        return bytes(buf)

    return parse_header(bytes(first), more)


def header_tensors(header: dict[str, Any], data_start: int, file_size: int, where: str,
                   error: type[Exception] = CorruptionError) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """``{tensor: (dtype, shape, absolute data offset)}`` of a parsed header, each entry
    checked against its shape and the file's size; ``error(...)`` naming ``where`` otherwise."""
    out = {}
    for key, d in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape = str(d["dtype"]), tuple(int(x) for x in d["shape"])
            begin, end = (int(x) for x in d["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise error(f"{where}: malformed safetensors entry for {key!r}") from None
        if end - begin != prod(shape) * itemsize(dtype) or begin < 0 or data_start + end > file_size:
            raise error(f"{where}: tensor {key!r} has a byte range that does not fit its shape or the file")
        out[key] = (dtype, shape, data_start + begin)
    return out
