"""``load``: fill a target state in place from a checkpoint saved on any layout.

Collective in name only: each rank plans and reads independently (no communication), so
a rank that fails cannot hang the others, and a single process needs no process group.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from math import prod
from typing import Any

import torch

from ..dist import resolve_group
from ..errors import CorruptionError, LayoutError, ManifestError, MismatchError
from ..format.checksum import block_crcs
from ..format.dtypes import dtype_from_name, dtype_name, itemsize
from ..adapters.detect import open_manifest
from ..format.manifest import Manifest, TensorEntry
from ..format.values import decode_value
from ..plan.box import row_major_strides
from ..plan.piece import Piece, whole_piece
from ..plan.read_plan import Copy, ReadPlan, SourceFragment, Span, plan_reads
from ..storage.local import LocalStorage
from .gc_pause import gc_paused
from .items import is_dtensor, sharded_item, tensor_item
from .replicated import ReplicatedReads
from .reads import Scratch, Segment, SpanRead, check_in_file, checksum_error, coalesce, crc_blocks, fill_gaps, read_group
from .optim_state import NamedOptimizer
from .state import PerRank, Sharded, flatten


def read_manifest(path: str) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``path``: unickpt's own, or the
    one built from a foreign format's metadata (PyTorch DCP, DeepSpeed, Hugging Face)."""
    return open_manifest(str(path))


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


def _target_view(local: torch.Tensor, piece: Piece) -> torch.Tensor:
    if piece.flat_offset == 0 and piece.view == tuple(local.shape):
        return local
    if not local.is_contiguous():
        raise LayoutError(f"a target tensor with flat pieces must be contiguous (shape {tuple(local.shape)})")
    return local.reshape(-1)[piece.flat_offset : piece.flat_offset + prod(piece.view)].view(piece.view)


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
        dst = _narrow(_target_view(local, c.target), dst_local.offsets, dst_local.lengths, False)
        if not (src.is_contiguous() and dst.is_contiguous()):
            return None
        if dst.numel():
            at = src.storage_offset() * size
            out.append(Segment(at, at + dst.numel() * size, dst.detach().reshape(-1).view(torch.uint8)))
    return out


class _Reader:
    """Executes read plans: reads spans, verifies their blocks, copies into targets."""

    def __init__(self, storage: LocalStorage, threads: int, verify: bool) -> None:
        self.storage = storage
        self.threads = threads
        self.verify = verify
        self.jobs: list[tuple[TensorEntry, list[SourceFragment], Span, torch.Tensor]] = []
        self.bytes_read = 0
        self.files_read: set[str] = set()
        self._scratch = Scratch()

    def add(self, entry: TensorEntry, sources: list[SourceFragment], spans: list[Span], local: torch.Tensor) -> None:
        for sp in spans:
            self.jobs.append((entry, sources, sp, local))

    def _span_read(self, entry: TensorEntry, sp: Span, local: torch.Tensor) -> SpanRead:
        """How to read one span: straight into the target where its bytes land unchanged
        (CPU target, contiguous on both sides), else into a buffer then copy."""
        frag = entry.fragments[sp.fragment]
        nbytes = sp.stop - sp.start
        direct = direct_segments(entry, sp, local)
        segments = fill_gaps(nbytes, direct) if direct is not None else None
        buffered = segments is None
        if buffered:
            segments = [Segment(0, nbytes)]
        return SpanRead(frag.file, frag.offset + sp.start, nbytes, segments, self._finish, {"job": (entry, sp, local, buffered)},
                        entry.name)

    def _finish(self, read: SpanRead) -> None:
        entry, sp, local, buffered = read.extra["job"]
        frag = entry.fragments[sp.fragment]
        size = itemsize(entry.dtype)
        if self.verify and frag.crc32c:
            nbytes = prod(frag.shape) * size
            blocks = range(sp.first_block, sp.end_block)
            bounds = [(b * frag.block_bytes - sp.start, min(nbytes, (b + 1) * frag.block_bytes) - sp.start) for b in blocks]
            for b, (lo, hi), got in zip(blocks, bounds, crc_blocks(read.segments, bounds)):
                if got != frag.crc32c[b]:
                    raise checksum_error(frag.file, entry.name, frag.offset + sp.start + lo, frag.offset + sp.start + hi)
        if buffered:
            data = read.segments[0].buffer.view(dtype_from_name(entry.dtype))
            first = sp.start // size
            for c in sp.copies:
                self._copy(c, data, first, local)
        read.segments = []  # drop scratch memory now

    def _run_group(self, group: list[SpanRead]) -> None:
        self._scratch.assign(group)
        read_group(self.storage, group)
        for read in group:
            read.finish(read)

    @staticmethod
    def _copy(c: Copy, data: torch.Tensor, first: int, local: torch.Tensor) -> None:
        src_local = c.source.local_of(c.box)
        rows = (src_local.offsets[0], src_local.offsets[0] + src_local.lengths[0]) if src_local.ndim else (0, 1)
        src = _narrow(_region(data, c.source, first, rows), src_local.offsets, src_local.lengths, True)
        dst_local = c.target.local_of(c.box)
        dst = _narrow(_target_view(local, c.target), dst_local.offsets, dst_local.lengths, False)
        dst.copy_(src, non_blocking=False)

    def run(self) -> None:
        """Execute every added span, several in flight."""
        self.bytes_read += sum(sp.stop - sp.start for _, _, sp, _ in self.jobs)
        self.files_read.update(e.fragments[sp.fragment].file for e, _, sp, _ in self.jobs)
        if not self.jobs:
            return
        reads = [self._span_read(e, sp, local) for e, _, sp, local in self.jobs]
        groups = coalesce(reads)
        if len(groups) == 1 or self.threads <= 1:
            for g in groups:
                self._run_group(g)
            return
        with ThreadPoolExecutor(max_workers=max(1, min(self.threads, len(groups)))) as pool:
            for f in [pool.submit(self._run_group, g) for g in groups]:
                f.result()


