"""``load``: fill a target state in place from a checkpoint saved on any layout.

Collective in name only: each rank plans and reads independently (no communication), so
a rank that fails cannot hang the others, and a single process needs no process group.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from ..dist import resolve_group
from ..errors import CorruptionError, LayoutError, ManifestError, MismatchError, UnickptError
from ..format.dtypes import CASTS, cast_allowed, dtype_from_name, dtype_name
from ..adapters.checkpoint import open_checkpoint
from ..format.manifest import Manifest, TensorEntry
from ..format.values import decode_value
from ..plan.piece import Piece
from ..storage.base import Storage
from ..storage.open import open_storage
from ..engine.gc_pause import gc_paused
from ..engine.items import is_dtensor, mesh_replicas, sharded_item, tensor_item
from ..engine.replicated import ReplicatedReads, ShardedReplicas, share_by_default
from ..engine.tensor_reads import TensorReads, mapped_entry, read_entry
from ..engine.optim_state import NamedOptimizer
from ..engine.state import PerRank, Sharded, flatten

__all__ = ["load", "load_rank_values", "load_tensor", "read_manifest"]


def read_manifest(path: str, storage_options: dict[str, Any] | None = None, *, bases: bool = True) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``path``: unickpt's own, or the
    one built from a foreign format's metadata (PyTorch DCP, DeepSpeed, Hugging Face).
    An incremental checkpoint's bases must be there unless ``bases=False``.

    Args:
        path: The checkpoint's directory or URL.
        storage_options: Options of a URL's file system (fsspec).
        bases: Require an incremental checkpoint's bases to be there.

    Returns:
        The checkpoint's :class:`~unickpt.format.manifest.Manifest`.

    Raises:
        NotACheckpointError: Nothing at ``path`` is a checkpoint of a known format.
        ManifestError: The manifest is malformed or contradicts itself.
        FormatVersionError: Written by a newer format version than this unickpt reads.
    """
    with open_checkpoint(path, storage_options, bases=bases) as ckpt:
        return ckpt.manifest


def _fill(reader: TensorReads, entry: TensorEntry, local: torch.Tensor, pieces: list[Piece]) -> None:
    reader.add(entry, local, pieces)


def _check_compatible(entry: TensorEntry, target: torch.Tensor, global_shape: tuple[int, ...] | None = None,
                      cast: str = "widen") -> None:
    shape = tuple(target.shape) if global_shape is None else tuple(global_shape)
    if shape != entry.shape:
        raise MismatchError(f"{entry.name!r}: saved shape {list(entry.shape)}, target shape {list(shape)}")
    _check_dtype(entry, target, cast)


def _check_dtype(entry: TensorEntry, target: torch.Tensor, cast: str) -> None:
    """Refuse a target whose dtype the ``cast`` policy does not let ``entry`` be loaded into."""
    if not cast_allowed(entry.dtype, dtype_name(target.dtype), cast):
        saved = dtype_from_name(entry.dtype)
        how = "a different dtype" if cast == "none" else "a cast that can change values (rounding, overflow, another kind)"
        raise MismatchError(
            f"{entry.name!r}: saved dtype {saved}, target dtype {target.dtype}: {how}; pass cast='any' to load it "
            f"with torch's cast, or load into a tensor of the saved dtype {saved}"
        )


