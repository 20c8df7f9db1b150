"""``convert``: offline consolidation into the "universal" form, one fragment per tensor.

The output is an ordinary unickpt checkpoint (same format, any reader loads it) whose
every tensor is stored whole, in one data file: what the Universal Checkpointing paper
calls the universal checkpoint, and the input of exports. Loading never *needs* it
(any layout loads any checkpoint directly); it makes a checkpoint independent of the
layout that wrote it, and fast to read whole.

Streaming with bounded memory: tensors are processed one at a time (small ones batched
up to ``buffer_bytes``). Each is assembled from the source fragments with the read plans
``load`` uses (``plan_reads``): ``threads`` threads read spans of about
``buffer_bytes / threads`` (widened to whole checksum blocks) into their own buffer,
verify every block, and copy into the tensor; then it is written in place with
parallel checksummed ``pwrite``s. Peak memory beyond the interpreter is therefore

    max(largest tensor, buffer_bytes) + threads * (buffer_bytes / threads + 2 * block_bytes)

whatever the size of the model. ``tests/test_rules_convert.py`` measures the peak RSS of
a subprocess consolidating a 42 MiB and a 168 MiB model with the same largest tensor.
Per-rank state (``unickpt.PerRank``) and plain values are copied as they are.

The report carries the source's ledger (:mod:`unickpt.format.ledger`): what was read, and
what the source's reader skipped (with the reasons, also kept in the new checkpoint's
``provenance["consolidated_from"]["skipped"]``) or could not account for. ``convert``
writes what the reader read; the command line refuses a source that is not ``complete``
unless ``--allow-skip`` is given.
"""

from __future__ import annotations

import datetime
import platform
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from .. import __version__
from ..errors import CorruptionError, SaveError, UnickptError
from ..adapters.detect import open_manifest
from ..adapters.regions import source_ledger
from ..format.checksum import crc32c
from ..format.dtypes import dtype_from_name, itemsize
from ..format.ledger import Ledger
from ..format.manifest import DEFAULT_BLOCK_BYTES, MANIFEST_NAME, Fragment, Manifest, TensorEntry
from ..plan.box import Box
from ..plan.piece import Piece, whole_piece
from ..plan.read_plan import Span, plan_reads
from ..storage.base import Storage
from ..storage.open import same_location, open_storage
from ..engine.gc_pause import gc_paused
from ..engine.items import TensorItem
from .load import direct_segments, source_fragments
from ..engine.reads import Segment, SpanRead, checksum_error, read_group
from .save import check_not_committed, claim, data_file_name
from ..engine.writer import DataFileWriter, as_bytes

DEFAULT_BUFFER_BYTES = 64 << 20


@dataclass
class ConvertReport:
    """What :func:`convert` did."""

    src: str
    dst: str
    tensors: int
    bytes_written: int
    bytes_read: int
    files: int
    seconds: float
    ledger: Ledger | None = None  # the source's: what was read, skipped, unaccounted


def total_bytes(manifest: Manifest) -> int:
    """Bytes of tensor data a consolidation writes (the total for a progress bar)."""
    n = sum(e.nbytes for e in manifest.tensors.values() if e.fragments)
    n += sum(e.nbytes for row in manifest.rank_tensors.values() for e in row if e is not None and e.fragments)
    return n