def source_fragments(entry: TensorEntry) -> list[SourceFragment]:
    """What the read planner needs to know of each stored fragment of ``entry``."""
    size = itemsize(entry.dtype)
    return [
        SourceFragment(f.file, f.offset, prod(f.shape) * size, f.block_bytes, tuple(f.pieces)) for f in entry.fragments
    ]


def plan_fill(entry: TensorEntry, pieces: list[Piece]) -> tuple[TensorEntry, list[SourceFragment], ReadPlan]:
    """The reads that fill ``pieces`` (a target's pieces of ``entry``'s global tensor),
    after checking the checkpoint covers every element: the entry with only the fragments
    considered (an indexed manifest reads only those near the pieces), what the planner
    knew of them, and the plan (its spans index that entry's fragments). No I/O beyond
    an indexed manifest's lines: ``load`` and the scale simulation (``bench/scale.py``)
    both call it."""
    near = entry.fragments_touching([p.global_box for p in pieces])
    if near is not entry.fragments:
        entry = TensorEntry(entry.name, entry.shape, entry.dtype, near, entry.layout)
    sources = source_fragments(entry)
    plan = plan_reads(pieces, sources, itemsize(entry.dtype))
    for p, got in zip(pieces, plan.covered):
        if got != p.global_box.volume:
            raise CorruptionError(
                f"{entry.name!r}: the checkpoint holds {got} of the {p.global_box.volume} elements "
                f"this rank needs (box {p.global_box}); its fragments are incomplete"
            )
    return entry, sources, plan


def _fill(reader: _Reader, entry: TensorEntry, local: torch.Tensor, pieces: list[Piece]) -> None:
    entry, sources, plan = plan_fill(entry, pieces)
    reader.add(entry, sources, plan.spans, local)


def _check_compatible(entry: TensorEntry, target: torch.Tensor, global_shape: tuple[int, ...] | None = None) -> None:
    shape = tuple(target.shape) if global_shape is None else tuple(global_shape)
    if shape != entry.shape:
        raise MismatchError(f"{entry.name!r}: saved shape {list(entry.shape)}, target shape {list(shape)}")
    if dtype_name(target.dtype) != entry.dtype:
        raise MismatchError(
            f"{entry.name!r}: saved dtype {dtype_from_name(entry.dtype)}, target dtype {target.dtype}; "
            "cast after loading, or load into a tensor of the saved dtype"
        )