def load(
    state_dict: dict[str, Any],
    path: str,
    *,
    strict: bool = True,
    process_group: Any = None,
    threads: int = 4,
    verify: bool = True,
    stats: dict[str, Any] | None = None,
    broadcast_replicated: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    per_rank: Literal["error", "keep"] = "error",
    cast: Literal["widen", "any", "none"] = "widen",
) -> dict[str, Any]:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` and return it.

    ``path`` may hold a unickpt checkpoint or, read in place, a PyTorch DCP checkpoint, a
    DeepSpeed ZeRO or universal checkpoint or a Hugging Face safetensors folder
    (docs/FORMATS.md; those formats have no checksums to verify).

    The target layout is whatever the given tensors are: DTensors on any mesh and
    placements, or plain tensors (the whole tensor on this rank). Plain values are
    replaced, Stateful objects get ``load_state_dict`` with their filled state. A torch
    optimizer's state is matched by parameter name and built from the checkpoint when
    the optimizer has none yet (``unickpt.engine.optim_state``). With ``strict=False``,
    target keys absent from the checkpoint are left as they are, but an optimizer the
    checkpoint holds nothing for is warned about, and one none of whose saved state fits
    it (other parameter names) is an error.
    Every byte read is checked against its checksum unless ``verify=False``.
    A ``stats`` dict, when given, receives ``bytes_read`` and ``files_read`` of this rank.
    ``Sharded`` targets held by several replicas (rule-described weights replicated over
    data parallelism), and DTensor targets ``Replicate`` over a mesh dimension, are split
    among those replicas, each reading its share and
    broadcasting it to the others over a process group of theirs (the load is then
    collective), by default (``broadcast_replicated=None``) where the rule of
    docs/SCALE.md says it is faster (``engine.replicated.sharing_pays``: a broadcast
    faster than the storage, such as NCCL, or a remote storage such as the snapshot
    tier's); ``False`` reads them whole on every rank; ``True`` always shares them, and
    also reads each plain (replicated) target tensor on one rank and broadcasts it over
    ``process_group`` instead of reading it on every rank.
    ``path`` may be a URL (``s3://...``, any fsspec file system; ``storage_options`` for
    it): each rank then fetches only the byte ranges it needs, with ranged GETs.

    A target tensor of another dtype than the saved one is filled with the saved values
    cast to it, span by span as they are read (no whole-tensor copy), as ``cast`` allows:
    ``"widen"`` (the default) only exact widenings, where every saved value is kept as it
    is (bf16 or fp16 -> fp32 or fp64, fp32 -> fp64, fp8 -> any wider float, an integer ->
    a wider integer that holds its range: ``unickpt.format.dtypes.WIDENINGS``); ``"any"``
    also narrowing or kind-changing casts, done as torch's ``Tensor.copy_`` does them
    (floats rounded to nearest, floats to integers truncated, integers wrapped); ``"none"``
    no cast at all. A cast not allowed
    is a MismatchError naming both dtypes. A bool is never widened: bool -> integer is
    exact in value but not in meaning, so it needs ``cast="any"``.

    ``per_rank``: what a :class:`~unickpt.PerRank` target gets when the checkpoint was
    saved by another number of ranks: ``"error"`` (a ``LayoutError``), or ``"keep"``: its
    value is left as it is (its name is added to ``stats["per_rank_kept"]``).

    Args:
        state_dict: The target, filled in place: tensors, DTensors, Stateful objects
            (modules, optimizers, schedulers, :class:`~unickpt.RNGState`), plain values,
            nested dicts and lists.
        path: The checkpoint's directory or URL.
        strict: Every target key must be in the checkpoint.
        process_group: The group loading together (default: the default group, if any).
        threads: Parallel reads.
        verify: Check every byte read against its checksum.
        stats: Receives ``bytes_read``, ``files_read`` (and ``per_rank_kept``).
        broadcast_replicated: Read replicated tensors once and broadcast them (collective).
        storage_options: Options of a URL's file system (fsspec).
        per_rank: ``"error"`` or ``"keep"``, for per-rank state saved by another number of
            ranks.
        cast: ``"widen"``, ``"any"`` or ``"none"``: the dtype casts allowed.

    Returns:
        ``state_dict``, filled.

    Raises:
        NotACheckpointError: Nothing at ``path`` is a checkpoint.
        CorruptionError: A byte read fails its checksum, or a file is missing or short.
        MismatchError: A target's shape or dtype does not fit the saved tensor, or a
            strict key is missing.
        LayoutError: Per-rank state saved by another number of ranks (``per_rank="error"``).
    """
    return load_into(state_dict, path, strict=strict, process_group=process_group, threads=threads, verify=verify,
                     stats=stats, broadcast_replicated=broadcast_replicated, storage_options=storage_options,
                     per_rank=per_rank, cast=cast)


@gc_paused()
def load_into(
    state_dict: dict[str, Any],
    path: str,
    *,
    strict: bool = True,
    process_group: Any = None,
    threads: int = 4,
    verify: bool = True,
    stats: dict[str, Any] | None = None,
    broadcast_replicated: bool | None = None,
    storage: Storage | None = None,
    storage_options: dict[str, Any] | None = None,
    manifest: Manifest | None = None,
    per_rank: str = "error",
    cast: str = "widen",
) -> dict[str, Any]:
    """:func:`load` (which see), with the keywords of the library's own callers:
    ``storage`` replaces the files of ``path`` (the manifest still comes from ``path``):
    any :class:`~unickpt.storage.base.Storage` (only ``reader`` and ``close`` are used),
    such as the snapshot tier's view of files spread over several machines; ``manifest``,
    when given, is the checkpoint's manifest already read (and validated) by the caller:
    it is not parsed again."""
    if per_rank not in ("error", "keep"):
        raise UnickptError(f"per_rank must be 'error' or 'keep', not {per_rank!r}")
    if cast not in CASTS:
        raise UnickptError(f"cast={cast!r}: expected one of {', '.join(map(repr, CASTS))}")
    if manifest is None:
        ckpt = open_checkpoint(path, storage_options)
        manifest = ckpt.manifest
        if storage is not None:
            ckpt.close()
        else:
            storage = ckpt.storage
    elif storage is None:
        storage = open_storage(path, storage_options)
    group = resolve_group(process_group)
    statefuls: list[tuple[Any, dict[str, Any]]] = []

    def on_stateful(name: str, obj: Any) -> dict[str, Any]:
        sd = obj.target_state_dict(name, manifest, strict) if isinstance(obj, NamedOptimizer) else obj.state_dict()
        statefuls.append((obj, sd))
        return sd

    reader = TensorReads(storage, threads, verify)
    share = share_by_default(state_dict, group, storage) if broadcast_replicated is None else broadcast_replicated
    shared = ReplicatedReads(group) if broadcast_replicated else None
    replicas = ShardedReplicas(group) if share else None
    error: BaseException | None = None
    try:
        for leaf in flatten(state_dict, on_stateful):
            v = leaf.value
            if isinstance(v, PerRank):
                if per_rank == "keep" and group.size != manifest.world_size:
                    if stats is not None:
                        stats.setdefault("per_rank_kept", []).append(leaf.name)
                    continue
                _load_per_rank(storage, manifest, leaf.name, v, group.rank, group.size, strict, threads, verify, cast)
            elif isinstance(v, Sharded):
                entry = manifest.tensors.get(leaf.name)
                if entry is None:
                    if strict:
                        raise MismatchError(_missing(leaf.name, manifest))
                    continue
                item = sharded_item(leaf.name, v)
                _check_compatible(entry, v.local, item.global_shape, cast)
                if replicas is None or not replicas.defer(entry, item):
                    _fill(reader, entry, item.local, item.pieces)
            elif isinstance(v, torch.Tensor):
                entry = manifest.tensors.get(leaf.name)
                if entry is None:
                    if strict:
                        raise MismatchError(_missing(leaf.name, manifest))
                    continue
                _check_compatible(entry, v, None, cast)
                if shared is not None and not is_dtensor(v) and not shared.read_here(leaf.name, v):
                    continue
                item = tensor_item(leaf.name, v, None)
                if item is None or not item.pieces:
                    continue
                if replicas is not None and mesh_replicas(v) > 1 and \
                        replicas.defer(entry, dataclasses.replace(item, replicas=mesh_replicas(v))):
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
    except BaseException as e:
        error = e
    try:
        if replicas is not None:  # collective: every rank gets here, failed or not
            for entry, part in replicas.plan(error is not None):
                _fill(reader, entry, part.local, part.pieces)
        if error is None:
            reader.run()
    except BaseException as e:
        error = error or e
    finally:
        storage.close()
    if shared is not None:
        shared.finish(error is not None)
    if replicas is not None:
        replicas.finish(error is not None)
    if error is not None:
        if isinstance(error, CorruptionError) and str(path) not in str(error):
            raise CorruptionError(f"{path}: {error}") from None  # which checkpoint, not only which file
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
    return (f"{name!r} is not in the checkpoint (it holds {len(manifest.tensors)} tensors and {len(manifest.values)} values); "
            "pass strict=False to skip missing keys")


def _load_per_rank(
    storage: Storage, manifest: Manifest, name: str, target: PerRank, rank: int, world: int,
    strict: bool, threads: int, verify: bool, cast: str,
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
    into = target.value
    entry = manifest.rank_tensors[name][rank] if name in manifest.rank_tensors else None
    if entry is not None and isinstance(into, torch.Tensor) and tuple(into.shape) == entry.shape:
        _check_dtype(entry, into, cast)  # filled in place, as a tensor target is; else replaced by the saved tensor
    target.value = _rank_value(storage, manifest, name, rank, threads, verify, into)


def _rank_value(storage: Storage, manifest: Manifest, name: str, rank: int, threads: int, verify: bool, into: Any = None) -> Any:
    if name in manifest.rank_values:
        return decode_value(manifest.rank_values[name][rank])
    entry = manifest.rank_tensors[name][rank]
    if entry is None:
        return None
    return read_entry(storage, entry, threads, verify, into if isinstance(into, torch.Tensor) else None)


def load_rank_values(path: str, name: str, *, threads: int = 4, verify: bool = True,
                     storage_options: dict[str, Any] | None = None) -> list[Any]:
    """Every rank's saved value of the per-rank entry ``name``.

    Args:
        path: The checkpoint's directory or URL.
        name: The per-rank entry (a :class:`~unickpt.PerRank` key, dotted).
        threads: Parallel reads.
        verify: Check every byte read against its checksum.
        storage_options: Options of a URL's file system (fsspec).

    Returns:
        One value per saving rank, in rank order.

    Raises:
        MismatchError: ``name`` is not per-rank state in the checkpoint.
        CorruptionError: A byte read fails its checksum.
    """
    ckpt = open_checkpoint(path, storage_options)
    storage, manifest = ckpt.storage, ckpt.manifest
    if name not in manifest.rank_values and name not in manifest.rank_tensors:
        raise MismatchError(f"{name!r} is not per-rank state in {path}")
    row = manifest.rank_values.get(name, manifest.rank_tensors.get(name))
    if len(row) != manifest.world_size:  # parsing refuses this; adapter-built manifests are checked here
        raise ManifestError(f"{name!r} holds {len(row)} per-rank entries, the checkpoint's world_size is {manifest.world_size}")
    try:
        return [_rank_value(storage, manifest, name, r, threads, verify) for r in range(manifest.world_size)]
    finally:
        storage.close()


def load_tensor(path: str, name: str, *, threads: int = 4, verify: bool = True, mmap: bool = False,
                storage_options: dict[str, Any] | None = None) -> torch.Tensor:
    """The whole global tensor ``name`` from a checkpoint, as one CPU tensor.

    With ``mmap=True`` a tensor stored whole in one file (saved by one rank, or consolidated,
    or a Hugging Face shard) is returned mapped from that file instead of read into new
    memory: private copy-on-write pages, so nothing is allocated or copied up front and
    writes to the tensor stay in this process. Checksums are still verified, which reads
    every page once; with ``verify=False`` pages are read only when first used. A tensor
    stored in several pieces is read as usual (and every tensor of a checkpoint at a URL).

    Args:
        path: The checkpoint's directory or URL.
        name: The tensor's dotted name (``model.layers.0.weight``).
        threads: Parallel reads.
        verify: Check every byte read against its checksum.
        mmap: Map a tensor stored whole in one file instead of reading it.
        storage_options: Options of a URL's file system (fsspec).

    Returns:
        The global tensor, on the CPU.

    Raises:
        MismatchError: No tensor ``name`` (the message names the closest ones).
        CorruptionError: A byte read fails its checksum.
    """
    ckpt = open_checkpoint(path, storage_options)
    storage, manifest = ckpt.storage, ckpt.manifest
    try:
        entry = manifest.tensors.get(name)
        if entry is None:
            raise MismatchError(_missing(name, manifest))
        mapped = mapped_entry(storage, entry, verify) if mmap else None
        return mapped if mapped is not None else read_entry(storage, entry, threads, verify)
    finally:
        storage.close()
