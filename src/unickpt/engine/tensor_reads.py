"""Verified reads into tensors: the read plans of :mod:`unickpt.plan.read_plan` executed
by the one verified read (:func:`unickpt.engine.reads.execute`).

:class:`TensorReads` fills target tensors (any layout: pieces of a DTensor, a flat shard,
a whole tensor) from the fragments of checkpoint entries. A span whose bytes land
unchanged in the target (CPU, same dtype, contiguous on both sides) is read straight
into the target's memory; the rest goes through per-thread scratch and is copied (cast
there, span by span, when the target's dtype is not the saved one: ``load``'s widening;
the caller decides which casts are allowed). Every
block is checked against its checksum unless ``verify=False``. ``load``, ``load_tensor``,
``convert``, ``export`` and the ``--to dcp/deepspeed`` writers all read through here.
"""

from __future__ import annotations

from concurrent.futures import Executor
from math import prod

import torch

from ..errors import LayoutError
from ..format.checksum import block_crcs
from ..format.dtypes import dtype_from_name, dtype_name, itemsize
from ..format.manifest import TensorEntry
from ..plan.box import row_major_strides
from ..plan.piece import Piece, whole_piece
from ..plan.read_plan import Copy, Span
from ..storage.base import Storage
from .byte_reads import check_whole, plan_fill
from .reads import COALESCE_MAX, Scratch, Segment, SpanRead, block_checks, check_in_file, checksum_error, execute, fill_gaps

# the most bytes one read of a tensor cast on load (a target of another dtype than the
# saved one) takes, scratch memory per thread included: its saved bytes are read into
# scratch and cast into the target, so smaller reads keep that memory small (a whole
# large tensor would otherwise be read into scratch first); measured no slower than 8-16 MiB
CAST_SPAN = 4 << 20


def _region(data: torch.Tensor, piece: Piece, first_element: int, part_local_rows: tuple[int, int]) -> torch.Tensor:
    """The view of ``data`` (flat elements from ``first_element`` on) holding rows
    ``[r0, r1)`` of ``piece``'s view."""
    view = piece.view
    if not view:
        at = piece.flat_offset - first_element
        return data[at : at + 1].view(())
    row = row_major_strides(view)[0]
    r0, r1 = part_local_rows
    at = piece.flat_offset + r0 * row - first_element
    return data[at : at + (r1 - r0) * row].view((r1 - r0,) + tuple(view[1:]))


def _narrow(t: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...], skip_dim0: bool) -> torch.Tensor:
    for d in range(1 if skip_dim0 else 0, len(lengths)):
        t = t.narrow(d, offsets[d], lengths[d])
    return t


