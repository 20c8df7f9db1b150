"""``save``: every rank writes the fragments it owns, rank 0 commits the manifest last."""

from __future__ import annotations

import hashlib
import json
import os
import re
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dist import Group, all_gather_fixed, broadcast_bytes, gather_bytes, group_cache, resolve_group
from .. import errors
from ..errors import SaveError, UnickptError
from ..format.checksum import crc32c
from ..format.dtypes import dtype_name
from ..format.index import INDEX_NAME
from ..format.manifest import (
    DEFAULT_BLOCK_BYTES,
    MANIFEST_NAME,
    Fragment,
    fragment_to_json,
)
from ..format.values import encode_value
from ..plan.box import Box
from ..plan.save_plan import replica_shares
from ..storage.base import Storage
from ..storage.open import is_remote, local_path, open_storage
from ..storage.transaction import DirectoryWrite
from ..engine.writer import DataFileWriter, as_bytes
from ..engine.items import Holders, TensorItem, cut_rows, is_dtensor, row_slice, sharded_item, tensor_item
from ..engine.optim_state import NamedOptimizer
from ..engine.state import PerRank, Sharded, flatten
from ..engine.gc_pause import gc_paused
from ..format.rank_message import FragmentRecord, decode as decode_message, encode as encode_message
from .assemble import manifest_document
from .incremental import BaseIndex, holders_json, open_base, split_unchanged


def data_file_name(rank: int) -> str:
    """Name of the data file a group rank writes."""
    return f"rank_{rank:05d}.safetensors"


@dataclass
class LocalState:
    """What one rank contributes to a checkpoint, split by kind."""

    to_write: list[TensorItem] = field(default_factory=list)
    declared: dict[str, tuple[tuple[int, ...], str, str]] = field(default_factory=dict)
    replicated: list[str] = field(default_factory=list)  # replicated tensors held as the first or last replica
    digests: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    rank_values: dict[str, Any] = field(default_factory=dict)
    rank_tensors: list[TensorItem] = field(default_factory=list)
    leader: bool = True
    digest_sources: dict[str, torch.Tensor] = field(default_factory=dict)
    # an optimizer's param_groups: each rank's, joined by rank 0 (pipeline stages hold parts of a group)
    group_values: dict[str, Any] = field(default_factory=dict)


