"""``load``: fill a target state in place from a checkpoint saved on any layout.

The protocol lives in :mod:`unickpt.engine.load`; this module is its entry point: it
opens the checkpoint (:func:`~unickpt.adapters.checkpoint.open_checkpoint`, foreign
formats included) and hands the engine its storage and manifest. Collective in name
only: each rank plans and reads independently (no communication), so a rank that fails
cannot hang the others, and a single process needs no process group.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..adapters.checkpoint import open_checkpoint
from ..dist import resolve_group
from ..engine.load import LoadOptions, LoadRecord, join_failed_load, load_state, missing, rank_value
from ..engine.tensor_reads import mapped_entry, read_entry
from ..errors import ManifestError, MismatchError
from ..format.manifest import Manifest
from ..storage.base import Storage
from ..storage.open import open_storage

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


def load(
    state_dict: dict[str, Any],
    path: str,
    *,
    strict: bool = True,
    process_group: Any = None,
    threads: int | None = None,
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
        strict: Every target key must be in the checkpoint (the checkpoint's entries the
            target does not ask for are never read, and never an error).
        process_group: The group loading together (default: the default group, if any).
        threads: Parallel reads (None: this rank's share of the CPUs, 4 to 16).
        verify: Check every byte read against its checksum.
        stats: Receives ``bytes_read``, ``files_read`` (and ``per_rank_kept``): this
            rank's :class:`~unickpt.engine.load.LoadRecord` as a dict.
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
    record = load_into(state_dict, path, strict=strict, process_group=process_group, threads=threads, verify=verify,
                       broadcast_replicated=broadcast_replicated, storage_options=storage_options, per_rank=per_rank,
                       cast=cast)
    if stats is not None:  # the public edge's dict, filled once from the typed record
        stats.update(record.as_stats())
    return state_dict


def load_into(
    state_dict: dict[str, Any],
    path: str,
    *,
    process_group: Any = None,
    storage: Storage | None = None,
    storage_options: dict[str, Any] | None = None,
    manifest: Manifest | None = None,
    **options: Any,
) -> LoadRecord:
    """:func:`load` (which see) for the library's own callers, returning what this rank
    read as a :class:`~unickpt.engine.load.LoadRecord`. ``storage`` replaces the files of
    ``path`` (the manifest still comes from ``path``): any
    :class:`~unickpt.storage.base.Storage` (only ``reader`` and ``close`` are used), such
    as the snapshot tier's view of files spread over several machines; ``manifest``, when
    given, is the checkpoint's manifest already read (and validated) by the caller: it is
    not parsed again. ``options``: the fields of :class:`~unickpt.engine.load.LoadOptions`
    (``strict``, ``threads``, ``verify``, ``broadcast_replicated``, ``per_rank``, ``cast``)."""
    opts = LoadOptions(**options)
    group = resolve_group(process_group)
    if manifest is None:
        try:
            ckpt = open_checkpoint(path, storage_options)
        except Exception as e:  # this rank's copy only (a node-local tier): the others may be in a collective load
            join_failed_load(state_dict, storage, group, opts, e)
        manifest = ckpt.manifest
        if storage is not None:
            ckpt.close()
        else:
            storage = ckpt.storage
    elif storage is None:
        storage = open_storage(path, storage_options)
    return load_state(state_dict, path, storage, manifest, group, opts)


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
        return [rank_value(storage, manifest, name, r, threads, verify) for r in range(manifest.world_size)]
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
            raise MismatchError(missing(name, manifest))
        mapped = mapped_entry(storage, entry, verify) if mmap else None
        return mapped if mapped is not None else read_entry(storage, entry, threads, verify)
    finally:
        storage.close()
