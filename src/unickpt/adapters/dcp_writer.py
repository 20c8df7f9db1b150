"""Writing a PyTorch DCP (``torch.distributed.checkpoint``) checkpoint from any checkpoint
unickpt reads, so that ``dcp.load`` loads it on any world size.

The output is what DCP's own file system writer produces when one process saves the
whole state: data files ``__0_{k}.distcp`` in which every item is one complete
``torch.save`` archive (value items first, as DCP writes them), and ``.metadata``, a
pickle of DCP's own ``Metadata`` classes (the format's metadata *is* a pickle), written
last once every data file is durable (:mod:`unickpt.storage.output`: an old DCP
checkpoint at the destination stays whole until then).

Every tensor is stored whole, as one chunk at offset 0; ``dcp.load`` reshards it onto any
layout. Plain values become DCP byte items under DCP's flattened names (a list of dicts
such as ``optim.param_groups`` is flattened into ``optim.param_groups.0.lr`` ... exactly
as ``dcp.save`` flattens the live state, so ``dcp.load`` finds every key). ``planner_data``
maps each flat name to its object path: ``(name,)`` for a tensor (unickpt's names do not
say which dots were dict levels), ``(name, 0, "lr")`` for items of a flattened value;
a checkpoint ``dcp.save`` wrote through unickpt's StorageWriter keeps DCP's own map and
the objects DCP pickled (its ``metadata["dcp"]``): both are written back as DCP wrote
them, so the state's nesting survives the round trip. Per-rank state
(``unickpt.PerRank``) and the user's ``metadata=`` have no DCP equivalent: they are left
out, with a warning in the report.

Memory is bounded like ``convert``'s: tensors are read whole, a batch at a time, into one
reused arena (``max(largest tensor, buffer_bytes)``) with ``convert``'s threaded span
reader, then each file's items of the batch are written by one thread (files are filled
in parallel). Writes go through :mod:`unickpt.storage` (positional writes, early
writeback, one fsync per file).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import SaveError, UnickptError, os_error_text
from ..format.dtypes import dtype_from_name
from ..format.ledger import no_equivalent
from ..format.manifest import MANIFEST_NAME, Manifest, TensorEntry
from ..format.values import decode_value
from ..engine.reads import Scratch
from ..engine.byte_reads import check_whole
from ..engine.tensor_reads import aligned, batches, read_tensors
from ..storage.local import FileWriter
from ..storage.open import is_remote, open_storage, same_location
from ..storage.files import cleans_up_output
from ..storage.output import begin_output
from .dcp import DATA_SUFFIX, METADATA_NAME
from .checkpoint import OpenCheckpoint, using_checkpoint

DEFAULT_BUFFER_BYTES = 64 << 20
_COALESCE_BYTES = 1 << 20
FILE_SPLIT_BYTES = 256 << 20
_DATA_FILE = re.compile(r"__\d+_\d+" + re.escape(DATA_SUFFIX))


@dataclass
class DcpWriteReport:
    """What :func:`write_dcp` did."""

    src: str
    dst: str
    tensors: int
    values: int
    bytes_written: int
    files: int
    seconds: float
    warnings: list[str] = field(default_factory=list)


class _ItemStream(io.RawIOBase):
    """A write-only stream appending to a :class:`FileWriter` (what ``torch.save`` writes
    into): small writes are gathered into one ``pwrite``, large ones go straight through."""

    def __init__(self, writer: FileWriter) -> None:
        super().__init__()
        self._writer = writer
        self._flushed = 0
        self._pending = bytearray()
        self.error: OSError | None = None  # a failed write (torch.save turns it into a RuntimeError)

    def _pwrite(self, at: int, view: Any) -> None:
        try:
            self._writer.pwrite(at, view)
        except OSError as e:
            self.error = e
            raise

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._flushed + len(self._pending)

    def write(self, b: Any) -> int:  # type: ignore[override]
        view = memoryview(b).cast("B")
        n = view.nbytes
        if n >= _COALESCE_BYTES:
            self.flush()
            self._pwrite(self._flushed, view)
            self._flushed += n
        else:
            self._pending += view
            if len(self._pending) >= _COALESCE_BYTES:
                self.flush()
        return n

    def flush(self) -> None:
        if self._pending:
            self._pwrite(self._flushed, self._pending)
            self._flushed += len(self._pending)
            self._pending = bytearray()

    def discard(self) -> None:
        """Drop unwritten bytes (the write failed; the file is being abandoned)."""
        self._pending = bytearray()


def dcp_leaves(path: tuple[Any, ...], value: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``value`` flattened as ``dcp.save`` flattens state: every mapping is descended (keys
    as strings; an empty one yields nothing), a list only when it holds a mapping or a list
    that is descended; everything else (tuples too) is one item."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from dcp_leaves(path + (str(k),), v)
    elif isinstance(value, list) and not _terminal(value):
        for i, v in enumerate(value):
            yield from dcp_leaves(path + (i,), v)
    else:
        yield path, value


def _terminal(values: list[Any]) -> bool:
    return not any(isinstance(v, Mapping) or (isinstance(v, list) and not _terminal(v)) for v in values)


@cleans_up_output
def write_dcp(
    src: str | OpenCheckpoint,
    dst: str,
    *,
    progress: Callable[[int], None] | None = None,
    threads: int = 4,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    overwrite: bool = False,
) -> DcpWriteReport:
    """Write the checkpoint at ``src`` (any format unickpt reads) as a DCP checkpoint at
    ``dst`` (see the module docstring). ``progress(n)`` receives the tensor bytes just
    written; ``threads`` bounds the read threads and the number of data files (one per
    256 MiB of tensor data, each filled by its own thread). An existing
    DCP checkpoint at ``dst`` is replaced only with ``overwrite=True``."""
    if threads < 1 or buffer_bytes < 1:
        raise UnickptError("write_dcp: threads and buffer_bytes must be >= 1")
    t0 = time.perf_counter()
    with using_checkpoint(src) as ckpt:
        return _write_dcp(ckpt, dst, buffer_bytes, threads, overwrite, progress, t0)


def _write_dcp(ckpt: OpenCheckpoint, dst: str, buffer_bytes: int, threads: int, overwrite: bool,
               progress: Callable[[int], None] | None, t0: float) -> DcpWriteReport:
    from torch.distributed.checkpoint import filesystem as dcp_fs
    from torch.distributed.checkpoint import metadata as dcp_md

    manifest, source, old = ckpt.manifest, ckpt.storage, open_storage(dst)
    # a local source is its directory; a URL is never the same location as a local dst
    if same_location(ckpt.location if is_remote(source) else source.root, dst):
        raise SaveError("write_dcp: the destination must differ from the source")
    if old.exists(MANIFEST_NAME):
        raise SaveError(f"{dst} holds a unickpt checkpoint (manifest.json); write the DCP checkpoint elsewhere")
    if old.exists(METADATA_NAME) and not overwrite:
        raise SaveError(f"{dst} already holds a DCP checkpoint; pass overwrite=True to replace it")

    warnings = left_out(manifest)
    tensors = [e for e in manifest.tensors.values() if _has_data(e)]
    paths, pickled = written_by_dcp(manifest)
    values: list[tuple[str, tuple[Any, ...], Any]] = []
    for name, encoded in manifest.values.items():
        value = decode_value(encoded)
        if name in pickled and isinstance(value, bytes):  # DCP's own archive of an object: written back as it was
            values.append((name, (name,), _Archive(value)))
            continue
        for p, v in dcp_leaves((name,), value):
            values.append((".".join(map(str, p)), p, v))
    names = [e.name for e in tensors] + [fqn for fqn, _, _ in values]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SaveError(f"write_dcp: several entries flatten to the same DCP key: {dup[:5]}")

    for e in tensors:
        check_whole(e)  # before anything is sized by it
    # several files only for large checkpoints: one writer thread per file
    data_bytes = sum(e.nbytes for e in tensors)
    n_files = max(1, min(threads, len(tensors), -(-data_bytes // FILE_SPLIT_BYTES)))
    file_names = [f"__0_{k}{DATA_SUFFIX}" for k in range(n_files)]
    assign = _balance(tensors, n_files)
    folder = begin_output(str(dst), METADATA_NAME, lambda n: n == METADATA_NAME or bool(_DATA_FILE.fullmatch(n)))
    out = folder.storage
    writers: list[FileWriter] = []
    streams: list[_ItemStream] = []
    state_md: dict[str, Any] = {}
    storage_md: dict[Any, Any] = {}
    planner: dict[str, tuple[Any, ...]] = {}

    def put(k: int, t: torch.Tensor) -> tuple[int, int]:
        s = streams[k]
        start = s.tell()
        if t.nbytes < _COALESCE_BYTES:  # small: one archive in memory, one write (torch.save makes ~40 tiny writes)
            buf = io.BytesIO()
            torch.save(t, buf)
            s.write(buf.getbuffer())
        else:  # large: the data goes from the arena to the file without a copy
            torch.save(t, s)
        return start, s.tell() - start

    ok = False
    try:
        writers += [out.open_writer(f, 0) for f in file_names]
        streams += [_ItemStream(w) for w in writers]
        for fqn, p, v in values:  # DCP writes a file's byte items before its tensors
            buf = io.BytesIO(v.data) if isinstance(v, _Archive) else io.BytesIO()
            if not isinstance(v, _Archive):
                torch.save(v, buf)
            start = streams[0].tell()
            streams[0].write(buf.getbuffer())
            state_md[fqn] = dcp_md.BytesStorageMetadata()
            storage_md[dcp_md.MetadataIndex(fqn)] = dcp_fs._StorageInfo(file_names[0], start, streams[0].tell() - start)
            planner[fqn] = p

        largest = max((aligned(e.nbytes) for e in tensors), default=0)
        total = sum(aligned(e.nbytes) for e in tensors)
        arena = torch.empty(max(largest, min(aligned(buffer_bytes), total), 64), dtype=torch.uint8)
        arena_bytes = memoryview(arena.numpy())
        span_bytes = max(1, buffer_bytes // threads)
        scratch = Scratch()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for batch in batches(list(enumerate(tensors)), arena.numel()):
                views: list[torch.Tensor] = []
                at = 0
                for _, e in batch:
                    # a tensor owning exactly its bytes of the arena: torch.save writes its whole
                    # storage, so a plain view would write the arena
                    dt = dtype_from_name(e.dtype)
                    if e.nbytes:
                        raw = torch.frombuffer(arena_bytes[at : at + e.nbytes], dtype=torch.uint8)
                        views.append(raw.view(dt).view(e.shape))
                    else:
                        views.append(torch.empty(e.shape, dtype=dt))
                    at += aligned(e.nbytes)
                read_tensors(source, [(e, t) for (_, e), t in zip(batch, views) if e.nbytes], span_bytes, True, pool, scratch)
                per_file: dict[int, list[tuple[int, TensorEntry, torch.Tensor]]] = {}
                for (i, e), t in zip(batch, views):
                    per_file.setdefault(assign[i], []).append((i, e, t))

                def write_file(k: int, items: list[tuple[int, TensorEntry, torch.Tensor]]) -> list[tuple[int, int, int]]:
                    return [(i, *put(k, t)) for i, _, t in items]

                for fut in [pool.submit(write_file, k, items) for k, items in per_file.items()]:
                    for i, start, length in fut.result():
                        e = tensors[i]
                        zeros = torch.Size([0] * len(e.shape))
                        state_md[e.name] = dcp_md.TensorStorageMetadata(
                            properties=dcp_md.TensorProperties(dtype=dtype_from_name(e.dtype)),
                            size=torch.Size(e.shape),
                            chunks=[dcp_md.ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(e.shape))],
                        )
                        storage_md[dcp_md.MetadataIndex(e.name, zeros, 0)] = dcp_fs._StorageInfo(
                            file_names[assign[i]], start, length
                        )
                        planner[e.name] = (e.name,)
                        if progress is not None:
                            progress(e.nbytes)
        for s in streams:
            s.flush()
        for w in writers:
            w.close(durable=True)
        ok = True
    except (OSError, RuntimeError) as e:  # a full disk, a write error: named, never torch's zip writer's message
        failed = next((st for st in streams if st.error is not None), None)
        cause = failed.error if failed is not None else e if isinstance(e, OSError) else None
        if cause is None:
            raise
        where = os.path.normpath(getattr(failed._writer, "path", dst)) if failed is not None else dst
        raise SaveError(f"cannot write {where}: {os_error_text(cause)}; nothing was written to {dst}") from None
    finally:
        source.close()
        if not ok:
            for s in streams:
                s.discard()
            for w in writers:
                try:
                    w.close(durable=False)
                except OSError:
                    pass
            folder.abort()

    try:
        planner.update({k: p for k, p in paths.items() if k in planner})  # a DCP save's own nesting, kept
        # keys in the order of the source, as dcp.save would list its state
        order = {n: i for i, n in enumerate(names)}
        md = dcp_md.Metadata(
            state_dict_metadata=dict(sorted(state_md.items(), key=lambda kv: order[kv[0]])),
            planner_data=planner,
            storage_data=storage_md,
            storage_meta=dcp_md.StorageMeta(checkpoint_id=Path(dst), save_id=str(uuid.uuid4())),
            version=dcp_fs.CURRENT_DCP_VERSION,
        )
        sizes = sum(out.size(f) for f in file_names)
        folder.commit({METADATA_NAME: pickle.dumps(md)})
    except BaseException:
        folder.abort()
        raise
    return DcpWriteReport(ckpt.location, str(dst), len(tensors), len(values), sizes, len(file_names),
                          time.perf_counter() - t0, warnings)


def _balance(tensors: list[TensorEntry], n: int) -> list[int]:
    """File index of each tensor: largest first onto the least filled file (as DCP does)."""
    loads = [0] * n
    out = [0] * len(tensors)
    for i in sorted(range(len(tensors)), key=lambda i: -tensors[i].nbytes):
        k = min(range(n), key=lambda j: loads[j])
        out[i] = k
        loads[k] += tensors[i].nbytes
    return out


def _has_data(e: TensorEntry) -> bool:
    return bool(e.fragments) or prod(e.shape) == 0


class _Archive(NamedTuple):
    """A value DCP itself had stored as an object's archive (``torch.save`` bytes): its
    item is these bytes, as DCP wrote them."""

    data: bytes


def written_by_dcp(manifest: Manifest) -> tuple[dict[str, tuple[Any, ...]], set[str]]:
    """What a checkpoint saved through ``dcp.save`` with unickpt's StorageWriter keeps of
    DCP (its ``metadata["dcp"]``): the flattening map (flat name -> object path: the
    state's nesting) and the values that are DCP's own object archives. Empty for any
    other checkpoint; what is malformed is ignored."""
    info = _dcp_entry(manifest)
    if info is None:
        return {}, set()
    raw = info.get("planner_data")
    paths = {k: tuple(p) for k, p in raw.items() if isinstance(k, str) and isinstance(p, (list, tuple)) and p
             and all(type(x) in (str, int) for x in p) and ".".join(map(str, p)) == k} if isinstance(raw, dict) else {}
    pickled = info.get("pickled")
    return paths, {n for n in pickled if isinstance(n, str)} if isinstance(pickled, list) else set()


def _dcp_entry(manifest: Manifest) -> dict[str, Any] | None:
    """``metadata["dcp"]`` of a checkpoint unickpt's StorageWriter wrote (a dict holding
    ``planner_data``), or None."""
    if manifest.provenance.get("format", "unickpt") != "unickpt" or "dcp" not in manifest.metadata:
        return None
    try:
        info = decode_value(manifest.metadata["dcp"], "metadata.dcp")
    except UnickptError:
        return None
    return info if isinstance(info, dict) and "planner_data" in info else None


def left_out(manifest: Manifest) -> list[str]:
    """What :func:`write_dcp` leaves out of ``manifest``'s checkpoint, one line per kind
    (empty: everything is written). It can be asked before writing anything. The map a
    ``dcp.save`` through unickpt's StorageWriter kept (``metadata["dcp"]``) is DCP's own:
    written back, not left out."""
    out = []
    if manifest.rank_values or manifest.rank_tensors:
        keys = sorted(set(manifest.rank_values) | set(manifest.rank_tensors))
        out.append(no_equivalent("per-rank state", False, "DCP", keys))
    own = _dcp_entry(manifest) is not None
    if any(k != "dcp" or not own for k in manifest.metadata):
        out.append("the checkpoint's metadata= has no DCP equivalent and was left out")
    out += [f"{e.name!r} has no stored data in the source; left out" for e in manifest.tensors.values() if not _has_data(e)]
    return out