def _stage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy (or the tensor itself when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


_as_bytes = as_bytes


def holders_of(names: list[str], group: Group) -> Holders:
    """Find the ranks holding the same state names as this one (one 8-byte hash per rank)."""
    digest = hashlib.blake2b("\n".join(sorted(names)).encode(), digest_size=8).digest()
    hashes = all_gather_fixed(group, digest)
    return Holders(group, [r for r, h in enumerate(hashes) if h == digest])


def tensor_digest(dtype: str, shape: tuple[int, ...], crc: int) -> str:
    """The agreement digest of a replicated tensor (rank 0 compares them between ranks)."""
    return f"tensor {dtype} {list(shape)} crc32c={crc:08x}"


# keyed on DTensor specs, which hold their device mesh and so its process groups: emptied
# at exit with unickpt's own groups (release_groups), or the mesh's gloo groups would live
# on into the interpreter's finalization (where they can abort the process)
_ITEMS: dict[tuple, tuple | None] = group_cache()


def _tensor_item(name: str, t: torch.Tensor, holders: Holders) -> TensorItem | None:
    """``tensor_item``, memoized for DTensors on their spec (mesh, placements, shape,
    stride, dtype) and the holders: pieces and replica roles depend on nothing else, and
    computing them dominates the time of a save's call for models with many tensors."""
    if not is_dtensor(t):
        return tensor_item(name, t, holders)
    try:
        key = (name, t._spec, tuple(t.placements), tuple(holders.members), holders.group.rank, holders.group.size, id(holders.group.pg))
        known = key in _ITEMS
    except (AttributeError, TypeError):  # a torch without hashable specs: no memo
        return tensor_item(name, t, holders)
    if not known:
        item = tensor_item(name, t, holders)
        if len(_ITEMS) > 100_000:
            _ITEMS.clear()
        _ITEMS[key] = None if item is None else (item.global_shape, item.pieces, item.replica_index, item.replicas, item.layout)
        return item
    fields = _ITEMS[key]
    if fields is None:
        return None
    local = getattr(t, "_local_tensor", None)
    return TensorItem(name, local if local is not None else t.to_local(), *fields)


def collect(state_dict: dict[str, Any], group: Group, defer: bool = False) -> LocalState:
    """Classify this rank's state (collective): fragments it owns, values to check and
    commit, per-rank state. Copies what it will write to host memory, unless ``defer``:
    then tensors to write still refer to the live state and replicated tensors whose
    digest is still to be computed are listed in ``digest_sources`` (async save stages
    and digests them itself)."""
    _stage_fn = (lambda t: t.detach()) if defer else _stage
    out = LocalState()
    groups: set[str] = set()

    def on_stateful(name: str, obj: Any) -> dict[str, Any]:
        if isinstance(obj, NamedOptimizer) and obj.by_name:
            groups.add(f"{name}.param_groups")
        return obj.state_dict()

    leaves = flatten(state_dict, on_stateful)
    holders = holders_of([leaf.name for leaf in leaves if not isinstance(leaf.value, PerRank)], group)
    out.leader = holders.members[0] == group.rank
    lines: dict[tuple, list[TensorItem]] = {}
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, PerRank):
            if isinstance(v.value, torch.Tensor):
                out.rank_tensors.append(tensor_item(leaf.name, _stage_fn(v.value), None))
            else:
                out.rank_values[leaf.name] = encode_value(v.value, leaf.name)
            continue
        if isinstance(v, (torch.Tensor, Sharded)):
            kind = "sharded" if isinstance(v, Sharded) else "dtensor" if is_dtensor(v) else "plain"
            if isinstance(v, Sharded):
                item = sharded_item(leaf.name, v)
                v = v.local
            else:
                item = _tensor_item(leaf.name, v, holders)
            if item is None:
                continue
            dtype = dtype_name(v.dtype)
            if item.layout == "replicated":
                item.local = _stage_fn(v)
                if defer:
                    out.digest_sources[leaf.name] = item.local
                elif group.size == 1:  # no other rank to agree with: no pass over the bytes
                    out.digests[leaf.name] = tensor_digest(dtype, tuple(item.local.shape), 0)
                else:
                    out.digests[leaf.name] = tensor_digest(dtype, tuple(item.local.shape), crc32c(_as_bytes(item.local)))
            if item.pieces and item.replicas > 1:
                lines.setdefault(_line_key(item, kind), []).append(item)
            elif item.pieces:
                item.local = _stage_fn(item.local)
                out.to_write.append(item)
            # a tensor this rank writes comes with its fragment; the leader declares empty
            # ones, and the first and last of several replicas name the tensor (rank 0 checks that
            # some replica wrote it)
            if not item.pieces and out.leader and Box.whole(item.global_shape).volume == 0:
                out.declared[leaf.name] = (item.global_shape, dtype, item.layout)
            elif item.pieces and item.replicas > 1 and item.replica_index in (0, item.replicas - 1):
                out.replicated.append(leaf.name)
            continue
        enc = encode_value(v, leaf.name)
        if leaf.name in groups:
            out.group_values[leaf.name] = enc
            continue
        out.values[leaf.name] = enc
        out.digests[leaf.name] = hashlib.sha256(json.dumps(enc, sort_keys=True).encode()).hexdigest()
    for line in lines.values():
        for part in replica_parts(line):
            part.local = _stage_fn(part.local)
            out.to_write.append(part)
    return out


def _line_key(item: TensorItem, kind: str) -> tuple:
    """Which line of replicated tensors ``item`` joins: tensors whose replicas are the same
    ranks, as every one of those ranks sees them (plain tensors: all holders; DTensors:
    the same layout; Sharded: the same replica count, which the rules give per set of
    replica axes, and the same index; see docs/FORMAT.md, "Who writes replicas")."""
    key = (kind, item.replicas, item.replica_index)
    return key if kind == "sharded" else key + (item.layout,)


