"""A storage plugin for PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``, DCP).

    from unickpt.dcp import StorageReader, StorageWriter

    dcp.save(state, storage_writer=StorageWriter(path))        # a unickpt checkpoint
    dcp.async_save(state, storage_writer=StorageWriter(path))  # staged by unickpt, written in a thread
    dcp.load(state, storage_reader=StorageReader(path))        # any checkpoint unickpt reads

**Writing.** DCP's planner decides what each rank writes (the chunk of each tensor it
holds, replicas given to one rank, non-tensor items as byte items); :class:`StorageWriter`
writes it as unickpt's own save does: the coordinator claims the checkpoint location
(:func:`unickpt.engine.commit.claim`: the lock and staging directory, or an object-store
prefix) when DCP hands it the global plan, and sends the staging directory to every rank
inside the plan; each rank writes its chunks into ``rank_XXXXX.safetensors`` with
CRC-32C blocks (:class:`unickpt.engine.writer.DataFileWriter`) and returns its commit
report (:func:`unickpt.engine.commit.write_rank`) among its ``WriteResult``s; in
``finish`` the coordinator builds and checks the manifest from every rank's message
(:func:`unickpt.engine.assemble.manifest_document`: tiling, duplicates) and commits it
last, or removes everything written when any rank failed. A rank's failure travels in
its message, so the coordinator always gets to ``finish`` and no staging directory or
lock outlives a failed save. Every tensor chunk is one fragment of one box.

Non-tensor items: a value unickpt can store exactly (None, bool, int, float, str, bytes
and lists, tuples, dicts of them, of exactly those types) is stored as a plain value
(``unickpt.load`` returns it); anything else is stored as the bytes DCP's planner made of
it (a ``torch.save`` pickle), opaque: ``unickpt.load`` returns those bytes and never
unpickles them, :class:`StorageReader` hands them back to DCP, whose planner unpickles
them (as DCP's own reader does). Their names are listed in the manifest's
``metadata["dcp"]["pickled"]``, next to DCP's flattening map (``planner_data``).

**Staging.** :class:`StorageWriter` is DCP's ``AsyncStager``: ``dcp.async_save`` calls
its :meth:`StorageWriter.stage`, which copies every tensor into one host buffer
(pinned for CUDA sources, copied on a side stream; :mod:`unickpt.engine.staging`), and
the buffer is reused by the next save once DCP has let go of the staged state.

**Reading.** :class:`StorageReader` opens the location with
:func:`unickpt.adapters.checkpoint.open_checkpoint` (unickpt's format, DCP, DeepSpeed,
Megatron-Core, Hugging Face) and describes it as DCP ``Metadata``: a tensor whose
fragments each hold one box is listed with those boxes as its chunks; any other tensor
(ZeRO flat partitions, fused or padded pieces) as one chunk, the whole tensor. Whatever
box DCP's planner asks of a chunk is served by unickpt's read plan
(:class:`unickpt.engine.tensor_reads.TensorReads`: the fragments holding it, every
checksum block verified), so DCP reshards and unickpt reads only the bytes asked for.
Per-rank state (``unickpt.PerRank``) and items an adapter skipped are not listed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import threading
import weakref
from math import prod
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.futures import Future

from .adapters.checkpoint import OpenCheckpoint, open_checkpoint
from .adapters.detect import checkpoint_format
from .adapters.dcp_writer import dcp_leaves
from .engine.assemble import manifest_document
from .engine.collect import LocalState
from .engine.commit import Written, check_not_committed, claim, data_file_name, rank_storage, write_rank
from .dist import is_dtensor
from .engine.items import TensorItem
from .engine.save_options import SaveOptions
from .engine.staging import StagingPool, copy_batch, plan_batches, record_streams
from .engine.tensor_reads import TensorReads
from .engine.writer import DataFileWriter, as_bytes
from .errors import CheckpointExistsError, SaveError, UnickptError
from .format.dtypes import dtype_from_name, dtype_name
from .format.manifest import DEFAULT_BLOCK_BYTES, TensorEntry
from .format.values import decode_value, encode_value
from .plan.box import Box
from .plan.piece import box_piece
from .storage.open import is_remote, local_path, url_scheme

__all__ = ["StorageWriter", "StorageReader"]

LAYOUT = "dcp"  # the informative layout of tensors written through DCP
_REPORT = "__unickpt_rank_report__"  # the fqn of the WriteResult carrying a rank's commit message
_STAGING_KEY = "unickpt_staging"
_BATCH_BYTES = 64 << 20  # tensors resolved (and, off the CPU, copied) ahead of writing
_PLAIN = (type(None), bool, int, float, str, bytes)


@dataclasses.dataclass(frozen=True)
class _Report:
    """What one rank sends the coordinator in its ``WriteResult``s: its commit message and
    the names of the byte items it stored as opaque pickles."""

    rank: int
    message: bytes
    pickled: tuple[str, ...] = ()


def _is_plain(v: Any, depth: int = 0) -> bool:
    """True when ``v`` is made of exactly the types unickpt's plain values give back
    (no subclasses: an IntEnum or a numpy float would come back as another type)."""
    if depth > 100:
        return False
    t = type(v)
    if t in _PLAIN:
        return True
    if t in (list, tuple):
        return all(_is_plain(x, depth + 1) for x in v)
    if t is dict:
        return all(type(k) in _PLAIN and _is_plain(x, depth + 1) for k, x in v.items())
    return False


def _default_transform(planner: Any) -> bool:
    """True when ``planner`` turns byte items into bytes as DCP's default planner does
    (``torch.save`` of the object it looks up), so a plain value can be stored as itself."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    return isinstance(planner, DefaultSavePlanner) and \
        type(planner).transform_object is DefaultSavePlanner.transform_object and \
        type(planner).resolve_data is DefaultSavePlanner.resolve_data


