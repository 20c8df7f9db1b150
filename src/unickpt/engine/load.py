"""The load protocol, stated once, beside the save's (:mod:`unickpt.engine.commit`): how a
rank fills a target state from an opened checkpoint (its storage and manifest).

Each target leaf is matched by name against the manifest:

* a tensor or DTensor, or a rule-described :class:`~unickpt.Sharded` shard: its shape and
  dtype checked against the saved entry (:func:`check_compatible`, the ``cast`` policy),
  the boxes it needs planned into the one verified read (:class:`TensorReads`); held by
  several replicas, it may be shared among them instead (``engine.replicated``);
* a :class:`~unickpt.PerRank` entry: this rank's saved value (:func:`rank_value`), or
  kept as it is when the checkpoint was saved by another number of ranks and
  ``per_rank="keep"``;
* a plain value: replaced by the saved value (or the saved dict of values below its name);
* a Stateful object: its ``state_dict()`` (a torch optimizer's matched by parameter name)
  filled as above, then handed back through ``load_state_dict`` once every byte is read.

Collective in name only: each rank plans and reads alone, unless replicated state is
shared (then every rank reaches the sharing's collective, failed or not). The outcome is
a :class:`LoadRecord`, what this rank read.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from ..dist import Group
from ..errors import CorruptionError, LayoutError, MismatchError, UnickptError
from ..format.dtypes import CASTS, cast_allowed, dtype_from_name, dtype_name
from ..format.manifest import Manifest, TensorEntry
from ..format.values import decode_value
from ..storage.base import Storage
from ..units import counted
from .gc_pause import gc_paused
from .items import is_dtensor, mesh_replicas, sharded_item, tensor_item
from .optim_state import NamedOptimizer
from .replicated import ReplicatedReads, ShardedReplicas, share_by_default
from .state import Leaf, PerRank, Sharded, flatten
from .tensor_reads import TensorReads, read_entry

__all__ = ["LoadOptions", "LoadRecord", "check_compatible", "default_threads", "load_state", "missing", "rank_value"]

MIN_THREADS, MAX_THREADS = 4, 16  # the parallel reads a load defaults to: this rank's CPUs, within these


def default_threads() -> int:
    """The parallel reads of a load given ``threads=None``: this rank's share of the CPUs
    it may run on (divided among the node's ranks, $LOCAL_WORLD_SIZE), at least
    MIN_THREADS (reads wait on storage) and at most MAX_THREADS. A warm load into an H200
    went 16.0 GB/s with 4 threads, 29.2 with 16 (its host: 16 cores; docs/PERFORMANCE.md)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(MIN_THREADS, min(MAX_THREADS, cpus // ranks))


@dataclass(frozen=True)
class LoadOptions:
    """How a load reads, checked once here (the keywords of :func:`unickpt.load`, which see).

    Raises:
        UnickptError: ``per_rank`` or ``cast`` is not one of its modes.
    """

    strict: bool = True
    threads: int | None = None  # None: default_threads()
    verify: bool = True
    broadcast_replicated: bool | None = None
    per_rank: str = "error"
    cast: str = "widen"

    def __post_init__(self) -> None:
        if self.threads is None:
            object.__setattr__(self, "threads", default_threads())
        elif isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise UnickptError(f"threads must be a whole number >= 1 (or None: this rank's share of the CPUs), "
                               f"not {self.threads!r}")
        if self.per_rank not in ("error", "keep"):
            raise UnickptError(f"per_rank must be 'error' or 'keep', not {self.per_rank!r}")
        if self.cast not in CASTS:
            raise UnickptError(f"cast={self.cast!r}: expected one of {', '.join(map(repr, CASTS))}")


@dataclass
class LoadRecord:
    """What one load did on this rank (the load's counterpart of the manager's
    ``SaveRecord``).

    Attributes:
        bytes_read: Bytes this rank read from the checkpoint's files.
        files_read: The data files it read from, sorted.
        per_rank_kept: :class:`~unickpt.PerRank` entries left as they were (saved by
            another number of ranks, ``per_rank="keep"``), in the order met.
    """

    bytes_read: int = 0
    files_read: list[str] = field(default_factory=list)
    per_rank_kept: list[str] = field(default_factory=list)

    def as_stats(self) -> dict[str, Any]:
        """The record as the ``stats`` dict of :func:`unickpt.load` fills it
        (``per_rank_kept`` only when an entry was kept)."""
        out: dict[str, Any] = {"bytes_read": self.bytes_read, "files_read": list(self.files_read)}
        if self.per_rank_kept:
            out["per_rank_kept"] = list(self.per_rank_kept)
        return out


def check_compatible(entry: TensorEntry, target: torch.Tensor, global_shape: tuple[int, ...] | None = None,
                     cast: str = "widen") -> None:
    """Refuse a target whose (global) shape is not the saved one, or whose dtype ``cast``
    does not let ``entry`` be loaded into."""
    shape = tuple(target.shape) if global_shape is None else tuple(global_shape)
    if shape != entry.shape:
        raise MismatchError(f"{entry.name!r}: saved shape {list(entry.shape)}, target shape {list(shape)}")
    check_dtype(entry, target, cast)


def check_dtype(entry: TensorEntry, target: torch.Tensor, cast: str) -> None:
    """Refuse a target whose dtype the ``cast`` policy does not let ``entry`` be loaded into."""
    if not cast_allowed(entry.dtype, dtype_name(target.dtype), cast):
        saved = dtype_from_name(entry.dtype)
        how = "a different dtype" if cast == "none" else "a cast that can change values (rounding, overflow, another kind)"
        raise MismatchError(
            f"{entry.name!r}: saved dtype {saved}, target dtype {target.dtype}: {how}; pass cast='any' to load it "
            f"with torch's cast, or load into a tensor of the saved dtype {saved}"
        )


def missing(name: str, manifest: Manifest) -> str:
    """The message for a target key ``name`` the checkpoint does not hold."""
    return (f"{name!r} is not in the checkpoint (it holds {counted(len(manifest.tensors), 'tensor')} and "
            f"{counted(len(manifest.values), 'value')}); pass strict=False to skip missing keys")


def rank_value(storage: Storage, manifest: Manifest, name: str, rank: int, threads: int, verify: bool, into: Any = None) -> Any:
    """Rank ``rank``'s saved value of the per-rank entry ``name`` (a tensor read into
    ``into`` when it fits)."""
    if name in manifest.rank_values:
        return decode_value(manifest.rank_values[name][rank])
    entry = manifest.rank_tensors[name][rank]
    if entry is None:
        return None
    return read_entry(storage, entry, threads, verify, into if isinstance(into, torch.Tensor) else None)


@gc_paused()
def load_state(state_dict: dict[str, Any], path: str, storage: Storage, manifest: Manifest, group: Group,
               options: LoadOptions) -> LoadRecord:
    """Fill ``state_dict`` in place from the checkpoint ``path`` opened as ``storage``
    (closed here, whatever happens) and its ``manifest``, as a rank of ``group``.

    Returns:
        What this rank read.

    Raises:
        MismatchError: A target does not fit its saved entry, or a strict key is missing.
        LayoutError: Per-rank state saved by another number of ranks (``per_rank="error"``).
        CorruptionError: A byte read fails its checksum (the message names ``path``).
    """
    fill = _Fill(state_dict, storage, manifest, group, options)
    error: BaseException | None = None
    try:
        for leaf in flatten(state_dict, fill.on_stateful):
            fill.leaf(leaf)
    except BaseException as e:
        error = e
    error = fill.read(error)
    try:
        storage.close()
    except Exception as e:  # a remote file system's close, a peer keeper's connection: after the collectives
        error = error or e
    fill.finish(error is not None)
    if error is not None:
        if isinstance(error, CorruptionError) and str(path) not in str(error):
            raise CorruptionError(f"{path}: {error}") from None  # which checkpoint, not only which file
        raise error
    for obj, sd in fill.statefuls:
        obj.load_state_dict(sd)
    fill.record.bytes_read, fill.record.files_read = fill.reader.bytes_read, sorted(fill.reader.files_read)
    return fill.record


def join_failed_load(state_dict: dict[str, Any], storage: Storage | None, group: Group, options: LoadOptions,
                     error: Exception) -> NoReturn:
    """A rank that cannot open the checkpoint (its copy of the manifest missing or
    corrupt: a node-local tier) joins, as failed, the collectives the other ranks' load
    makes (the replicated state shared), so that none of them waits for it; then raises
    ``error``. The others raise too (:meth:`_Fill.finish`)."""
    fill = _Fill(state_dict, storage, None, group, options)
    fill.read(error)
    fill.finish(True)
    raise error


class _Fill:
    """One load's plan, built leaf by leaf: the reads of this rank, the replicated state
    shared with other ranks, and the Stateful objects to hand their state back to."""

    def __init__(self, state_dict: dict[str, Any], storage: Storage, manifest: Manifest, group: Group,
                 options: LoadOptions) -> None:
        self.storage, self.manifest, self.group, self.options = storage, manifest, group, options
        self.reader = TensorReads(storage, options.threads, options.verify)
        share = options.broadcast_replicated
        if share is None:
            share = share_by_default(state_dict, group, storage)
        self.shared = ReplicatedReads(group) if options.broadcast_replicated else None
        self.replicas = ShardedReplicas(group) if share else None
        self.statefuls: list[tuple[Any, dict[str, Any]]] = []
        self.record = LoadRecord()

    def on_stateful(self, name: str, obj: Any) -> dict[str, Any]:
        """The state of a Stateful ``obj`` to fill (a torch optimizer's by parameter name)."""
        sd = obj.target_state_dict(name, self.manifest, self.options.strict) if isinstance(obj, NamedOptimizer) else obj.state_dict()
        self.statefuls.append((obj, sd))
        return sd

    def leaf(self, leaf: Leaf) -> None:
        """Plan (or do, for values) the load of one target leaf."""
        v, manifest = leaf.value, self.manifest
        if isinstance(v, PerRank):
            self._per_rank(leaf.name, v)
        elif isinstance(v, (Sharded, torch.Tensor)):
            entry = manifest.tensors.get(leaf.name)
            if entry is None:
                if self.options.strict:
                    raise MismatchError(missing(leaf.name, manifest))
            elif isinstance(v, Sharded):
                self._sharded(leaf.name, entry, v)
            else:
                self._tensor(leaf.name, entry, v)
        elif leaf.name in manifest.values:
            leaf.replace(decode_value(manifest.values[leaf.name]))
        elif (subtree := _value_subtree(manifest, leaf.name)) is not None:
            leaf.replace(subtree)
        elif leaf.name in manifest.tensors:
            raise MismatchError(f"{leaf.name!r} was saved as a tensor but the target holds a {type(v).__name__}")
        elif self.options.strict:
            raise MismatchError(missing(leaf.name, manifest))

    def _sharded(self, name: str, entry: TensorEntry, v: Sharded) -> None:
        item = sharded_item(name, v)
        check_compatible(entry, v.local, item.global_shape, self.options.cast)
        if self.replicas is None or not self.replicas.defer(entry, item):
            self.reader.add(entry, item.local, item.pieces)

    def _tensor(self, name: str, entry: TensorEntry, v: torch.Tensor) -> None:
        check_compatible(entry, v, None, self.options.cast)
        if self.shared is not None and not is_dtensor(v) and not self.shared.read_here(name, v):
            return
        item = tensor_item(name, v, None)
        if item is None or not item.pieces:
            return
        if self.replicas is not None and mesh_replicas(v) > 1 and \
                self.replicas.defer(entry, dataclasses.replace(item, replicas=mesh_replicas(v))):
            return
        self.reader.add(entry, item.local, item.pieces)

    def _per_rank(self, name: str, target: PerRank) -> None:
        manifest, world, opts = self.manifest, self.group.size, self.options
        if opts.per_rank == "keep" and world != manifest.world_size:
            self.record.per_rank_kept.append(name)
            return
        if name not in manifest.rank_values and name not in manifest.rank_tensors:
            if opts.strict:
                raise MismatchError(missing(name, manifest))
            return
        if world != manifest.world_size:
            raise LayoutError(
                f"{name!r} is per-rank state saved by {manifest.world_size} ranks and this job has {world}; "
                "read all ranks' values with unickpt.load_rank_values() and redistribute them"
            )
        into = target.value
        entry = manifest.rank_tensors[name][self.group.rank] if name in manifest.rank_tensors else None
        if entry is not None and isinstance(into, torch.Tensor) and tuple(into.shape) == entry.shape:
            check_dtype(entry, into, opts.cast)  # filled in place, as a tensor target is; else replaced by the saved tensor
        target.value = rank_value(self.storage, manifest, name, self.group.rank, opts.threads, opts.verify, into)

    def read(self, error: BaseException | None) -> BaseException | None:
        """Share the replicated state (collective: every rank gets here, failed or not),
        then, unless planning failed (``error``), read every planned byte; the first error."""
        try:
            if self.replicas is not None:
                for entry, part in self.replicas.plan(error is not None):
                    self.reader.add(entry, part.local, part.pieces)
            if error is None:
                self.reader.run()
        except BaseException as e:
            error = error or e
        return error

    def finish(self, failed: bool) -> None:
        """Broadcast the replicated state each rank read (collective). Every rank makes
        both parts' collectives, failed or not: a part that finds another rank failed
        raises only once the other part is done."""
        error: Exception | None = None
        for part in (self.shared, self.replicas):
            if part is None:
                continue
            try:
                part.finish(failed or error is not None)
            except Exception as e:
                error = error or e
        if error is not None:
            raise error


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