def replica_parts(line: list[TensorItem]) -> list[TensorItem]:
    """This rank's share of a line of replicated tensors (all of the same replicas):
    whole tensors or row slices, cut by :func:`~unickpt.plan.save_plan.replica_shares`."""
    line = sorted(line, key=lambda i: (i.name, i.shard_key))
    sizes = [i.local.numel() * i.local.element_size() for i in line]
    shares = replica_shares(sizes, [cut_rows(i) for i in line], line[0].replicas, line[0].replica_index)
    return [row_slice(line[k], a, b) if cut_rows(line[k]) > 1 else line[k] for k, a, b in shares]


def write_data_file(
    storage: Storage, name: str, rank: int, items: list[TensorItem], block_bytes: int, threads: int
) -> tuple[int, list[Fragment]]:
    """Write ``items`` (staged, contiguous CPU tensors) as one safetensors file, in chunks
    from ``threads`` threads, checksumming each chunk as it goes; fsync once at the end.
    Returns the file's size and the fragments it holds."""
    writer = DataFileWriter(storage, name, rank, items, block_bytes, threads)
    try:
        writer.write([(k, 0, as_bytes(i.local)) for k, i in enumerate(items)])
    except BaseException:
        writer.abort()
        raise
    return writer.finish()


@dataclass
class StagedSave:
    """A save whose state is captured (staged in host memory): it can finish without the
    live state_dict, now or in a background thread."""

    group: Group
    path: str
    overwrite: bool
    local: LocalState | None
    error: str | None
    metadata: dict[str, Any]
    block_bytes: int
    threads: int
    storage_options: dict[str, Any] | None = None
    base: str | None = None


def _describe(e: Exception) -> str:
    return str(e) if isinstance(e, UnickptError) else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def stage(
    state_dict: dict[str, Any],
    path: str,
    *,
    process_group: Any = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    threads: int = 4,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    storage_options: dict[str, Any] | None = None,
    base: str | os.PathLike | None = None,
) -> StagedSave:
    """Phase 1 of a save (collective): check the arguments and capture this rank's state.
    Nothing is written yet.

    After it returns, the caller may change the state freely. A failure on this rank is
    recorded and reported to every rank by :func:`write_and_commit`.
    """
    if block_bytes <= 0 or block_bytes % 8:
        raise SaveError(f"block_bytes must be a positive multiple of 8, not {block_bytes}")
    group = resolve_group(process_group)
    check_not_committed(path, overwrite, storage_options)
    try:
        local, error = collect(state_dict, group), None
    except Exception as e:  # reported to rank 0, which fails the whole save
        local, error = None, _describe(e)
    return StagedSave(group, str(path), overwrite, local, error, dict(metadata or {}), block_bytes, threads,
                      storage_options, None if base is None else os.fspath(base))


def check_not_committed(path: str, overwrite: bool, storage_options: dict[str, Any] | None = None) -> None:
    """SaveError when ``path`` (a directory or URL) already holds a committed checkpoint
    and not ``overwrite``; StorageError for a URL no backend knows."""
    if not overwrite and open_storage(path, storage_options).exists(MANIFEST_NAME):
        raise SaveError(f"{path} already holds a committed checkpoint; pass overwrite=True to replace it")


