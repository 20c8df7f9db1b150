"""Executing reads: scatter reads straight into targets, checksums over scattered bytes,
and coalescing of adjacent reads of a file.

A span (a run of checksum blocks of one fragment) is read as a list of *segments* that
tile it: pieces of target tensors where the bytes land unchanged (zero-copy: ``preadv``
writes into the tensor's memory, and the checksums are computed there) and scratch
buffers for the rest (bytes of the widened blocks that this rank does not need, or a
whole span buffer when its bytes must be rearranged). Spans of one file that touch are
merged into one ``preadv`` up to a size cap, so many small tensors cost few syscalls
while large reads still run several at a time. Only touching spans are merged: no
byte outside the planned spans is read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import crc32c as _crc
import torch

from ..errors import CorruptionError
from ..storage.local import LocalStorage

COALESCE_GAP = 0
COALESCE_MAX = 64 << 20


@dataclass
class Segment:
    """Bytes ``[start, stop)`` of a span, landing in ``target`` (a flat uint8 CPU tensor
    of that length) or, when ``target`` is None, in scratch memory made at read time."""

    start: int
    stop: int
    target: torch.Tensor | None = None
    buffer: torch.Tensor | None = None

    def view(self) -> memoryview:
        """The memory the bytes are read into (allocating scratch on first use)."""
        if self.target is None and self.buffer is None:
            self.buffer = torch.empty(self.stop - self.start, dtype=torch.uint8)
        t = self.target if self.target is not None else self.buffer
        return memoryview(t.numpy()) if t.numel() else memoryview(bytearray())


@dataclass
class SpanRead:
    """One span to read at ``offset`` of ``file`` as ``segments``; ``finish`` verifies
    and copies once the bytes are in."""

    file: str
    offset: int
    nbytes: int
    segments: list[Segment]
    finish: Callable[["SpanRead"], None] | None = None
    extra: dict = field(default_factory=dict)
    tensor: str = ""  # whose bytes these are (named in errors)


def checksum_error(file: str, tensor: str, start: int, stop: int) -> CorruptionError:
    """The error for a checksum block (bytes ``[start, stop)`` of ``file``) that does not
    match: it names the file, the tensor and the bytes."""
    return CorruptionError(f"checksum mismatch in {file} (tensor {tensor!r}, bytes {start}-{stop} of the file): the checkpoint is corrupt")


def truncated_error(file: str, tensor: str, start: int, stop: int, size: int) -> CorruptionError:
    """The error for bytes ``[start, stop)`` of ``file`` that lie past its end (``size``
    bytes): it names the file, the tensor and the bytes, as :func:`checksum_error` does."""
    return CorruptionError(
        f"{file} is truncated (tensor {tensor!r}, bytes {max(start, size)}-{stop} of the file are missing: "
        f"the file has {size} bytes): the checkpoint is corrupt"
    )


def check_in_file(file: str, size: int, tensor: str, start: int, stop: int) -> None:
    """Raise :func:`truncated_error` unless bytes ``[start, stop)`` lie inside a file of ``size`` bytes."""
    if stop > size:
        raise truncated_error(file, tensor, start, stop, size)


def read_group(storage: LocalStorage, group: list[SpanRead]) -> None:
    """Read the bytes of ``group`` (touching spans of one file, in order) with scatter
    reads into their segments. Every read of load and convert goes through here, so a
    span past the end of a truncated file, or in a missing one, is reported with its
    tensor, file and bytes."""
    first = group[0]
    try:
        reader = storage.reader(first.file)
    except CorruptionError as e:  # the file is missing
        raise CorruptionError(f"{e} (tensor {first.tensor!r} needs bytes {first.offset}-{first.offset + first.nbytes} of it)") from None
    for r in group:
        check_in_file(r.file, reader.size, r.tensor, r.offset, r.offset + r.nbytes)
    reader.preadv_into(group[0].offset, group_views(group))


def fill_gaps(nbytes: int, direct: list[Segment]) -> list[Segment] | None:
    """Tile ``[0, nbytes)`` with the ``direct`` segments (sorted, disjoint) and scratch
    segments between them; None when they overlap or fall outside."""
    out: list[Segment] = []
    at = 0
    for s in sorted(direct, key=lambda s: s.start):
        if s.start < at or s.stop > nbytes:
            return None
        if s.start > at:
            out.append(Segment(at, s.start))
        if s.stop > s.start:
            out.append(s)
        at = s.stop
    if at < nbytes:
        out.append(Segment(at, nbytes))
    return out


def crc_blocks(segments: list[Segment], bounds: list[tuple[int, int]]) -> list[int]:
    """CRC-32C of each byte range in ``bounds`` (sorted, within the span) over the bytes
    as they lie in the segments."""
    out = []
    views = [(s.start, s.stop, s.view()) for s in segments]
    k = 0
    for lo, hi in bounds:
        while k < len(views) and views[k][1] <= lo:
            k += 1
        crc, j, at = 0, k, lo
        while at < hi:
            a, b, mv = views[j]
            end = min(b, hi)
            crc = _crc.crc32c(mv[at - a : end - a], crc)
            at = end
            if end == b:
                j += 1
        out.append(crc)
    return out


def coalesce(reads: list[SpanRead]) -> list[list[SpanRead]]:
    """Group reads of the same file whose byte ranges touch (or leave gaps of at most
    ``COALESCE_GAP``, read into scratch), each group at most ``COALESCE_MAX`` bytes or one read."""
    groups: list[list[SpanRead]] = []
    for r in sorted(reads, key=lambda r: (r.file, r.offset)):
        if groups:
            g = groups[-1]
            last = g[-1]
            end = last.offset + last.nbytes
            if last.file == r.file and 0 <= r.offset - end <= COALESCE_GAP and r.offset + r.nbytes - g[0].offset <= COALESCE_MAX:
                g.append(r)
                continue
        groups.append([r])
    return groups


class Scratch(threading.local):
    """Per-thread scratch memory reused from one read group to the next, so buffered
    spans do not pay fresh page faults for every read (about 3x slower than a warm copy)."""

    buf: torch.Tensor | None = None

    def assign(self, group: list[SpanRead]) -> None:
        """Give every scratch segment of ``group`` a slice of this thread's buffer."""
        todo = [s for r in group for s in r.segments if s.target is None and s.buffer is None]
        need = sum(-(-(s.stop - s.start) // 64) * 64 for s in todo)
        if not need:
            return
        if self.buf is None or self.buf.numel() < need:
            self.buf = None
            self.buf = torch.empty(need, dtype=torch.uint8)
        at = 0
        for s in todo:
            s.buffer = self.buf[at : at + (s.stop - s.start)]
            at += -(-(s.stop - s.start) // 64) * 64


def group_views(group: list[SpanRead]) -> list[memoryview]:
    """The buffers one ``preadv`` fills for a group, gap fillers included."""
    views: list[memoryview] = []
    end = group[0].offset
    for r in group:
        if r.offset > end:
            views.append(memoryview(bytearray(r.offset - end)))
        views.extend(s.view() for s in r.segments)
        end = r.offset + r.nbytes
    return views