def target_view(local: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The part of ``local`` (a rank's tensor) that ``piece`` describes, in the piece's view shape."""
    if piece.flat_offset == 0 and piece.view == tuple(local.shape):
        return local
    if not local.is_contiguous():
        raise LayoutError(f"a target tensor with flat pieces must be contiguous (shape {tuple(local.shape)})")
    return local.reshape(-1)[piece.flat_offset : piece.flat_offset + prod(piece.view)].view(piece.view)


def copy_into(c: Copy, data: torch.Tensor, first: int, local: torch.Tensor) -> None:
    """Copy ``c.box`` from span data ``data`` (elements of the fragment from ``first`` on) into ``local``."""
    src_local = c.source.local_of(c.box)
    rows = (src_local.offsets[0], src_local.offsets[0] + src_local.lengths[0]) if src_local.ndim else (0, 1)
    src = _narrow(_region(data, c.source, first, rows), src_local.offsets, src_local.lengths, True)
    dst_local = c.target.local_of(c.box)
    dst = _narrow(target_view(local, c.target), dst_local.offsets, dst_local.lengths, False)
    dst.copy_(src, non_blocking=False)


def direct_segments(entry: TensorEntry, sp: Span, local: torch.Tensor) -> list[Segment] | None:
    """The parts of span ``sp`` whose bytes land unchanged in ``local`` (a CPU tensor of the
    entry's dtype, contiguous on both sides), as segments over the target's memory; None
    when a copy of the span is not contiguous on both sides."""
    if local.device.type != "cpu" or dtype_name(local.dtype) != entry.dtype:
        return None
    size = itemsize(entry.dtype)
    first = sp.start // size
    shadow = torch.empty((sp.stop - sp.start) // size, dtype=local.dtype, device="meta")
    out = []
    for c in sp.copies:
        src_local = c.source.local_of(c.box)
        rows = (src_local.offsets[0], src_local.offsets[0] + src_local.lengths[0]) if src_local.ndim else (0, 1)
        src = _narrow(_region(shadow, c.source, first, rows), src_local.offsets, src_local.lengths, True)
        dst_local = c.target.local_of(c.box)
        dst = _narrow(target_view(local, c.target), dst_local.offsets, dst_local.lengths, False)
        if not (src.is_contiguous() and dst.is_contiguous()):
            return None
        if dst.numel():
            at = src.storage_offset() * size
            out.append(Segment(at, at + dst.numel() * size, dst.detach().reshape(-1).view(torch.uint8)))
    return out


class TensorReads:
    """Reads of checkpoint entries into target tensors: :meth:`add` plans them, :meth:`run`
    reads, verifies and copies. ``max_span`` caps the bytes of one span (and of a group of
    coalesced spans), which bounds the scratch memory per thread."""

    def __init__(self, storage: Storage, threads: int = 4, verify: bool = True, max_span: int | None = None,
                 scratch: Scratch | None = None) -> None:
        self.storage = storage
        self._own_scratch = scratch is None
        self.scratch = scratch if scratch is not None else Scratch()
        self.threads = threads
        self.verify = verify
        self.max_span = max_span
        self.jobs: list[tuple[TensorEntry, Span, torch.Tensor]] = []
        self.bytes_read = 0
        self.files_read: set[str] = set()

    def add(self, entry: TensorEntry, local: torch.Tensor, pieces: list[Piece], what: str = "this rank needs") -> None:
        """Plan the reads filling ``pieces`` of ``local`` from ``entry``'s fragments; a
        CorruptionError when the fragments do not cover them. A ``local`` of another
        dtype than the entry's is filled with the values cast, in spans of at most
        :data:`CAST_SPAN` bytes (which dtypes may be cast is the caller's decision)."""
        span = min(self.max_span or CAST_SPAN, CAST_SPAN) if _cast(entry, local) else self.max_span
        entry, _, plan = plan_fill(entry, pieces, span, what)
        self.jobs.extend((entry, sp, local) for sp in plan.spans)

    def span_read(self, entry: TensorEntry, sp: Span, local: torch.Tensor) -> SpanRead:
        """How to read one span: straight into the target where its bytes land unchanged
        (CPU target, contiguous on both sides), else into scratch then copy."""
        frag = entry.fragments[sp.fragment]
        nbytes = sp.stop - sp.start
        direct = direct_segments(entry, sp, local)
        segments = fill_gaps(nbytes, direct) if direct is not None else None
        buffered = segments is None
        if buffered:
            segments = [Segment(0, nbytes)]
        checks = block_checks(frag.crc32c, frag.block_bytes, frag.nbytes(entry.dtype), sp.start, sp.first_block,
                              sp.end_block) if self.verify else []
        return SpanRead(frag.file, frag.offset + sp.start, nbytes, segments, self._finish, {"job": (entry, sp, local, buffered)},
                        entry.name, checks)

    @staticmethod
    def _finish(read: SpanRead) -> None:
        entry, sp, local, buffered = read.extra["job"]
        if buffered:
            raw = torch.frombuffer(read.segments[0].buffer, dtype=torch.uint8) if read.nbytes else torch.empty(0, dtype=torch.uint8)
            data = raw.view(dtype_from_name(entry.dtype))
            first = sp.start // itemsize(entry.dtype)
            for c in sp.copies:
                copy_into(c, data, first, local)
        read.segments = []  # let go of the scratch slice now

    def run(self, pool: Executor | None = None) -> None:
        """Execute every planned span, several in flight (on ``pool`` when given)."""
        jobs, self.jobs = self.jobs, []
        if self._own_scratch and not self.scratch.pin and any(local.is_cuda for _, _, local in jobs):
            self.scratch = Scratch(pin=True)  # device targets: copies from page-locked scratch
        self.bytes_read += sum(sp.stop - sp.start for _, sp, _ in jobs)
        self.files_read.update(e.fragments[sp.fragment].file for e, sp, _ in jobs)
        same = [self.span_read(e, sp, local) for e, sp, local in jobs if not _cast(e, local)]
        cast = [self.span_read(e, sp, local) for e, sp, local in jobs if _cast(e, local)]
        # touching cast spans are not merged into large reads: each group goes through scratch
        for reads, group in ((same, self.max_span or COALESCE_MAX), (cast, min(self.max_span or CAST_SPAN, CAST_SPAN))):
            if reads:
                execute(self.storage, reads, threads=self.threads, pool=pool, max_group=group, scratch=self.scratch)


def _cast(entry: TensorEntry, local: torch.Tensor) -> bool:
    """Whether ``local`` holds another dtype than ``entry`` was saved in."""
    return dtype_name(local.dtype) != entry.dtype


def read_entry(storage: Storage, entry: TensorEntry, threads: int = 4, verify: bool = True,
               into: torch.Tensor | None = None) -> torch.Tensor:
    """The whole tensor of ``entry`` assembled from its fragments in ``storage`` (checksums
    verified unless ``verify=False``), written into ``into`` when it has the entry's shape."""
    check_whole(entry)
    out = into if into is not None and tuple(into.shape) == entry.shape else torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
    if out.numel():
        reads = TensorReads(storage, threads, verify)
        reads.add(entry, out, [whole_piece(entry.shape)])
        reads.run()
    return out


def read_tensors(storage: Storage, jobs: list[tuple[TensorEntry, torch.Tensor]], span_bytes: int, verify: bool = True,
                 pool: Executor | None = None, scratch: Scratch | None = None) -> int:
    """Fill each whole tensor of ``jobs`` from its entry's fragments with spans of about
    ``span_bytes`` (widened to checksum blocks), on ``pool``'s threads (the calling
    thread when None): the bounded-memory whole-tensor reader of ``convert`` and the
    ``--to`` writers; ``scratch`` is reused from call to call. Returns the bytes read."""
    reads = TensorReads(storage, 1 if pool is None else 2, verify, max_span=span_bytes, scratch=scratch)
    for entry, out in jobs:
        if out.numel():
            reads.add(entry, out, [whole_piece(entry.shape)], "of the source")
    reads.run(pool)
    return reads.bytes_read


def mapped_entry(storage: Storage, entry: TensorEntry, verify: bool = True) -> torch.Tensor | None:
    """The tensor of ``entry`` mapped from its file when one fragment holds it whole, in
    order, and the storage can map files (the optional ``map_range`` capability of local
    files); checksums verified over the mapping unless ``verify=False``. Else None."""
    if not hasattr(storage, "map_range") or len(entry.fragments) != 1 or not prod(entry.shape):
        return None
    frag = entry.fragments[0]
    if tuple(frag.shape) != tuple(entry.shape) or list(frag.pieces) != [whole_piece(entry.shape)]:
        return None
    nbytes = frag.nbytes(entry.dtype)
    check_in_file(frag.file, storage.reader(frag.file).size, entry.name, frag.offset, frag.offset + nbytes)
    mapping, at = storage.map_range(frag.file, frag.offset, nbytes)
    if verify and frag.crc32c:
        with memoryview(mapping) as whole, whole[at : at + nbytes] as view:
            for b, (got, expected) in enumerate(zip(block_crcs(view, frag.block_bytes), frag.crc32c)):
                if got != expected:
                    lo = frag.offset + b * frag.block_bytes
                    raise checksum_error(frag.file, entry.name, lo, min(frag.offset + nbytes, lo + frag.block_bytes))
    return torch.frombuffer(mapping, dtype=dtype_from_name(entry.dtype), count=prod(entry.shape), offset=at).view(entry.shape)


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of 64 (arena slots)."""
    return -(-n // 64) * 64


def batches(jobs: list[tuple[int, TensorEntry]], budget: int) -> list[list[tuple[int, TensorEntry]]]:
    """Consecutive tensors grouped to fit ``budget`` bytes (64-byte aligned) together."""
    out: list[list[tuple[int, TensorEntry]]] = []
    cur: list[tuple[int, TensorEntry]] = []
    size = 0
    for j in jobs:
        n = aligned(j[1].nbytes)
        if cur and size + n > budget:
            out.append(cur)
            cur, size = [], 0
        cur.append(j)
        size += n
    if cur:
        out.append(cur)
    return out