def rank_payload(
    group: Group, local: LocalState, written: list[tuple[TensorItem, Fragment]], files: dict[str, int],
    base: BaseIndex | None = None,
) -> dict[str, Any]:
    """What this rank reports to rank 0 once its file is durable (``base``: the base of an
    incremental save, whose checkpoints the written fragments may reference). Each
    fragment travels as the JSON text the manifest stores, with what rank 0 checks it by
    (its volume, a key of its boxes and one of its checksums, its bounding box: a
    :class:`~unickpt.format.rank_message.FragmentRecord`), so rank 0 parses no fragment."""
    frags: list[FragmentRecord] = []
    rank_frags: dict[str, dict[str, Any]] = {}
    for item, frag in written:
        shape, dtype = list(item.global_shape), dtype_name(item.local.dtype)
        fjson = fragment_to_json(frag)
        if item.layout == "per-rank":
            rank_frags[item.name] = {"shape": shape, "dtype": dtype, "layout": item.layout, "fragment": fjson}
            continue
        boxes = [(p.global_box.offsets, p.global_box.lengths) for p in frag.pieces]
        lo = [min(o[d] for o, _ in boxes) for d in range(len(shape))] if boxes else [0] * len(shape)
        hi = [max(o[d] + n[d] for o, n in boxes) for d in range(len(shape))] if boxes else lo
        frags.append(FragmentRecord(
            item.name, shape, dtype, item.layout, json.dumps(fjson, separators=(",", ":")).encode(),
            sum(p.global_box.volume for p in frag.pieces), _short_hash(repr(boxes)), _short_hash(repr(frag.crc32c)),
            (lo, [h - o for h, o in zip(hi, lo)]),
        ))
    return {
        "rank": group.rank, "error": None, "files": files, "fragments": frags,
        "declared": {k: [list(s), d, lay] for k, (s, d, lay) in local.declared.items()}, "replicated": local.replicated,
        "digests": local.digests, "values": local.values if local.leader else {},
        "rank_values": local.rank_values, "rank_tensors": rank_frags, "group_values": local.group_values,
        "bases": holders_json(base), "incremental": None if base is None else base.lineage(),
    }


def _short_hash(text: str) -> int:
    """A 64-bit key of ``text`` (the first 8 bytes of its BLAKE2b, as a big-endian integer)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def rank_message(payload: dict[str, Any]) -> bytes:
    """The bytes a rank sends to rank 0 at commit: its payload (:func:`rank_payload`) in
    the binary form of ``format/rank_message.py`` (members left empty are left out)."""
    head = {k: v for k, v in payload.items() if k != "fragments" and v is not None and not (isinstance(v, (dict, list)) and not v)}
    return encode_message(head, payload.get("fragments", []))


def read_message(message: bytes) -> dict[str, Any]:
    """The payload of a :func:`rank_message` (each fragment as a dict, its JSON text as bytes)."""
    return decode_message(message)


_DATA_FILE = re.compile(r"rank_\d{5,}\.safetensors")


def checkpoint_file(name: str) -> bool:
    """True for the names a unickpt checkpoint's files have in its directory."""
    return name in (MANIFEST_NAME, INDEX_NAME) or _DATA_FILE.fullmatch(name) is not None


@dataclass
class Target:
    """Where a save writes: the staging directory every rank writes its file to, and
    (on rank 0) the claim on the checkpoint directory that commits or discards it."""

    storage: Storage
    write: Any  # DirectoryWrite, PrefixWrite (object stores) or None


def prepare_collective(group: Group, path: str, overwrite: bool, manifest_copy: bool | None = None,
                       storage_options: dict[str, Any] | None = None) -> Target:
    """Collective: rank 0 claims the checkpoint directory (an exclusive lock, then the
    overwrite check) and makes the staging directory every rank writes to. Raises the same
    :class:`SaveError` on every rank when it cannot.

    With ``manifest_copy`` not None (each rank's ``path`` a directory of its own machine,
    as the in-memory snapshots' fresh per-step directories in host memory) every rank
    writes straight into its own ``path``, created if needed: no claim, no staging.

    On an object store (a URL other than ``file://``) there is no staging: every rank
    writes into the prefix itself and the manifest, written last, commits
    (:class:`~unickpt.storage.fsspec_store.PrefixWrite`)."""
    if is_remote(path):
        return _prepare_remote(group, path, overwrite, storage_options)
    path = local_path(path)
    if manifest_copy is not None:
        storage, problem = open_storage(path), b""
        try:
            storage.prepare()
        except (OSError, UnickptError) as e:
            problem = f"rank {group.rank}: cannot prepare {path}: {e}".encode()
        problems = gather_bytes(group, problem, 0)
        status = broadcast_bytes(group, b"\n".join(p for p in problems if p) if problems is not None else b"", 0)
        if status:
            raise SaveError(status.decode(errors="replace"))
        return Target(storage, None)
    write, status = None, b""
    if group.rank == 0:
        try:
            write = DirectoryWrite.begin(path, MANIFEST_NAME, overwrite, checkpoint_file)
            status = b"ok\n" + os.fsencode(write.staging_from_target)
        except UnickptError as e:
            status = str(e).encode()
    status = broadcast_bytes(group, status, 0)
    kind, _, where = status.partition(b"\n")
    if kind != b"ok" or not where:
        raise SaveError(status.decode(errors="replace"))
    return Target(rank_storage(path, os.fsdecode(where)), write)


