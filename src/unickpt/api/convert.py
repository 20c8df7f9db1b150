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
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from ..version import __version__
from ..errors import SaveError, UnickptError
from ..adapters.checkpoint import OpenCheckpoint, using_checkpoint
from ..adapters.regions import source_ledger
from ..format.dtypes import dtype_from_name
from ..format.ledger import Ledger
from ..format.manifest import DEFAULT_BLOCK_BYTES, MANIFEST_NAME, Fragment, Manifest, TensorEntry
from ..plan.piece import whole_piece
from ..storage.base import Storage
from ..storage.open import same_location
from ..engine.gc_pause import gc_paused
from ..engine.items import TensorItem
from ..engine.byte_reads import check_whole
from ..engine.reads import Scratch
from ..engine.tensor_reads import aligned, batches, read_tensors
from ..engine.commit import check_not_committed, claim, data_file_name
from ..engine.writer import DataFileWriter, as_bytes

__all__ = ["convert", "ConvertReport"]

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


@gc_paused()
def convert(
    src: str | OpenCheckpoint,
    dst: str,
    *,
    consolidate: bool = True,
    threads: int = 4,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    overwrite: bool = False,
    verify: bool = True,
    progress: Callable[[int], None] | None = None,
    ledger: Ledger | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ConvertReport:
    """Write a consolidated copy of checkpoint ``src`` (a path, or a checkpoint the caller
    opened with :func:`~unickpt.adapters.checkpoint.open_checkpoint`) to ``dst``: one
    fragment per tensor.

    Any tensor state passes through (model weights, every optimizer's per-parameter
    state, whatever its key), as do plain values, per-rank state and the metadata (so
    rules stored there still explain the layout the source was saved with). Memory is
    bounded by the largest tensor plus a fixed buffer (see the module docstring).
    ``progress(n)`` is called from the calling thread with the bytes just written.
    The new checkpoint is committed (manifest written) only once every byte is durable.
    The report's ``ledger`` accounts for the source: what its reader skipped (left out of
    the copy, named in ``provenance["consolidated_from"]["skipped"]``) and any bytes it
    could not account for; check ``report.ledger.complete`` (the command line refuses an
    incomplete source unless ``--allow-skip``). ``ledger``: the source's, when the caller
    has already built it (it is then not built twice).

    Args:
        src: The source checkpoint (any format ``load`` reads), or one opened by the caller.
        dst: Where the consolidated copy goes (a directory or URL, not ``src``).
        consolidate: One fragment per tensor (the only conversion implemented).
        threads: Parallel reads and writes.
        buffer_bytes: The fixed copy buffer.
        block_bytes: The checksum block of the copy (a positive multiple of 8).
        overwrite: Replace a committed checkpoint at ``dst``.
        verify: Check every byte read against its checksum.
        progress: Called with the bytes just written.
        ledger: The source's ledger, when the caller has built it.
        storage_options: Options of a URL's file system (fsspec).

    Returns:
        A :class:`ConvertReport`: tensors and bytes written, seconds, the source's ledger.

    Raises:
        UnickptError: A bad argument.
        SaveError: ``dst`` is ``src``, or holds a committed checkpoint without ``overwrite``.
        CorruptionError: A byte read fails its checksum.
    """
    if not consolidate:
        raise UnickptError("convert: only consolidate=True is implemented (one fragment per tensor)")
    if threads < 1 or buffer_bytes < 1 or block_bytes <= 0 or block_bytes % 8:
        raise UnickptError("convert: threads and buffer_bytes must be >= 1, block_bytes a positive multiple of 8")
    t0 = time.perf_counter()
    with using_checkpoint(src, storage_options) as ckpt:
        source, manifest = ckpt.storage, ckpt.manifest
        if ledger is None:
            ledger = source_ledger(ckpt)
        if same_location(ckpt.location, dst):
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
    return ConvertReport(ckpt.location, str(dst), len(result.manifest.tensors), result.bytes_written, result.bytes_read,
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

    for e in (e for es in per_file.values() for e in es):
        check_whole(e)  # before the arena is sized by the largest
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
    scratch = Scratch()
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
                    bytes_read += read_tensors(source, [(e, t) for (_, e), t in zip(batch, tensors)], span_bytes, verify,
                                               pool, scratch)
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


def _layout(saved: str) -> str:
    return f"consolidated (saved as: {saved})" if saved else "consolidated"