@gc_paused()
def load(
    state_dict: dict[str, Any],
    path: str,
    *,
    strict: bool = True,
    process_group: Any = None,
    threads: int = 4,
    verify: bool = True,
    stats: dict[str, Any] | None = None,
    broadcast_replicated: bool = False,
    storage: LocalStorage | None = None,
) -> dict[str, Any]:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` and return it.

    ``path`` may hold a unickpt checkpoint or, read in place, a PyTorch DCP checkpoint, a
    DeepSpeed ZeRO or universal checkpoint or a Hugging Face safetensors folder
    (docs/FORMATS.md; those formats have no checksums to verify).

    The target layout is whatever the given tensors are: DTensors on any mesh and
    placements, or plain tensors (the whole tensor on this rank). Plain values are
    replaced, Stateful objects get ``load_state_dict`` with their filled state. A torch
    optimizer's state is matched by parameter name and built from the checkpoint when
    the optimizer has none yet (``unickpt.api.optim_state``). With ``strict=False``,
    target keys absent from the checkpoint are left as they are, but an optimizer the
    checkpoint holds nothing for is warned about, and one none of whose saved state fits
    it (other parameter names) is an error.
    Every byte read is checked against its checksum unless ``verify=False``.
    A ``stats`` dict, when given, receives ``bytes_read`` and ``files_read`` of this rank.
    ``broadcast_replicated=True`` reads each plain (replicated) target tensor on one rank
    and broadcasts it over ``process_group`` instead of reading it on every rank; the
    load is then collective (see docs/PERFORMANCE.md for when it pays).
    ``storage`` replaces the files of ``path`` (the manifest still comes from ``path``):
    any object with ``LocalStorage``'s ``reader``/``close``, such as the snapshot tier's
    view of files spread over several machines.
    """
    storage = storage if storage is not None else LocalStorage(path)
    manifest = open_manifest(str(path))
    group = resolve_group(process_group)
    statefuls: list[tuple[Any, dict[str, Any]]] = []

    def on_stateful(name: str, obj: Any) -> dict[str, Any]:
        sd = obj.target_state_dict(name, manifest, strict) if isinstance(obj, NamedOptimizer) else obj.state_dict()
        statefuls.append((obj, sd))
        return sd

    reader = _Reader(storage, threads, verify)
    shared = ReplicatedReads(group) if broadcast_replicated else None
    error: BaseException | None = None
    try:
        for leaf in flatten(state_dict, on_stateful):
            v = leaf.value
            if isinstance(v, PerRank):
                _load_per_rank(storage, manifest, leaf.name, v, group.rank, group.size, strict, threads, verify)
            elif isinstance(v, Sharded):
                entry = manifest.tensors.get(leaf.name)
                if entry is None:
                    if strict:
                        raise MismatchError(_missing(leaf.name, manifest))
                    continue
                item = sharded_item(leaf.name, v)
                _check_compatible(entry, v.local, item.global_shape)
                _fill(reader, entry, item.local, item.pieces)
            elif isinstance(v, torch.Tensor):
                entry = manifest.tensors.get(leaf.name)
                if entry is None:
                    if strict:
                        raise MismatchError(_missing(leaf.name, manifest))
                    continue
                _check_compatible(entry, v)
                if shared is not None and not is_dtensor(v) and not shared.read_here(leaf.name, v):
                    continue
                item = tensor_item(leaf.name, v, None)
                if item is None or not item.pieces:
                    continue
                _fill(reader, entry, item.local, item.pieces)
            elif leaf.name in manifest.values:
                leaf.replace(decode_value(manifest.values[leaf.name]))
            elif (subtree := _value_subtree(manifest, leaf.name)) is not None:
                leaf.replace(subtree)
            elif leaf.name in manifest.tensors:
                raise MismatchError(f"{leaf.name!r} was saved as a tensor but the target holds a {type(v).__name__}")
            elif strict:
                raise MismatchError(_missing(leaf.name, manifest))
        reader.run()
    except BaseException as e:
        error = e
    finally:
        storage.close()
    if shared is not None:
        shared.finish(error is not None)
    if error is not None:
        raise error
    if stats is not None:
        stats["bytes_read"] = reader.bytes_read
        stats["files_read"] = sorted(reader.files_read)
    for obj, sd in statefuls:
        obj.load_state_dict(sd)
    return state_dict


def _value_subtree(manifest: Manifest, name: str) -> dict[str, Any] | None:
    """Saved values below ``name`` rebuilt as nested dicts (string keys), for a target that
    holds a placeholder where the saved state had a dict of values; None if there are none."""
    prefix = name + "."
    found = {k[len(prefix):]: v for k, v in manifest.values.items() if k.startswith(prefix)}
    if not found or any(k.startswith(prefix) for k in manifest.tensors):
        return None
    out: dict[str, Any] = {}
    for key, v in sorted(found.items()):
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = decode_value(v)
    return out


def _missing(name: str, manifest: Manifest) -> str:
    return f"{name!r} is not in the checkpoint (it holds {len(manifest.tensors)} tensors and {len(manifest.values)} values); pass strict=False to skip missing keys"


def _load_per_rank(
    storage: LocalStorage, manifest: Manifest, name: str, target: PerRank, rank: int, world: int,
    strict: bool, threads: int, verify: bool,
) -> None:
    if name not in manifest.rank_values and name not in manifest.rank_tensors:
        if strict:
            raise MismatchError(_missing(name, manifest))
        return
    if world != manifest.world_size:
        raise LayoutError(
            f"{name!r} is per-rank state saved by {manifest.world_size} ranks and this job has {world}; "
            "read all ranks' values with unickpt.load_rank_values() and redistribute them"
        )
    target.value = _rank_value(storage, manifest, name, rank, threads, verify, target.value)


def _rank_value(storage: LocalStorage, manifest: Manifest, name: str, rank: int, threads: int, verify: bool, into: Any = None) -> Any:
    if name in manifest.rank_values:
        return decode_value(manifest.rank_values[name][rank])
    entry = manifest.rank_tensors[name][rank]
    if entry is None:
        return None
    return read_entry(storage, entry, threads, verify, into if isinstance(into, torch.Tensor) else None)


def load_rank_values(path: str, name: str, *, threads: int = 4, verify: bool = True) -> list[Any]:
    """Every rank's saved value of the per-rank entry ``name`` (index = saving rank)."""
    storage = LocalStorage(path)
    manifest = open_manifest(str(path))
    if name not in manifest.rank_values and name not in manifest.rank_tensors:
        raise MismatchError(f"{name!r} is not per-rank state in {path}")
    row = manifest.rank_values.get(name, manifest.rank_tensors.get(name))
    if len(row) != manifest.world_size:  # parsing refuses this; adapter-built manifests are checked here
        raise ManifestError(f"{name!r} holds {len(row)} per-rank entries, the checkpoint's world_size is {manifest.world_size}")
    try:
        return [_rank_value(storage, manifest, name, r, threads, verify) for r in range(manifest.world_size)]
    finally:
        storage.close()


def load_tensor(path: str, name: str, *, threads: int = 4, verify: bool = True, mmap: bool = False) -> torch.Tensor:
    """The whole global tensor ``name`` from a checkpoint, as one CPU tensor.

    With ``mmap=True`` a tensor stored whole in one file (saved by one rank, or consolidated,
    or a Hugging Face shard) is returned mapped from that file instead of read into new
    memory: private copy-on-write pages, so nothing is allocated or copied up front and
    writes to the tensor stay in this process. Checksums are still verified, which reads
    every page once; with ``verify=False`` pages are read only when first used. A tensor
    stored in several pieces is read as usual."""
    storage = LocalStorage(path)
    manifest = open_manifest(str(path))
    entry = manifest.tensors.get(name)
    if entry is None:
        raise MismatchError(_missing(name, manifest))
    try:
        mapped = mapped_entry(storage, entry, verify) if mmap else None
        return mapped if mapped is not None else read_entry(storage, entry, threads, verify)
    finally:
        storage.close()


def mapped_entry(storage: LocalStorage, entry: TensorEntry, verify: bool = True) -> torch.Tensor | None:
    """The tensor of ``entry`` mapped from its file when one fragment holds it whole, in
    order (checksums verified over the mapping unless ``verify=False``); else None."""
    if len(entry.fragments) != 1 or not prod(entry.shape):
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


def read_entry(storage: LocalStorage, entry: TensorEntry, threads: int = 4, verify: bool = True,
               into: torch.Tensor | None = None) -> torch.Tensor:
    """The whole tensor of ``entry`` assembled from its fragments in ``storage`` (checksums
    verified unless ``verify=False``), written into ``into`` when it has the entry's shape."""
    out = into if into is not None and tuple(into.shape) == entry.shape else torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
    if out.numel():
        reader = _Reader(storage, threads, verify)
        _fill(reader, entry, out, [whole_piece(entry.shape)])
        reader.run()
    return out