def rank_storage(path: str, where: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage a rank writes its data file to: the staging directory ``where``
    (relative to the checkpoint directory ``path``, as the claim names it), or on an
    object store (``where`` empty) the prefix itself."""
    if is_remote(path):
        return open_storage(path, storage_options)
    return open_storage(os.path.join(local_path(path), where))


def claim(path: str, overwrite: bool, storage_options: dict[str, Any] | None = None) -> tuple[Any, Storage]:
    """One process's claim on a checkpoint location it writes alone (convert, export, a
    tier copy) and the storage its files go to: a locked directory and its staging
    directory, or an object-store prefix (written in place, the manifest commits).
    The claim's ``commit(documents)`` commits, ``abort()`` removes what was written."""
    if is_remote(path):
        from ..storage.fsspec_store import PrefixWrite

        storage = open_storage(path, storage_options)
        return PrefixWrite.begin(storage, MANIFEST_NAME, overwrite, checkpoint_file), storage
    write = DirectoryWrite.begin(local_path(path), MANIFEST_NAME, overwrite, checkpoint_file)
    return write, open_storage(write.staging)


def _prepare_remote(group: Group, path: str, overwrite: bool, storage_options: dict[str, Any] | None) -> Target:
    from ..storage.fsspec_store import PrefixWrite

    storage, write, status = None, None, b"ok"
    try:
        storage = open_storage(path, storage_options)
        if group.rank == 0:
            write = PrefixWrite.begin(storage, MANIFEST_NAME, overwrite, checkpoint_file)
    except UnickptError as e:
        status = str(e).encode()
    status = broadcast_bytes(group, status if group.rank == 0 else b"", 0)
    if status != b"ok" or storage is None:
        raise SaveError(status.decode(errors="replace") if status != b"ok" else f"cannot open {path}")
    return Target(storage, write)


def _rank_payload(staged: StagedSave, storage: Storage) -> dict[str, Any]:
    group, local = staged.group, staged.local
    if staged.error is not None or local is None:
        return {"rank": group.rank, "error": staged.error}
    try:
        files: dict[str, int] = {}
        written: list[tuple[TensorItem, Fragment]] = []
        to_write = local.to_write + local.rank_tensors
        base = open_base(staged.base, staged.path) if staged.base is not None else None
        if base is not None:
            changed, refs = split_unchanged(base, to_write, group.rank, staged.block_bytes, staged.threads)
            written = [(to_write[k], f) for k, f in refs]
            to_write = [to_write[k] for k in changed]
        if to_write:
            fname = data_file_name(group.rank)
            size, fragments = write_data_file(storage, fname, group.rank, to_write, staged.block_bytes, staged.threads)
            files[fname] = size
            written += list(zip(to_write, fragments))
        return rank_payload(group, local, written, files, base)
    except Exception as e:
        return {"rank": group.rank, "error": _describe(e)}


