"""The rank message: what each rank sends to the committing rank at the end of a save.

A rank's report (its files, values, digests, and one entry per fragment it wrote) travels
as one binary message, built so that the committing rank handles 16,384 of them with a
handful of array operations instead of a JSON parse and a dict per fragment:

    prefix   ``<4sHHIQQQQQQ``: magic ``UCKM``, version 1, 0, CRC-32C of everything after
             the prefix, the number of records, then the byte lengths of the five
             sections that follow
    head     JSON object (UTF-8): the payload without its fragments (empty members left out)
    entries  one line per record: ``[name, shape, dtype, layout]`` of its tensor as
             compact JSON, ending in a newline (the committing rank parses each distinct
             line once: the 128 replicas of a shard send the same lines)
    records  one fixed-width record per fragment (``RECORD``, little-endian): its number
             of dimensions, its volume (elements of the tensor it holds), a 64-bit key of
             its boxes and one of its checksums (how duplicate shards are found and
             compared), the length of its JSON text
    boxes    for each record, the box bounding its pieces: ``ndim`` offsets then ``ndim``
             lengths, 64-bit integers
    texts    the fragments' JSON texts (as the manifest stores them) back to back, in
             record order: the committing rank splices them into the manifest unparsed

Messages live only between the ranks of one save (every rank runs the same unickpt), so
the version is checked, not negotiated. A message whose checksum, lengths or head do not
hold raises :class:`~unickpt.SaveError` naming the rank.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _quote
from typing import Any

import numpy as np

from ..errors import SaveError
from .checksum import crc32c

MAX_NDIM = 64  # as a manifest allows
MAGIC = b"UCKM"
VERSION = 1
PREFIX = struct.Struct("<4sHHIQQQQQQ")
RECORD = np.dtype([("ndim", "<u8"), ("volume", "<i8"), ("boxes", "<u8"), ("crcs", "<u8"), ("text", "<u8")])


@dataclass
class FragmentRecord:
    """One fragment as a rank reports it: its tensor's head, its manifest JSON text, and
    what the committing rank checks it by."""

    name: str
    shape: list[int]
    dtype: str
    layout: str
    text: bytes  # the fragment's JSON text, as the manifest stores it
    volume: int  # elements of the global tensor it holds
    boxes: int  # 64-bit key of its global boxes (equal boxes: a duplicate)
    crcs: int  # 64-bit key of its checksums (a duplicate must hold the same data)
    bbox: tuple[list[int], list[int]]  # offsets, lengths of the box bounding its pieces


def _entry_line(r: FragmentRecord) -> str:
    """``[name, shape, dtype, layout]`` as compact JSON and a newline: what ``json.dumps``
    writes, without its per-call cost (a line per fragment: 1,600 a snapshot of 1,600 tensors)."""
    return f"[{_quote(r.name)},[{','.join(str(int(n)) for n in r.shape)}],{_quote(r.dtype)},{_quote(r.layout)}]\n"


def encode(head: dict[str, Any], records: list[FragmentRecord]) -> bytes:
    """The message of a rank: ``head`` (JSON-serialisable) and its fragment records."""
    for r in records:
        if len(r.bbox[0]) != len(r.shape) or len(r.bbox[1]) != len(r.shape):
            raise ValueError(f"fragment of {r.name!r}: its bounding box has not the tensor's {len(r.shape)} dimensions")
    sections = [
        json.dumps(head, separators=(",", ":"), allow_nan=False).encode(),
        "".join(_entry_line(r) for r in records).encode(),
        np.array([(len(r.shape), r.volume, r.boxes, r.crcs, len(r.text)) for r in records], dtype=RECORD).tobytes(),
        np.array([x for r in records for x in (*r.bbox[0], *r.bbox[1])], dtype="<i8").tobytes(),
        b"".join(r.text for r in records),
    ]
    body = b"".join(sections)
    return PREFIX.pack(MAGIC, VERSION, 0, crc32c(body), len(records), *map(len, sections)) + body


@dataclass
class Batch:
    """Every rank's message, decoded together (:func:`decode_all`): the heads, and the
    fragments of all ranks as arrays in rank order (one row each)."""

    heads: list[dict[str, Any]]
    counts: np.ndarray  # records per rank
    entries: list[bytes]  # each record's entry line (without its newline)
    volume: np.ndarray  # int64
    boxes: np.ndarray  # uint64
    crcs: np.ndarray  # uint64
    text_len: np.ndarray  # int64
    ndim: np.ndarray  # int64
    lo: np.ndarray  # (fragments, max ndim) int64: bounding box offsets, zero past ndim
    length: np.ndarray  # (fragments, max ndim) int64: bounding box lengths, zero past ndim
    texts: list[Any]  # each fragment's JSON text (a memoryview of its message)

    def rank_of(self, row: int) -> int:
        """The rank (position in the messages) that sent fragment ``row``."""
        return int(np.searchsorted(np.cumsum(self.counts), row, side="right"))


def _split(rank: int, message: bytes) -> tuple[int, list[Any]]:
    """The number of records and the five sections of one message, its checksum and lengths checked."""
    if len(message) < PREFIX.size:
        raise _bad(rank, f"{len(message)} bytes, shorter than its {PREFIX.size}-byte prefix")
    magic, version, _, crc, n, *lengths = PREFIX.unpack_from(message)
    if magic != MAGIC:
        raise _bad(rank, f"it starts with {bytes(magic)!r}, not {MAGIC!r}")
    if version != VERSION:
        raise _bad(rank, f"version {version}, this unickpt reads {VERSION} (every rank must run the same unickpt)")
    if PREFIX.size + sum(lengths) != len(message):
        raise _bad(rank, f"{len(message)} bytes, its prefix announces {PREFIX.size + sum(lengths)} (truncated?)")
    view = memoryview(message)
    if crc32c(view[PREFIX.size :]) != crc:
        raise _bad(rank, "checksum mismatch: the message was damaged on its way")
    n_head, n_entries, n_records, n_boxes, _ = lengths
    if n_records != n * RECORD.itemsize:
        raise _bad(rank, f"{n_records} bytes of records, not {n} of {RECORD.itemsize}")
    a = PREFIX.size + n_head
    b = a + n_entries
    c = b + n_records
    d = c + n_boxes
    entries = view[a:b]
    lines = message.count(b"\n", a, b)
    if lines != n or n and message[b - 1] != 10:
        raise _bad(rank, f"{lines} tensor entries for {n} records")
    return n, [view[PREFIX.size : a], entries, view[b:c], view[c:d], view[d:]]


def _bad(rank: int, what: str) -> SaveError:
    return SaveError(f"rank {rank} sent a malformed commit message: {what}")


def decode(message: bytes, rank: int = 0) -> dict[str, Any]:
    """One message back as its payload: the head's members, and ``fragments``:
    ``{name: {shape, dtype, layout, fragment (JSON text, bytes), volume, boxes, crcs, bbox}}``."""
    batch = decode_all([message], first_rank=rank)
    head = dict(batch.heads[0])
    frags = {}
    for k, line in enumerate(batch.entries):
        name, shape, dtype, layout = entry(rank, line)
        nd = int(batch.ndim[k])
        frags[name] = {
            "shape": shape, "dtype": dtype, "layout": layout, "fragment": bytes(batch.texts[k]),
            "volume": int(batch.volume[k]), "boxes": int(batch.boxes[k]), "crcs": int(batch.crcs[k]),
            "bbox": [batch.lo[k, :nd].tolist(), batch.length[k, :nd].tolist()],
        }
    head["fragments"] = frags
    return head


def entry(rank: int | None, line: bytes) -> tuple[str, list[int], str, str]:
    """A tensor entry line parsed and checked: name, shape, dtype, layout."""
    try:
        e = json.loads(line)
    except ValueError:
        e = None
    if not (type(e) is list and len(e) == 4 and type(e[0]) is str and type(e[1]) is list
            and all(type(x) is int and x >= 0 for x in e[1]) and type(e[2]) is str and type(e[3]) is str):
        who = "a rank" if rank is None else f"rank {rank}"
        raise SaveError(f"{who} sent a malformed commit message: a tensor entry is {bytes(line)!r:.80}, "
                        "not [name, shape, dtype, layout]")
    return e[0], e[1], e[2], e[3]


def decode_all(messages: list[bytes], first_rank: int = 0) -> Batch:
    """Every rank's message (in rank order) as one :class:`Batch`. Raises
    :class:`~unickpt.SaveError` naming the first rank whose message is malformed."""
    split = [_split(r, m) for r, m in enumerate(messages, first_rank)]
    heads = [s[1][0] for s in split]
    try:
        parsed = json.loads(b"[" + b",".join(heads) + b"]")
    except ValueError:  # find the culprit for the message (rare: the checksum held)
        parsed = [_parse_head(r, h) for r, h in enumerate(heads, first_rank)]
    for r, h in enumerate(parsed, first_rank):
        if type(h) is not dict:
            raise _bad(r, "its head is not a JSON object")
    counts = np.array([s[0] for s in split], dtype=np.int64)
    entries = b"".join([s[1][1] for s in split]).split(b"\n")[:-1]
    fixed = np.frombuffer(b"".join([s[1][2] for s in split]), dtype=RECORD)
    boxes = np.frombuffer(b"".join([s[1][3] for s in split]), dtype="<i8")
    ends = np.cumsum(counts)
    if len(fixed) and int(fixed["ndim"].max()) > MAX_NDIM:
        r = int(np.searchsorted(ends, int(np.argmax(fixed["ndim"] > MAX_NDIM)), side="right"))
        raise _bad(r + first_rank, f"a record of more than {MAX_NDIM} dimensions")
    ndim = fixed["ndim"].astype(np.int64)
    for what, per_record, k in (("boxes", 16 * ndim, 3), ("fragment texts", fixed["text"].astype(np.int64), 4)):
        got = _sums(per_record, ends)
        sizes = np.array([len(s[1][k]) for s in split], dtype=np.int64)
        if not np.array_equal(got, sizes):
            r = int(np.nonzero(got != sizes)[0][0])
            raise _bad(r + first_rank, f"its records announce {int(got[r])} bytes of {what}, it holds {int(sizes[r])}")
    n = len(fixed)
    width = int(ndim.max()) if n else 0
    at = _starts(2 * ndim)
    lo = np.zeros((n, width), dtype=np.int64)
    length = np.zeros((n, width), dtype=np.int64)
    for d in range(width):  # column d of the boxes of every record with more than d dimensions
        has = np.nonzero(ndim > d)[0]
        lo[has, d] = boxes[at[has] + d]
        length[has, d] = boxes[at[has] + ndim[has] + d]
    text_len = fixed["text"].astype(np.int64)
    sections = [s[1][4] for s in split]
    start = (_starts(text_len) - np.repeat(_starts(_sums(text_len, ends)), counts)).tolist()  # in its message's texts
    texts = [sections[r][a : a + k] for r, a, k in zip(np.repeat(np.arange(len(split)), counts).tolist(), start, text_len.tolist())]
    return Batch(parsed, counts, entries, fixed["volume"].copy(), fixed["boxes"].copy(), fixed["crcs"].copy(),
                 text_len, ndim, lo, length, texts)


def _parse_head(rank: int, raw: Any) -> Any:
    try:
        return json.loads(bytes(raw))
    except ValueError as e:
        raise _bad(rank, f"its head is not JSON ({e})") from None


def _starts(sizes: np.ndarray) -> np.ndarray:
    """Where each of consecutive items of ``sizes`` starts."""
    out = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=out[1:])
    return out


def _sums(values: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The sums of consecutive runs of ``values`` ending (exclusive) at ``ends``."""
    total = np.concatenate([[0], np.cumsum(values)]).astype(np.int64)
    return total[ends] - total[np.concatenate([[0], ends[:-1]]).astype(np.int64)]
