"""Whole tensors assembled as bytes into caller buffers, without torch.

The read plans of :mod:`unickpt.plan.read_plan` executed by the one verified read
(:func:`unickpt.engine.reads.execute`) into plain buffers (``bytearray``, ``mmap``, numpy
arrays): what ``unickpt convert --to deepspeed`` reads a ZeRO checkpoint's flat partitions
with, so the command never imports torch. A span whose copies each land as one contiguous
run of the target (a flat partition's slice of a whole tensor, a row block) is read
straight into the target's memory and its checksums computed there; the rest (column
blocks of a tensor-parallel shard) is read into scratch and copied by numpy views.
:mod:`unickpt.engine.tensor_reads` plans with the same :func:`plan_fill`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from math import prod
from typing import Any

from ..errors import CorruptionError
from ..format.dtypes import itemsize
from ..format.manifest import TensorEntry
from ..plan.box import Box, row_major_strides, tiling_problem
from ..plan.piece import Piece, whole_piece
from ..plan.read_plan import Copy, ReadPlan, SourceFragment, Span, plan_reads
from ..storage.base import Storage
from .reads import COALESCE_MAX, Scratch, Segment, SpanRead, block_checks, execute, fill_gaps


def source_fragments(entry: TensorEntry) -> list[SourceFragment]:
    """What the read planner needs to know of each stored fragment of ``entry``."""
    size = itemsize(entry.dtype)
    return [
        SourceFragment(f.file, f.offset, prod(f.shape) * size, f.block_bytes, tuple(f.pieces)) for f in entry.fragments
    ]


def check_whole(entry: TensorEntry) -> None:
    """A CorruptionError unless ``entry``'s pieces tile its tensor exactly: checked before
    the whole tensor is allocated (a manifest claiming a shape of 2**62 x 2**62 for 48
    stored elements fails here, not in the allocator)."""
    why = tiling_problem(entry.shape, [p.global_box for f in entry.fragments for p in f.pieces])
    if why is not None:
        raise CorruptionError(f"{entry.name!r}: {why}; the checkpoint cannot give it whole")


def plan_fill(entry: TensorEntry, pieces: list[Piece], max_span: int | None = None,
              what: str = "this rank needs") -> tuple[TensorEntry, list[SourceFragment], ReadPlan]:
    """The reads that fill ``pieces`` (a target's pieces of ``entry``'s global tensor),
    after checking the checkpoint covers every element: the entry with only the fragments
    considered (an indexed manifest reads only those near the pieces), what the planner
    knew of them, and the plan (its spans index that entry's fragments). No I/O beyond
    an indexed manifest's lines: loads and the scale simulation (``bench/scale.py``)
    both call it."""
    near = entry.fragments_touching([p.global_box for p in pieces])
    if near is not entry.fragments:
        entry = TensorEntry(entry.name, entry.shape, entry.dtype, near, entry.layout)
    sources = source_fragments(entry)
    plan = plan_reads(pieces, sources, itemsize(entry.dtype), *([max_span] if max_span else []))
    for p, got, overlap in zip(pieces, plan.covered, plan.overlaps):
        if overlap is not None:
            raise CorruptionError(
                f"{entry.name!r}: the checkpoint's pieces {overlap[0]} and {overlap[1]} overlap in the elements "
                f"{what} (box {p.global_box}): each element is stored once, so its manifest is corrupt"
            )
        if got != p.global_box.volume:
            raise CorruptionError(
                f"{entry.name!r}: the checkpoint holds {got} of the {p.global_box.volume} elements "
                f"{what} (box {p.global_box}); its fragments are incomplete"
            )
    return entry, sources, plan


def _run(box: Box, view: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first element, elements)`` of ``box`` inside a row-major array of shape ``view``
    when the box is one contiguous run of it, else None."""
    partial = [d for d in range(len(view)) if box.lengths[d] != view[d]]
    if partial and any(box.lengths[d] != 1 for d in range(partial[-1])):
        return None
    strides = row_major_strides(view)
    return sum(o * s for o, s in zip(box.offsets, strides)), box.volume


def _direct(c: Copy, first: int, size: int, out: memoryview) -> Segment | None:
    """The segment of the span (elements of the fragment from ``first`` on) that lands
    unchanged in the whole tensor ``out`` for copy ``c``, or None when either side is not
    one contiguous run."""
    src = _run(c.source.local_of(c.box), c.source.view)
    dst = _run(c.target.local_of(c.box), c.target.view)
    if src is None or dst is None:
        return None
    at = (c.source.flat_offset + src[0] - first) * size
    to = (c.target.flat_offset + dst[0]) * size
    return Segment(at, at + src[1] * size, out[to : to + src[1] * size])


def _element_array(buffer: Any, size: int) -> Any:
    """``buffer`` as a flat numpy array of unsigned integers of ``size`` bytes (a copy
    moves bytes: any dtype of that size will do)."""
    import numpy as np

    return np.frombuffer(buffer, dtype=np.dtype(f"u{size}") if size in (1, 2, 4, 8) else np.dtype(f"V{size}"))


def _copy_box(c: Copy, data: Any, first: int, target: Any) -> None:
    """Copy ``c.box`` from span elements ``data`` (of the fragment from ``first`` on) into
    ``target`` (the whole tensor, shaped)."""
    src_local = c.source.local_of(c.box)
    view = c.source.view
    if view:
        row = row_major_strides(view)[0]
        r0, r1 = src_local.offsets[0], src_local.offsets[0] + src_local.lengths[0]
        at = c.source.flat_offset + r0 * row - first
        src = data[at : at + (r1 - r0) * row].reshape((r1 - r0,) + tuple(view[1:]))
        src = src[(slice(None),) + tuple(slice(o, o + n) for o, n in zip(src_local.offsets[1:], src_local.lengths[1:]))]
    else:
        at = c.source.flat_offset - first
        src = data[at : at + 1].reshape(())
    dst_local = c.target.local_of(c.box)
    region = target[c.target.flat_offset : c.target.flat_offset + prod(c.target.view)].reshape(c.target.view)
    region[tuple(slice(o, o + n) for o, n in zip(dst_local.offsets, dst_local.lengths))] = src


def _span_read(entry: TensorEntry, sp: Span, out: memoryview, verify: bool) -> SpanRead:
    frag = entry.fragments[sp.fragment]
    size = itemsize(entry.dtype)
    nbytes = sp.stop - sp.start
    first = sp.start // size
    direct = [_direct(c, first, size, out) for c in sp.copies]
    segments = fill_gaps(nbytes, [s for s in direct if s.stop > s.start]) if None not in direct else None  # type: ignore[union-attr]
    finish: Callable[[SpanRead], None] | None = None
    if segments is None:  # not one run on both sides: read into scratch, then copy box by box
        segments = [Segment(0, nbytes)]

        def copy_out(read: SpanRead) -> None:
            data = _element_array(read.segments[0].buffer, size)
            target = _element_array(out, size)
            for c in sp.copies:
                _copy_box(c, data, first, target)
            read.segments = []  # let go of the scratch slice now

        finish = copy_out

    checks = block_checks(frag.crc32c, frag.block_bytes, frag.nbytes(entry.dtype), sp.start, sp.first_block,
                          sp.end_block) if verify else []
    return SpanRead(frag.file, frag.offset + sp.start, nbytes, segments, finish, {}, entry.name, checks)


def read_whole(storage: Storage, jobs: list[tuple[TensorEntry, Any]], span_bytes: int, verify: bool = True,
               pool: Executor | None = None, scratch: Scratch | None = None) -> int:
    """Fill each buffer of ``jobs`` (writable, exactly the entry's bytes) with the whole
    tensor of its entry, row-major, from the entry's fragments in ``storage``: spans of
    about ``span_bytes`` (widened to checksum blocks), checksums verified unless
    ``verify=False``, on ``pool``'s threads (the calling thread when None), ``scratch``
    reused from call to call. Returns the bytes read."""
    reads: list[SpanRead] = []
    for entry, buffer in jobs:
        out = memoryview(buffer).cast("B")
        if len(out) != entry.nbytes:
            raise ValueError(f"{entry.name!r}: a buffer of {len(out)} bytes for a tensor of {entry.nbytes}")
        if not entry.nbytes:
            continue
        entry, _, plan = plan_fill(entry, [whole_piece(entry.shape)], span_bytes, "of the source")
        reads.extend(_span_read(entry, sp, out, verify) for sp in plan.spans)
    execute(storage, reads, threads=1 if pool is None else 2, pool=pool, max_group=span_bytes or COALESCE_MAX,
            scratch=scratch)
    return sum(r.nbytes for r in reads)