def write_and_commit(staged: StagedSave, group: Group | None = None) -> None:
    """Phase 2 of a save (collective): claim the directory, write this rank's file, then
    rank 0 checks every rank's report and commits the manifest. Raises the same error on
    every rank if any rank failed. ``group`` overrides the group used to talk (async saves
    use their own)."""
    group = group or staged.group
    target = prepare_collective(group, staged.path, staged.overwrite, storage_options=staged.storage_options)
    commit(group, _rank_payload(staged, target.storage), target, staged.metadata)


def commit(
    group: Group, payload: dict[str, Any], target: Target, metadata: dict[str, Any],
    manifest_copy: bool | None = None,
) -> None:
    """Collective: gather every rank's report to rank 0, which checks them and commits the
    manifest (swapping the staging directory in), or, when any rank failed, removes
    everything the save wrote; raises the same error on every rank if any rank failed.

    ``manifest_copy`` (the same None-ness on every rank): when not None, the ranks wrote
    straight into their own directories (``prepare_collective``), rank 0 sends the
    committed manifest to every rank, and each rank passing True also writes it into its
    own directory (ranks writing to different machines' directories, as the in-memory
    snapshots do: every node needs the manifest)."""
    gathered = gather_bytes(group, rank_message(payload), 0)
    result = b"ok"
    if gathered is not None:
        try:
            # a manifest sent to every rank (snapshots) stays one document
            docs = manifest_document(gathered, group.size, metadata, False if manifest_copy is not None else None)
            doc = docs[MANIFEST_NAME]
            if target.write is not None:
                target.write.commit(docs)
            else:
                target.storage.write_atomic(MANIFEST_NAME, doc)
            if manifest_copy is not None:
                result = b"ok\n" + doc
        except UnickptError as e:
            result = f"{type(e).__name__}\n{e}".encode()
        except Exception as e:
            result = f"SaveError\n{type(e).__name__}: {e}".encode()
        finally:
            if not result.startswith(b"ok") and target.write is not None:
                target.write.abort()
    result = broadcast_bytes(group, result, 0)
    if result.startswith(b"ok\n"):
        if manifest_copy and group.rank != 0:
            target.storage.write_atomic(MANIFEST_NAME, result[3:])
        return
    if result != b"ok":
        kind, _, text = result.decode().partition("\n")
        raise getattr(errors, kind, SaveError)(text)


@gc_paused()
def save(
    state_dict: dict[str, Any],
    path: str,
    *,
    process_group: Any = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    threads: int = 4,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    storage_options: dict[str, Any] | None = None,
    base: str | os.PathLike | None = None,
) -> None:
    """Save ``state_dict`` to the checkpoint directory ``path``.

    Collective over ``process_group`` (default: the default group if initialised, else a
    single process): every rank calls it with its own shards. Each rank writes the
    fragments it owns to ``rank_XXXXX.safetensors``; rank 0 writes ``manifest.json``
    last, after every file is durable, and commits the whole directory at once (a
    checkpoint already at ``path`` is replaced only then, with ``overwrite=True``).
    Raises :class:`SaveError` on every rank if any rank failed; then nothing is
    committed, what the save wrote is removed, and an old checkpoint stays as it was.
    A second save to the same ``path`` while one runs fails at once.

    ``path`` may be a URL (``s3://bucket/run/step_5``, any fsspec file system) with
    ``storage_options`` for its file system: each rank uploads its file (multipart on S3)
    and the manifest, uploaded last, commits (docs/FORMAT.md); there an overwrite
    uncommits the old checkpoint first, and concurrent saves to one URL are not detected.
    ``base`` (an earlier checkpoint) makes the save incremental: a fragment whose bytes
    equal the base's (same xxh3-128 identity) is not written but referenced where its bytes
    lie, in the base or in a checkpoint the base references (docs/FORMAT.md, "Incremental
    checkpoints"). The result loads on its own, as long as those checkpoints are kept.
    """
    staged = stage(
        state_dict, path, process_group=process_group, metadata=metadata,
        overwrite=overwrite, threads=threads, block_bytes=block_bytes, storage_options=storage_options, base=base,
    )
    write_and_commit(staged)
