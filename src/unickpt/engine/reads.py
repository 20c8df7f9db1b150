"""The one verified read: byte ranges of a checkpoint's files read through the storage
interface into caller buffers, every checksum block checked, then handed to the caller.

Every command that reads tensor bytes goes through :func:`execute` (``load``,
``load_tensor``, ``convert``, ``verify``, ``export`` and the ``--to dcp/deepspeed``
writers, through :mod:`unickpt.engine.tensor_reads` where the bytes land in tensors), so
a change to how bytes are read is made here once.

A *span read* is one byte range of one file (a run of whole checksum blocks of one
fragment) read as a list of *segments* that tile it: caller memory where the bytes land
unchanged (zero-copy: ``preadv`` writes into the target tensor and the checksums are
computed there) and scratch for the rest. Span reads of one file that touch are merged
into one ``preadv`` up to a size cap, so many small tensors cost few syscalls while large
reads still run several at a time; no byte outside the planned spans is read. Scratch is
per thread and reused from one read to the next (fresh pages cost about 3x a warm copy).

Two ways to meet a bad byte: raise (``load``: a :class:`CorruptionError` naming the file,
the tensor and the bytes) or, with ``report=True``, record it on the span read and go on
(``verify``: one run tells everything that is wrong).

Torch-free: ``verify`` of a native checkpoint runs without importing torch. Target memory
is anything :func:`memoryview` takes, or a tensor (its ``numpy()`` view).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc

from ..errors import CorruptionError, UnickptError
from ..storage.base import Storage

COALESCE_GAP = 0
COALESCE_MAX = 64 << 20


@dataclass
class Segment:
    """Bytes ``[start, stop)`` of a span, landing in ``target`` (caller memory of that
    length: a flat uint8 CPU tensor or any writable buffer) or, when ``target`` is None,
    in scratch memory given at read time (``buffer``)."""

    start: int
    stop: int
    target: Any = None
    buffer: memoryview | None = None

    def view(self) -> memoryview:
        """The memory the bytes are read into (allocating scratch on first use)."""
        if self.target is None:
            if self.buffer is None:
                self.buffer = memoryview(bytearray(self.stop - self.start))
            return self.buffer
        t = self.target
        if hasattr(t, "numpy"):  # a tensor: its bytes, without importing torch here
            return memoryview(t.numpy()).cast("B") if t.numel() else memoryview(bytearray())
        return memoryview(t).cast("B")


@dataclass
class SpanRead:
    """One span to read at ``offset`` of ``file`` as ``segments``.

    ``checks`` lists the checksum blocks inside the span: ``(lo, hi, crc)`` with ``lo``/``hi``
    relative to ``offset``. ``finish`` runs once the bytes are in and verified (it copies
    buffered bytes out). With ``report``, what is wrong is recorded in ``problems`` as
    ``(kind, start, stop)`` (absolute offsets in the file; kinds ``"checksum"``,
    ``"truncated"``, ``"missing"``, ``"unreadable"``, with ``message`` for the last ones)."""

    file: str
    offset: int
    nbytes: int
    segments: list[Segment]
    finish: Callable[["SpanRead"], None] | None = None
    extra: dict = field(default_factory=dict)
    tensor: str = ""  # whose bytes these are (named in errors)
    checks: list[tuple[int, int, int]] = field(default_factory=list)
    problems: list[tuple[str, int, int, str]] = field(default_factory=list)
    bytes_checked: int = 0


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


def block_checks(crcs: list[int], block_bytes: int, nbytes: int, start: int, first_block: int, end_block: int) -> list[tuple[int, int, int]]:
    """The ``checks`` of a span covering blocks ``[first_block, end_block)`` of a fragment
    of ``nbytes`` whose checksums are ``crcs``, the span starting at byte ``start`` of the
    fragment (empty when the fragment has no checksums)."""
    if not crcs:
        return []
    return [(b * block_bytes - start, min(nbytes, (b + 1) * block_bytes) - start, crcs[b]) for b in range(first_block, end_block)]


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


def coalesce(reads: list[SpanRead], max_bytes: int = COALESCE_MAX) -> list[list[SpanRead]]:
    """Group reads of the same file whose byte ranges touch (or leave gaps of at most
    ``COALESCE_GAP``, read into scratch), each group at most ``max_bytes`` or one read."""
    groups: list[list[SpanRead]] = []
    for r in sorted(reads, key=lambda r: (r.file, r.offset)):
        if groups:
            g = groups[-1]
            last = g[-1]
            end = last.offset + last.nbytes
            if last.file == r.file and 0 <= r.offset - end <= COALESCE_GAP and r.offset + r.nbytes - g[0].offset <= max_bytes:
                g.append(r)
                continue
        groups.append([r])
    return groups


class Scratch(threading.local):
    """Per-thread scratch memory reused from one read group to the next, so buffered
    spans do not pay fresh page faults for every read. ``pin=True`` (reads bound for CUDA
    tensors) makes it page-locked, so the copies to the device run at the DMA rate
    (an H200: 55 GB/s pinned against 6-7 GB/s from pageable memory); torch's caching host
    allocator keeps the freed buffers for the next load."""

    buf: bytearray | memoryview | None = None

    def __init__(self, pin: bool = False) -> None:
        if pin:
            import torch

            pin = torch.cuda.is_available()
        self.pin = pin
        self._pinned: Any = None  # the page-locked tensor behind ``buf``

    def _alloc(self, need: int) -> bytearray | memoryview:
        if not self.pin:
            return bytearray(need)
        import torch

        self._pinned = torch.empty(need, dtype=torch.uint8, pin_memory=True)
        return memoryview(self._pinned.numpy())

    def assign(self, group: list[SpanRead]) -> None:
        """Give every scratch segment of ``group`` a slice of this thread's buffer."""
        todo = [s for r in group for s in r.segments if s.target is None and s.buffer is None]
        need = sum(-(-(s.stop - s.start) // 64) * 64 for s in todo)
        if not need:
            return
        if self.buf is None or len(self.buf) < need:
            self.buf = self._pinned = None
            self.buf = self._alloc(need)
        whole = memoryview(self.buf)
        at = 0
        for s in todo:
            s.buffer = whole[at : at + (s.stop - s.start)]
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


def _keep_inside(read: SpanRead, size: int) -> None:
    """Report mode: record the blocks of ``read`` past the end of its file (``size`` bytes)
    as truncated and shrink the read to the whole blocks still inside (scratch only)."""
    inside = [c for c in read.checks if read.offset + c[1] <= size]
    lost = [c for c in read.checks if read.offset + c[1] > size]
    for lo, hi, _ in lost:
        read.problems.append(("truncated", read.offset + lo, read.offset + hi, ""))
    read.checks = inside
    read.nbytes = inside[-1][1] if inside else 0
    read.segments = [Segment(0, read.nbytes)] if read.nbytes else []


def _check(read: SpanRead, report: bool, got: list[int] | None = None) -> None:
    """Compare every checksum block of ``read`` (raise, or record when ``report``);
    ``got``: the blocks' CRCs when already computed (as the bytes came in)."""
    if not read.checks:
        return
    if got is None:
        got = crc_blocks(read.segments, [(lo, hi) for lo, hi, _ in read.checks])
    for (lo, hi, expected), crc in zip(read.checks, got):
        if crc == expected:
            read.bytes_checked += hi - lo
        elif report:
            read.problems.append(("checksum", read.offset + lo, read.offset + hi, ""))
        else:
            raise checksum_error(read.file, read.tensor, read.offset + lo, read.offset + hi)


def read_in_pieces(reader: Any, group: list[SpanRead], piece: int) -> list[list[int]]:
    """Read ``group`` (touching spans of one file, in order) ``piece`` bytes at a time,
    each piece's bytes added to the CRCs of their checksum blocks while they are still in
    the cache (copying and checking in one pass over memory instead of two: a file's
    warm load 10-17% faster here); the CRCs of each read's ``checks``."""
    views = group_views(group)
    checks = [(r.offset + lo, r.offset + hi) for r in group for lo, hi, _ in r.checks]
    crcs = [0] * len(checks)
    k, at = 0, group[0].offset
    for part in _cut(views, piece):
        reader.preadv_into(at, part)
        for mv in part:
            lo, hi = at, at + mv.nbytes
            while k < len(checks) and checks[k][1] <= lo:
                k += 1
            j = k
            while j < len(checks) and checks[j][0] < hi:
                a, b = max(lo, checks[j][0]), min(hi, checks[j][1])
                crcs[j] = _crc.crc32c(mv[a - lo : b - lo], crcs[j])
                j += 1
            at = hi
    out, n = [], 0
    for r in group:
        out.append(crcs[n : n + len(r.checks)])
        n += len(r.checks)
    return out


def _cut(views: list[memoryview], piece: int) -> Iterator[list[memoryview]]:
    """The buffers ``views`` (one after the other) cut into runs of at most ``piece`` bytes."""
    part: list[memoryview] = []
    size = 0
    for v in views:
        v = memoryview(v).cast("B")
        i = 0
        while i < v.nbytes:
            take = min(v.nbytes - i, piece - size)
            part.append(v[i : i + take])
            size += take
            i += take
            if size == piece:
                yield part
                part, size = [], 0
    if part:
        yield part


def read_group(storage: Storage, group: list[SpanRead], report: bool = False, scratch: Scratch | None = None) -> None:
    """Read the bytes of ``group`` (touching spans of one file, in order) with scatter
    reads into their segments, check every block, then run each read's ``finish``. A span
    past the end of a truncated file, or in a missing one, is reported with its tensor,
    file and bytes (raised, or recorded on the reads when ``report``)."""
    first = group[0]
    try:
        reader = storage.reader(first.file)
    except CorruptionError as e:  # the file is missing
        if not report:
            raise CorruptionError(f"{e} (tensor {first.tensor!r} needs bytes {first.offset}-{first.offset + first.nbytes} of it)") from None
        for r in group:
            r.problems.append(("missing", r.offset, r.offset + r.nbytes, "data file is missing"))
        return
    for r in group:
        if r.offset + r.nbytes > reader.size:
            if not report:
                raise truncated_error(r.file, r.tensor, r.offset, r.offset + r.nbytes, reader.size)
            _keep_inside(r, reader.size)
    live = [r for r in group if r.nbytes]
    if not live:
        return
    if scratch is not None:
        scratch.assign(live)
    piece = getattr(reader, "piece_bytes", 0)
    if piece and (sum(r.nbytes for r in live) < 2 * piece or not any(r.checks for r in live)):
        piece = 0  # one read: a small group fits the cache as it is, a group with no checksums needs no second pass
    got: list[list[int] | None] = [None] * len(live)
    try:
        if piece:
            got = read_in_pieces(reader, live, piece)
        else:
            reader.preadv_into(live[0].offset, group_views(live))
    except (UnickptError, OSError) as e:
        if not report:
            raise
        for r in live:
            r.problems.append(("unreadable", r.offset, r.offset + r.nbytes, f"cannot read: {e}"))
        return
    for r, crcs in zip(live, got):
        _check(r, report, crcs)
        if r.finish is not None:
            r.finish(r)


def execute(
    storage: Storage, reads: list[SpanRead], *, threads: int = 4, pool: Executor | None = None,
    max_group: int = COALESCE_MAX, report: bool = False, progress: Callable[[int], None] | None = None,
    scratch: Scratch | None = None,
) -> None:
    """Read, verify and finish every span of ``reads``: touching spans coalesced (groups
    of at most ``max_group`` bytes, which with the span size bounds the scratch memory per
    thread), groups run on ``pool`` or on up to ``threads`` threads of a pool made here.
    ``progress(n)`` is called from the calling thread with the bytes of each group done,
    in order. ``scratch``: per-thread memory to reuse across calls (one made here otherwise)."""
    if not reads:
        return
    groups = coalesce(reads, max_group)
    scratch = scratch if scratch is not None else Scratch()
    sizes = [sum(r.nbytes for r in g) for g in groups]

    def run(g: list[SpanRead]) -> None:
        read_group(storage, g, report, scratch)

    for n in _run_all(run, groups, threads, pool):
        if progress is not None:
            progress(sizes[n])


def _run_all(fn: Callable[[Any], None], items: list, threads: int, pool: Executor | None) -> Iterator[int]:
    """Run ``fn`` on every item (in a pool when there is more than one and threads to
    spare), yielding the index of each item done, in order; the first error is raised."""
    if pool is None and (len(items) == 1 or threads <= 1):
        for i, item in enumerate(items):
            fn(item)
            yield i
        return
    own = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=max(1, min(threads, len(items))))
    try:
        futures = [pool.submit(fn, item) for item in items]
        try:
            for i, f in enumerate(futures):
                f.result()
                yield i
        finally:
            for f in futures:
                f.cancel()
    finally:
        if own:
            pool.shutdown(wait=True)