@gc_paused()
def convert(
    src: str,
    dst: str,
    *,
    consolidate: bool = True,
    threads: int = 4,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    overwrite: bool = False,
    verify: bool = True,
    progress: Callable[[int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ConvertReport:
    """Write a consolidated copy of checkpoint ``src`` to ``dst``: one fragment per tensor.

    Any tensor state passes through (model weights, every optimizer's per-parameter
    state, whatever its key), as do plain values, per-rank state and the metadata (so
    rules stored there still explain the layout the source was saved with). Memory is
    bounded by the largest tensor plus a fixed buffer (see the module docstring).
    ``progress(n)`` is called from the calling thread with the bytes just written.
    The new checkpoint is committed (manifest written) only once every byte is durable.
    The report's ``ledger`` accounts for the source: what its reader skipped (left out of
    the copy, named in ``provenance["consolidated_from"]["skipped"]``) and any bytes it
    could not account for; check ``report.ledger.complete`` (the command line refuses an
    incomplete source unless ``--allow-skip``).
    """
    if not consolidate:
        raise UnickptError("convert: only consolidate=True is implemented (one fragment per tensor)")
    if threads < 1 or buffer_bytes < 1 or block_bytes <= 0 or block_bytes % 8:
        raise UnickptError("convert: threads and buffer_bytes must be >= 1, block_bytes a positive multiple of 8")
    t0 = time.perf_counter()
    source = open_storage(src, storage_options)
    manifest = open_manifest(str(src), storage_options)
    ledger = source_ledger(str(src), manifest, storage_options)
    if same_location(src, dst):
        raise SaveError("convert: the destination must differ from the source")
    check_not_committed(dst, overwrite, storage_options)
    # written beside dst and swapped in at the end, like a save: a failure leaves dst as it
    # was (on an object store, written in place: the manifest uploaded last commits)
    write, out = claim(dst, overwrite, storage_options)
    try:
        result = _consolidate(manifest, source, out, threads, buffer_bytes, block_bytes, verify, progress, ledger.skipped)
        write.commit({MANIFEST_NAME: result.manifest.to_json().encode()})
    except BaseException:
        write.abort()
        raise
    finally:
        source.close()
    return ConvertReport(src, dst, len(result.manifest.tensors), result.bytes_written, result.bytes_read,
                         len(result.manifest.files), time.perf_counter() - t0, ledger)


@dataclass
class _Consolidated:
    manifest: Manifest
    bytes_written: int
    bytes_read: int


def _consolidate(
    manifest: Manifest, source: Storage, out: Storage, threads: int, buffer_bytes: int, block_bytes: int,
    verify: bool, progress: Callable[[int], None] | None, skipped: dict[str, str],
) -> _Consolidated:
    """Write every tensor of ``manifest`` whole into ``out``'s data files (durable);
    returns the new manifest, not yet written."""
    per_file: dict[str, list[TensorEntry]] = {}
    for e in manifest.tensors.values():
        if e.fragments and prod(e.shape) > 0:
            per_file.setdefault(data_file_name(0), []).append(e)
    for row in manifest.rank_tensors.values():
        for r, e in enumerate(row):
            if e is not None and e.fragments and prod(e.shape) > 0:
                per_file.setdefault(data_file_name(r), []).append(e)

    result = Manifest(world_size=manifest.world_size, metadata=dict(manifest.metadata))
    result.values = dict(manifest.values)
    result.rank_values = {k: list(v) for k, v in manifest.rank_values.items()}
    result.provenance = {
        "unickpt": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "world_size": manifest.world_size,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "consolidated_from": {
            "format": manifest.provenance.get("format", "unickpt"), "world_size": manifest.world_size,
            "created": manifest.provenance.get("created"),
        },
    }
    if skipped:
        result.provenance["consolidated_from"]["skipped"] = dict(skipped)
    frags: dict[tuple[str, int], Fragment] = {}
    bytes_read = bytes_written = 0
    span_bytes = max(1, buffer_bytes // threads)
    # all memory is allocated once: an arena holding the tensor(s) being consolidated, and
    # one read buffer per thread (grown at most to the largest span), so nothing depends
    # on how many tensors there are or on the allocator returning freed memory
    largest = max((aligned(e.nbytes) for es in per_file.values() for e in es), default=0)
    arena = torch.empty(max(largest, min(aligned(buffer_bytes), sum(aligned(e.nbytes) for es in per_file.values() for e in es))), dtype=torch.uint8)
    buffers = threading.local()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for fname, entries in per_file.items():
            rank = int(fname[len("rank_") : -len(".safetensors")])
            # the header needs only names, dtypes and shapes: meta tensors stand in for the data
            items = [
                TensorItem(e.name, torch.empty(e.shape, dtype=dtype_from_name(e.dtype), device="meta"), e.shape,
                           [whole_piece(e.shape)], 0, 1, "consolidated")
                for e in entries
            ]
            writer = DataFileWriter(out, fname, rank, items, block_bytes, threads)
            try:
                for batch in batches(list(enumerate(entries)), arena.numel()):
                    tensors, at = [], 0
                    for _, e in batch:
                        tensors.append(arena[at : at + e.nbytes].view(dtype_from_name(e.dtype)).view(e.shape))
                        at += aligned(e.nbytes)
                    bytes_read += read_whole(pool, buffers, source, [(e, t) for (_, e), t in zip(batch, tensors)], span_bytes, verify)
                    for (k, e), t in zip(batch, tensors):
                        writer.write([(k, 0, as_bytes(t))])
                        bytes_written += e.nbytes
                        if progress is not None:
                            progress(e.nbytes)
            except BaseException:
                writer.abort()
                raise
            size, fragments = writer.finish()
            result.files[fname] = size
            for e, f in zip(entries, fragments):
                frags[(e.name, rank)] = f

    for name, e in manifest.tensors.items():
        f = frags.get((name, 0))
        result.tensors[name] = TensorEntry(name, e.shape, e.dtype, [f] if f else [], _layout(e.layout))
    for name, row in manifest.rank_tensors.items():
        new_row: list[TensorEntry | None] = []
        for r, e in enumerate(row):
            if e is None:
                new_row.append(None)
                continue
            f = frags.get((name, r))
            new_row.append(TensorEntry(name, e.shape, e.dtype, [f] if f else [], "per-rank"))
        result.rank_tensors[name] = new_row
    return _Consolidated(result, bytes_written, bytes_read)


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of 64 (arena slots)."""
    return -(-n // 64) * 64


def read_whole(
    pool: ThreadPoolExecutor | None, buffers: threading.local, storage: Storage,
    jobs: list[tuple[TensorEntry, torch.Tensor]], span_bytes: int, verify: bool,
) -> int:
    """Fill each whole tensor ``out`` from its entry's fragments: spans of about
    ``span_bytes`` (widened to checksum blocks) read by the pool's threads (in the calling
    thread when ``pool`` is None), each block verified, then copied in place. A span whose
    bytes are exactly a contiguous region of ``out`` is read straight into it; the others
    go through a buffer per thread, reused. Returns the bytes read."""
    tasks = []
    for entry, out in jobs:
        size = itemsize(entry.dtype)
        plan = plan_reads([whole_piece(entry.shape)], source_fragments(entry), size, span_bytes)
        if plan.covered[0] != out.numel():
            raise CorruptionError(f"{entry.name!r}: the source's fragments hold {plan.covered[0]} of its {out.numel()} elements")
        tasks += [(entry, out, sp) for sp in plan.spans]

    def run(task: tuple[TensorEntry, torch.Tensor, Span]) -> int:
        entry, out, sp = task
        size = itemsize(entry.dtype)
        frag = entry.fragments[sp.fragment]
        n = sp.stop - sp.start
        segments = direct_segments(entry, sp, out)
        direct = segments is not None and len(segments) == 1 and (segments[0].start, segments[0].stop) == (0, n)
        if direct:
            buf = segments[0].target
        else:
            own = getattr(buffers, "buf", None)
            if own is None or own.numel() < n:
                own = buffers.buf = None  # drop the old buffer before making a larger one
                own = buffers.buf = torch.empty(n, dtype=torch.uint8)
            buf = own[:n]
        read_group(storage, [SpanRead(frag.file, frag.offset + sp.start, n, [Segment(0, n, buf)], tensor=entry.name)])
        mv = memoryview(buf.numpy())
        if verify and frag.crc32c:
            nbytes = prod(frag.shape) * size
            for b in range(sp.first_block, sp.end_block):
                lo, hi = b * frag.block_bytes, min(nbytes, (b + 1) * frag.block_bytes)
                if crc32c(mv[lo - sp.start : hi - sp.start]) != frag.crc32c[b]:
                    raise checksum_error(frag.file, entry.name, frag.offset + lo, frag.offset + hi)
        if not direct:
            data = buf.view(dtype_from_name(entry.dtype))
            for c in sp.copies:
                _target_region(out, c.box).copy_(_source_region(data, c.source, sp.start // size, c.box))
        return n

    return sum(map(run, tasks) if pool is None else pool.map(run, tasks))


def _target_region(out: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (o, k) in enumerate(zip(box.offsets, box.lengths)):
        out = out.narrow(d, o, k)
    return out


def _source_region(data: torch.Tensor, piece: Piece, first: int, box: Box) -> torch.Tensor:
    """The part of a span's data (elements from ``first`` of the fragment on) holding
    ``box`` (global coordinates, inside ``piece``)."""
    local = piece.local_of(box)
    if not piece.view:
        at = piece.flat_offset - first
        return data[at : at + 1].view(())
    row = prod(piece.view[1:])
    at = piece.flat_offset + local.offsets[0] * row - first
    t = data[at : at + local.lengths[0] * row].view((local.lengths[0],) + tuple(piece.view[1:]))
    for d in range(1, len(piece.view)):
        t = t.narrow(d, local.offsets[d], local.lengths[d])
    return t


def _layout(saved: str) -> str:
    return f"consolidated (saved as: {saved})" if saved else "consolidated"


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