class _Lender:
    """Host buffers for :meth:`StorageWriter.stage`, one per save in flight: a buffer goes
    back to the idle list when DCP drops the state staged in it (a finalizer on that
    state), so a save in flight never shares memory with the next one's staging."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[StagingPool] = []

    def take(self) -> StagingPool:
        with self._lock:
            return self._idle.pop() if self._idle else StagingPool()

    def give_back(self, pool: StagingPool) -> None:
        with self._lock:
            if len(self._idle) < 2:  # keep at most two idle buffers
                self._idle.append(pool)


_LENDER = _Lender()


class _Staged(dict):
    """A staged state dict (a dict that can be weakly referenced)."""


class StorageWriter(_storage.StorageWriter, AsyncStager):
    """DCP storage writer producing a unickpt checkpoint at ``path`` (a directory or an
    fsspec URL, ``storage_options`` for its file system); see the module docstring.

    ``overwrite``: replace a checkpoint already committed at ``path``. The default (None)
    is ``FileSystemWriter``'s where that costs no safety: a local directory is overwritten
    (the new checkpoint is swapped in by the commit, the old one stays whole until then),
    an object-store prefix is not (its old manifest would go first). A refused save fails
    with :class:`~unickpt.SaveError` saying "Checkpoint already exists" before writing
    anything.
    ``metadata``: stored as the checkpoint's ``metadata`` (plain values; the key ``dcp`` is
    unickpt's). ``threads`` write each rank's file; ``block_bytes`` is the checksum block.
    """

    _synchronize_after_execute = False  # stage() returns once the copy is complete

    def __init__(self, path: str | os.PathLike, *, overwrite: bool | None = None, metadata: dict[str, Any] | None = None,
                 threads: int = 4, block_bytes: int = DEFAULT_BLOCK_BYTES,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.options = SaveOptions.from_keywords(threads=max(1, threads), block_bytes=block_bytes)
        if metadata is not None and "dcp" in metadata:
            raise SaveError("StorageWriter: the metadata key 'dcp' is unickpt's (DCP's flattening map)")
        self.path = os.fspath(path)
        self.overwrite = overwrite
        self.metadata = dict(metadata or {})
        self.storage_options = storage_options
        self._rank = 0
        self._claim: Any = None

    # -- DCP's StorageWriter ----------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new save (to ``checkpoint_id`` when given); a claim a failed save left
        on this writer is given up."""
        self._abort()
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Learn this rank's role; refuses ``use_collectives=False`` (the manifest is
        built from every rank's report, which only the coordinator's ``finish`` sees)."""
        if kwargs.get("use_collectives", True) is False:
            raise SaveError("unickpt's StorageWriter needs use_collectives=True: the coordinator commits one manifest "
                            "built from every rank's report")
        self._rank = int(kwargs.get("rank", dist.get_rank() if dist.is_available() and dist.is_initialized() else 0))
        if is_coordinator:
            with _refusal(self.path):
                check_not_committed(self.path, self._overwrite(), self.storage_options)

    def prepare_local_plan(self, plan: Any) -> Any:
        """The plan as DCP's planner made it."""
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """Coordinator: claim the location (lock, staging directory; or the object-store
        prefix) and tell every rank where to write, in its plan's ``storage_data``."""
        self._abort()
        with _refusal(self.path):
            write, _ = claim(self.path, self._overwrite(), self.storage_options)
        self._claim = write
        where = getattr(write, "staging_from_target", "")
        return [dataclasses.replace(p, storage_data={_STAGING_KEY: where}) for p in plans]

    def write_data(self, plan: Any, planner: Any) -> Future:
        """Write this rank's items into its data file; the ``WriteResult``s end with this
        rank's report (its commit message, or its error: a failure is reported, not raised,
        so that the coordinator commits nothing and removes what the save wrote)."""
        from torch.distributed.checkpoint.storage import WriteResult

        pickled: list[str] = []
        sizes: list[int] = []
        local = LocalState()
        report = write_rank(self._rank, local, lambda: self._write(plan, planner, local, pickled, sizes))
        results = [WriteResult(index=item.index, size_in_bytes=n, storage_data=None) for item, n in zip(plan.items, sizes)]
        results.append(WriteResult(index=MetadataIndex(_REPORT), size_in_bytes=0,
                                   storage_data=_Report(self._rank, report.message(), tuple(pickled))))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        """Coordinator: check every rank's report and commit the manifest (last), or
        remove everything the save wrote and raise the ranks' errors."""
        write, self._claim = self._claim, None
        if write is None:
            raise SaveError("StorageWriter.finish: this writer holds no claim (prepare_global_plan did not run here)")
        try:
            reports = []
            for rank, rows in enumerate(results):
                found = [r.storage_data for r in rows if isinstance(r.storage_data, _Report)]
                if len(found) != 1 or found[0].rank != rank:
                    raise SaveError(f"rank {rank} sent no unickpt report (was it saving with another StorageWriter?)")
                reports.append(found[0])
            meta = dict(self.metadata)
            meta["dcp"] = {"planner_data": _planner_paths(getattr(metadata, "planner_data", None)),
                           "pickled": sorted(n for r in reports for n in r.pickled)}
            docs = manifest_document([r.message for r in reports], len(results), meta)
            write.commit(docs)
        except BaseException:
            write.abort()
            raise

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True where unickpt can write a checkpoint: a local path with an existing,
        writable parent directory, or a URL of a file system fsspec knows."""
        if not isinstance(checkpoint_id, (str, os.PathLike)):
            return False
        if is_remote(checkpoint_id):
            return _known_scheme(checkpoint_id)
        path = os.path.abspath(local_path(checkpoint_id))
        return any(os.path.isdir(p) and os.access(p, os.W_OK) for p in [path, *_parents(path)])

    def _overwrite(self) -> bool:
        return not is_remote(self.path) if self.overwrite is None else self.overwrite

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint location, as DCP records it."""
        return StorageMeta(checkpoint_id=self.path)

    # -- DCP's AsyncStager ------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` that later training steps do not change: every tensor
        (a DTensor's local shard) copied into one reused host buffer, pinned when a
        source is on CUDA (copies on a side stream, after the work queued so far);
        containers rebuilt, other objects deep-copied."""
        import copy

        sources: list[torch.Tensor] = []

        def collect(v: Any) -> None:
            if isinstance(v, torch.Tensor):
                local = v._local_tensor if is_dtensor(v) else v
                if type(local) is not torch.Tensor and not isinstance(local, torch.nn.Parameter):
                    raise SaveError(f"StorageWriter.stage: cannot stage a {type(v).__name__} (plain tensors and DTensors only)")
                sources.append(local.detach())
            elif isinstance(v, dict):
                for x in v.values():
                    collect(x)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    collect(x)

        collect(state_dict)
        sizes = [t.numel() * t.element_size() for t in sources]
        batches, cap = plan_batches(sizes, [True] * len(sources), None, 64)
        pool = _LENDER.take()
        buf = pool.buffer(cap, pin=any(t.is_cuda for t in sources))
        copy_batch(batches[0], sources, buf, record_streams(sources), {})
        slots = {u.index: u.slot for u in batches[0]}
        at = iter(range(len(sources)))

        def rebuild(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                k = next(at)
                src = sources[k]
                staged = (buf[slots[k]: slots[k] + sizes[k]].view(src.dtype).view(src.shape) if sizes[k]
                          else torch.empty(src.shape, dtype=src.dtype))
                if is_dtensor(v):
                    return type(v)(staged, v._spec, requires_grad=False)
                return staged
            if isinstance(v, dict):
                return {k: rebuild(x) for k, x in v.items()}
            if isinstance(v, list):
                return [rebuild(x) for x in v]
            if isinstance(v, tuple):
                return tuple(rebuild(x) for x in v)
            return copy.deepcopy(v)

        out = _Staged({k: rebuild(v) for k, v in state_dict.items()})
        weakref.finalize(out, _LENDER.give_back, pool)
        return out

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Nothing to release: the staging buffers are shared by the process's writers."""

    # -- internals --------------------------------------------------------------------

    def _abort(self) -> None:
        write, self._claim = self._claim, None
        if write is not None:
            write.abort()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_claim"] = None  # a claim (open lock) stays with the process that made it
        return state

    def _write(self, plan: Any, planner: Any, local: LocalState, pickled: list[str], sizes: list[int]) -> Written:
        """Write this rank's items (their values into ``local``); returns what it wrote."""
        if getattr(planner, "_enable_plan_caching", False):
            raise SaveError("unickpt's StorageWriter does not support DCP's plan caching (enable_plan_caching=True): "
                            "a cached plan names an earlier save's staging directory")
        where = plan.storage_data.get(_STAGING_KEY) if isinstance(plan.storage_data, dict) else None
        if where is None:
            raise SaveError("the save plan carries no unickpt staging location (the coordinator is not using unickpt's StorageWriter)")
        plain_values = _default_transform(planner)
        items: list[tuple[Any, TensorItem]] = []
        for wi in plan.items:
            fqn = wi.index.fqn
            if wi.type == WriteItemType.BYTE_IO:
                obj = planner.lookup_object(wi.index) if plain_values else None
                if plain_values and _is_plain(obj):
                    local.values[fqn] = encode_value(obj, fqn)
                    sizes.append(0)
                else:
                    raw = planner.resolve_data(wi)
                    data = raw.getvalue() if isinstance(raw, io.BytesIO) else bytes(raw)
                    local.values[fqn] = encode_value(data, fqn)
                    pickled.append(fqn)
                    sizes.append(len(data))
                continue
            td = wi.tensor_data
            shape, offsets, lengths = tuple(td.size), tuple(td.chunk.offsets), tuple(td.chunk.sizes)
            dtype = td.properties.dtype
            sizes.append(prod(lengths) * dtype.itemsize)
            if prod(lengths) == 0:
                if prod(shape) == 0:
                    local.declared[fqn] = (shape, dtype_name(dtype), LAYOUT)
                continue
            piece = box_piece(lengths, Box.whole(lengths), Box(offsets, lengths))
            items.append((wi, TensorItem(fqn, torch.empty(lengths, dtype=dtype, device="meta"), shape, [piece], 0, 1, LAYOUT)))
        files: dict[str, int] = {}
        written = []
        if items:
            storage = rank_storage(self.path, where, self.storage_options)
            name = data_file_name(self._rank)
            writer = DataFileWriter(storage, name, self._rank, [t for _, t in items], self.options.block_bytes,
                                    self.options.threads)
            try:
                batch: list[tuple[int, int, memoryview]] = []  # (each view keeps its tensor alive)
                nbytes = 0
                for k, (wi, item) in enumerate(items):
                    t = planner.resolve_data(wi)
                    if not isinstance(t, torch.Tensor) or t.dtype != item.local.dtype or tuple(t.shape) != tuple(item.local.shape):
                        raise SaveError(f"{item.name!r}: the planner resolved {type(t).__name__} "
                                        f"{getattr(t, 'dtype', '')} {list(getattr(t, 'shape', []))}, "
                                        f"the plan says {item.local.dtype} {list(item.local.shape)}")
                    t = t.detach()
                    t = (t if t.device.type == "cpu" else t.to("cpu")).contiguous()
                    batch.append((k, 0, as_bytes(t)))
                    nbytes += t.nbytes
                    if nbytes >= _BATCH_BYTES:
                        writer.write(batch)
                        batch, nbytes = [], 0
                writer.write(batch)
            except BaseException:
                writer.abort()
                raise
            size, fragments = writer.finish()
            files[name] = size
            written = [(item, f) for (_, item), f in zip(items, fragments)]
        return Written(written, files)


@contextlib.contextmanager
def _refusal(path: str) -> Iterator[None]:
    """A refusal to replace a committed checkpoint says it in ``FileSystemWriter``'s
    words too ("Checkpoint already exists"), which code written for DCP looks for."""
    try:
        yield
    except CheckpointExistsError as e:
        raise SaveError(f"Checkpoint already exists: {e}") from None


def _known_scheme(url: str | os.PathLike) -> bool:
    """True when an installed fsspec file system serves ``url``'s scheme."""
    try:
        import fsspec

        fsspec.get_filesystem_class(url_scheme(url))
    except (ImportError, ValueError):
        return False
    return True


def _parents(path: str) -> list[str]:
    out = []
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        out.append(path)
    return out


def _planner_paths(data: Any) -> dict[str, tuple[Any, ...]]:
    """DCP's flattening map (flat name -> object path), kept where it is well formed."""
    if not isinstance(data, dict):
        return {}
    return {k: tuple(p) for k, p in data.items()
            if isinstance(k, str) and isinstance(p, (tuple, list)) and all(type(x) in (str, int) for x in p)}


def _plain_boxes(entry: TensorEntry) -> list[Box] | None:
    """The global boxes of ``entry``'s fragments when each fragment holds exactly one box
    (its whole data, row-major): DCP chunks. None for any other layout."""
    boxes = []
    for f in entry.fragments:
        if len(f.pieces) != 1:
            return None
        p = f.pieces[0]
        if p.flat_offset or p.view != tuple(f.shape) or p.global_box.lengths != tuple(f.shape) or any(p.local_offsets):
            return None
        boxes.append(p.global_box)
    return boxes


class StorageReader(_storage.StorageReader):
    """DCP storage reader of any checkpoint unickpt reads at ``path`` (a directory or an
    fsspec URL, ``storage_options`` for its file system); see the module docstring.
    ``threads`` read in parallel; every checksum block read is verified (corrupt bytes
    raise :class:`~unickpt.CorruptionError`, nothing is loaded from them)."""

    def __init__(self, path: str | os.PathLike, *, threads: int = 4, storage_options: dict[str, Any] | None = None) -> None:
        self.path = os.fspath(path)
        self.threads = max(1, threads)
        self.storage_options = storage_options
        self._ckpt: OpenCheckpoint | None = None
        self._values: dict[str, Any] = {}  # flat name -> plain value, or bytes of an opaque pickle
        self._pickled: set[str] = set()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new load (from ``checkpoint_id`` when given)."""
        self._close()
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def read_metadata(self) -> Metadata:
        """DCP ``Metadata`` of the checkpoint: tensors with their chunks (see the module
        docstring), values as byte items under DCP's flattened names."""
        self._close()
        self._ckpt = ckpt = open_checkpoint(self.path, self.storage_options)
        m = ckpt.manifest
        sdm: dict[str, Any] = {}
        planner_data: dict[str, tuple[Any, ...]] = {}
        for name, e in m.tensors.items():
            boxes = None if m.version[0] >= 2 else _plain_boxes(e)  # an indexed manifest: fragments read on demand
            if not boxes or not prod(e.shape):
                boxes = [Box.whole(e.shape)]
            chunks = [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.lengths)) for b in boxes]
            sdm[name] = TensorStorageMetadata(TensorProperties(dtype=dtype_from_name(e.dtype)), torch.Size(e.shape), chunks)
            planner_data[name] = (name,)
        dcp_info = decode_value(m.metadata.get("dcp", {}), "metadata.dcp") if m.provenance.get("format", "unickpt") == "unickpt" else {}
        stored_paths = _planner_paths(dcp_info.get("planner_data")) if isinstance(dcp_info, dict) else {}
        pickled = dcp_info.get("pickled") if isinstance(dcp_info, dict) else None
        pickled = {n for n in pickled if isinstance(n, str)} if isinstance(pickled, list) else set()
        self._values, self._pickled = {}, set()
        for name, enc in m.values.items():
            value = decode_value(enc, name)
            if name in pickled and isinstance(value, bytes):
                leaves = [((name,), value)]
                self._pickled.add(name)
            else:
                leaves = list(dcp_leaves((name,), value))
            for p, v in leaves:
                fqn = ".".join(map(str, p))
                if fqn in sdm:
                    raise UnickptError(f"{self.path}: {fqn!r} names both a tensor and a value; DCP cannot tell them apart")
                sdm[fqn] = BytesStorageMetadata()
                planner_data[fqn] = p
                self._values[fqn] = v
        planner_data.update({k: p for k, p in stored_paths.items() if k in sdm})
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=None,
                        storage_meta=StorageMeta(checkpoint_id=self.path), version=CURRENT_DCP_VERSION)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: :meth:`read_metadata` opened the checkpoint."""

    def prepare_local_plan(self, plan: Any) -> Any:
        """The plan as DCP's planner made it."""
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """The plans as DCP's planner made them."""
        return plans

    def read_data(self, plan: Any, planner: Any) -> Future:
        """Serve every item of ``plan``: byte items through ``planner.load_bytes``, each
        tensor box (any box of a chunk) by unickpt's verified read into the tensor
        ``planner.resolve_tensor`` gives, then ``planner.commit_tensor``."""
        if self._ckpt is None:
            self.read_metadata()
        ckpt = self._ckpt
        try:
            reads = TensorReads(ckpt.storage, self.threads, verify=True)
            filled: list[tuple[Any, torch.Tensor]] = []
            for req in plan.items:
                fqn = req.storage_index.fqn
                if req.type == LoadItemType.BYTE_IO:
                    buf = io.BytesIO()
                    if fqn in self._pickled:
                        buf.write(self._values[fqn])
                    else:
                        torch.save(self._values[fqn], buf)
                    buf.seek(0)
                    planner.load_bytes(req, buf)
                    continue
                entry = ckpt.manifest.tensors[fqn]
                origin = tuple(req.storage_index.offset or (0,) * len(entry.shape))
                lengths = tuple(req.lengths)
                box = Box(tuple(o + s for o, s in zip(origin, req.storage_offsets)), lengths)
                target = planner.resolve_tensor(req).detach()
                if tuple(target.shape) != lengths:
                    raise UnickptError(f"{fqn!r}: the planner's target has shape {list(target.shape)}, the request {list(lengths)}")
                if prod(lengths):
                    reads.add(entry, target, [box_piece(lengths, Box.whole(lengths), box)])
                filled.append((req, target))
            reads.run()
            for req, target in filled:
                planner.commit_tensor(req, target)
        finally:
            self._close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True where unickpt can read a checkpoint: a local directory holding one of the
        formats it reads (unickpt's, DCP, DeepSpeed, Megatron-Core, Hugging Face), or a
        URL of a file system fsspec knows (the store is not contacted here)."""
        if not isinstance(checkpoint_id, (str, os.PathLike)):
            return False
        if is_remote(checkpoint_id):
            return _known_scheme(checkpoint_id)
        try:
            checkpoint_format(local_path(checkpoint_id))
        except (UnickptError, OSError):
            return False
        return True

    def _close(self) -> None:
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is not None:
            ckpt.close()
