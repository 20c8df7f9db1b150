"""``save``: every rank writes the fragments it owns, rank 0 commits the manifest last."""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import __version__
from ..dist import Group, all_gather_fixed, broadcast_bytes, gather_bytes, resolve_group
from .. import errors
from ..errors import InconsistentStateError, SaveError, UnickptError
from ..format.checksum import block_crcs, crc32c
from ..format.dtypes import dtype_name
from ..format.manifest import (
    DEFAULT_BLOCK_BYTES,
    MANIFEST_NAME,
    Fragment,
    Manifest,
    TensorEntry,
    fragment_from_json,
    fragment_to_json,
)
from ..format.safetensors_header import Entry, build_header
from ..format.values import encode_value
from ..plan.box import Box
from ..plan.save_plan import replica_owner, write_chunks
from ..storage.local import LocalStorage
from .items import Holders, TensorItem, sharded_item, tensor_item
from .state import PerRank, Sharded, flatten

WRITE_CHUNK_BYTES = 16 << 20


def data_file_name(rank: int) -> str:
    """Name of the data file a group rank writes."""
    return f"rank_{rank:05d}.safetensors"


@dataclass
class LocalState:
    """What one rank contributes to a checkpoint, split by kind."""

    to_write: list[TensorItem] = field(default_factory=list)
    declared: dict[str, tuple[tuple[int, ...], str, str]] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    rank_values: dict[str, Any] = field(default_factory=dict)
    rank_tensors: list[TensorItem] = field(default_factory=list)
    leader: bool = True


def _stage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy (or the tensor itself when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def _as_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def holders_of(names: list[str], group: Group) -> Holders:
    """Find the ranks holding the same state names as this one (one 8-byte hash per rank)."""
    digest = hashlib.blake2b("\n".join(sorted(names)).encode(), digest_size=8).digest()
    hashes = all_gather_fixed(group, digest)
    return Holders(group, [r for r, h in enumerate(hashes) if h == digest])


def collect(state_dict: dict[str, Any], group: Group) -> LocalState:
    """Classify this rank's state (collective): fragments it owns, values to check and
    commit, per-rank state. Copies what it will write to host memory."""
    out = LocalState()
    leaves = flatten(state_dict)
    holders = holders_of([leaf.name for leaf in leaves if not isinstance(leaf.value, PerRank)], group)
    out.leader = holders.members[0] == group.rank
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, PerRank):
            if isinstance(v.value, torch.Tensor):
                out.rank_tensors.append(tensor_item(leaf.name, _stage(v.value), None))
            else:
                out.rank_values[leaf.name] = encode_value(v.value, leaf.name)
            continue
        if isinstance(v, (torch.Tensor, Sharded)):
            if isinstance(v, Sharded):
                item = sharded_item(leaf.name, v)
                v = v.local
            else:
                item = tensor_item(leaf.name, v, holders)
            if item is None:
                continue
            dtype = dtype_name(v.dtype)
            if item.layout == "replicated":
                item.local = _stage(v)
                out.digests[leaf.name] = f"tensor {dtype} {list(item.local.shape)} crc32c={crc32c(_as_bytes(item.local)):08x}"
            if item.pieces and replica_owner(item.name, item.shard_key, item.replicas) == item.replica_index:
                item.local = _stage(item.local)
                out.to_write.append(item)
            if item.pieces or (out.leader and Box.whole(item.global_shape).volume == 0):
                out.declared[leaf.name] = (item.global_shape, dtype, item.layout)
            continue
        enc = encode_value(v, leaf.name)
        out.values[leaf.name] = enc
        out.digests[leaf.name] = hashlib.sha256(json.dumps(enc, sort_keys=True).encode()).hexdigest()
    return out


def write_data_file(
    storage: LocalStorage, name: str, rank: int, items: list[TensorItem], block_bytes: int, threads: int
) -> tuple[int, list[Fragment]]:
    """Write ``items`` (staged, contiguous CPU tensors) as one safetensors file, in chunks
    from ``threads`` threads, checksumming each chunk as it goes; fsync once at the end.
    Returns the file's size and the fragments it holds."""
    entries = [Entry(i.name, dtype_name(i.local.dtype), tuple(i.local.shape), i.local.numel() * i.local.element_size()) for i in items]
    prefix, offsets = build_header(entries, {"format": "unickpt", "rank": str(rank)})
    size = len(prefix) + sum(e.nbytes for e in entries)
    chunks = []
    for k, (item, off) in enumerate(zip(items, offsets)):
        data = _as_bytes(item.local)
        chunks += [(k, off + lo, data[lo:hi]) for lo, hi in write_chunks(data.nbytes, WRITE_CHUNK_BYTES, block_bytes)]
    writer = storage.open_writer(name, size)
    try:
        writer.pwrite(0, prefix)

        def write(chunk: tuple[int, int, memoryview]) -> list[int]:
            _, at, data = chunk
            crcs = block_crcs(data, block_bytes)
            writer.pwrite(at, data)
            return crcs

        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            chunk_crcs = list(pool.map(write, chunks))
    finally:
        writer.close(durable=True)
    per_item: list[list[int]] = [[] for _ in items]
    for (k, _, _), crcs in zip(chunks, chunk_crcs):
        per_item[k] += crcs
    fragments = [
        Fragment(name, off, tuple(i.local.shape), i.pieces, per_item[k], block_bytes, rank)
        for k, (i, off) in enumerate(zip(items, offsets))
    ]
    return size, fragments


@dataclass
class StagedSave:
    """A save whose state is captured (staged in host memory): it can finish without the
    live state_dict, now or in a background thread."""

    group: Group
    storage: LocalStorage
    local: LocalState | None
    error: str | None
    metadata: dict[str, Any]
    block_bytes: int
    threads: int


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
) -> StagedSave:
    """Phase 1 of a save (collective): prepare the directory and capture this rank's state.

    After it returns, the caller may change the state freely. A failure on this rank is
    recorded and reported to every rank by :func:`write_and_commit`.
    """
    if block_bytes <= 0 or block_bytes % 8:
        raise SaveError(f"block_bytes must be a positive multiple of 8, not {block_bytes}")
    group = resolve_group(process_group)
    storage = LocalStorage(path)
    if storage.exists(MANIFEST_NAME) and not overwrite:
        raise SaveError(f"{path} already holds a committed checkpoint; pass overwrite=True to replace it")
    status = b"ok"
    if group.rank == 0:
        try:
            storage.prepare()
            storage.remove(MANIFEST_NAME)
        except OSError as e:
            status = f"cannot prepare {path}: {e}".encode()
    status = broadcast_bytes(group, status, 0)
    if status != b"ok":
        raise SaveError(status.decode())
    try:
        local, error = collect(state_dict, group), None
    except Exception as e:  # reported to rank 0, which fails the whole save
        local, error = None, _describe(e)
    return StagedSave(group, storage, local, error, dict(metadata or {}), block_bytes, threads)


def _rank_payload(staged: StagedSave) -> dict[str, Any]:
    group, local = staged.group, staged.local
    if staged.error is not None or local is None:
        return {"rank": group.rank, "error": staged.error}
    try:
        frags: dict[str, dict[str, Any]] = {}
        rank_frags: dict[str, dict[str, Any]] = {}
        files: dict[str, int] = {}
        to_write = local.to_write + local.rank_tensors
        if to_write:
            fname = data_file_name(group.rank)
            size, fragments = write_data_file(staged.storage, fname, group.rank, to_write, staged.block_bytes, staged.threads)
            files[fname] = size
            for item, frag in zip(to_write, fragments):
                target = frags if item.layout != "per-rank" else rank_frags
                target[item.name] = {
                    "shape": list(item.global_shape), "dtype": dtype_name(item.local.dtype),
                    "layout": item.layout, "fragment": fragment_to_json(frag),
                }
        return {
            "rank": group.rank, "error": None, "files": files, "fragments": frags,
            "declared": {k: [list(s), d, lay] for k, (s, d, lay) in local.declared.items()},
            "digests": local.digests, "values": local.values if local.leader else {},
            "rank_values": local.rank_values, "rank_tensors": rank_frags,
        }
    except Exception as e:
        return {"rank": group.rank, "error": _describe(e)}


def _check_agreement(payloads: list[dict[str, Any]]) -> None:
    """Every key held by several ranks (plain values, plain tensors) must be equal on all."""
    seen: dict[str, dict[str, list[int]]] = {}
    for p in payloads:
        for key, digest in p["digests"].items():
            seen.setdefault(key, {}).setdefault(digest, []).append(p["rank"])
    problems = []
    for key in sorted(seen):
        if len(seen[key]) > 1:
            variants = sorted(seen[key].items(), key=lambda kv: kv[1][0])
            problems.append(f"{key!r} (" + "; ".join(f"ranks {_ranks(r)}: {d}" for d, r in variants[:3]) + ")")
    if problems:
        raise InconsistentStateError(
            "these entries differ between ranks; make them equal, or wrap per-rank state in unickpt.PerRank: "
            + "; ".join(problems[:10]) + (f" and {len(problems) - 10} more" if len(problems) > 10 else "")
        )


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:6])) + (",..." if len(ranks) > 6 else "")


def _dedup_and_check(entry: TensorEntry) -> None:
    """Drop duplicate fragments (same boxes written twice) after checking they agree, and
    make sure the fragments tile the tensor exactly."""
    seen: dict[tuple, Fragment] = {}
    kept = []
    for f in sorted(entry.fragments, key=lambda f: f.rank):
        key = tuple((p.global_box.offsets, p.global_box.lengths) for p in f.pieces)
        if key in seen:
            if seen[key].crc32c != f.crc32c:
                raise InconsistentStateError(
                    f"{entry.name!r}: replicas on ranks {seen[key].rank} and {f.rank} hold different data for the same shard"
                )
            continue
        seen[key] = f
        kept.append(f)
    entry.fragments = kept
    stored = sum(p.global_box.volume for f in kept for p in f.pieces)
    total = Box.whole(entry.shape).volume if entry.shape else 1
    if stored != total and not (total == 0 and stored == 0):
        raise SaveError(f"{entry.name!r}: the saved shards hold {stored} elements of {total}; the layout overlaps or leaves gaps")


def assemble(payloads: list[dict[str, Any]], world_size: int, metadata: dict[str, Any]) -> Manifest:
    """Build the manifest from every rank's payload (rank 0 only)."""
    errors = [f"rank {p['rank']}: {p['error']}" for p in payloads if p.get("error")]
    if errors:
        raise SaveError("save failed, nothing was committed:\n" + "\n".join(errors))
    _check_agreement(payloads)
    m = Manifest(world_size=world_size, metadata=encode_value(metadata, "metadata"))
    m.provenance = {
        "unickpt": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "world_size": world_size, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    for p in payloads:
        m.values.update(p["values"])
    for p in payloads:
        m.files.update(p["files"])
        for name, (shape, dtype, layout) in p["declared"].items():
            m.tensors.setdefault(name, TensorEntry(name, tuple(shape), dtype, [], layout))
        for name, d in p["fragments"].items():
            m.tensors[name].fragments.append(fragment_from_json(d["fragment"]))
    for entry in m.tensors.values():
        _dedup_and_check(entry)
    rank_value_names = sorted({k for p in payloads for k in p["rank_values"]})
    for name in rank_value_names:
        m.rank_values[name] = [p["rank_values"].get(name) for p in payloads]
    rank_tensor_names = sorted({k for p in payloads for k in p["rank_tensors"]})
    for name in rank_tensor_names:
        row: list[TensorEntry | None] = []
        for p in payloads:
            d = p["rank_tensors"].get(name)
            row.append(None if d is None else TensorEntry(name, tuple(d["shape"]), d["dtype"], [fragment_from_json(d["fragment"])], "per-rank"))
        m.rank_tensors[name] = row
    return m


def write_and_commit(staged: StagedSave, group: Group | None = None) -> None:
    """Phase 2 of a save (collective): write this rank's file, then rank 0 checks every
    rank's report and commits the manifest. Raises the same error on every rank if any
    rank failed. ``group`` overrides the group used to talk (async saves use their own)."""
    group = group or staged.group
    payload = _rank_payload(staged)
    gathered = gather_bytes(group, json.dumps(payload).encode(), 0)
    result = b"ok"
    if gathered is not None:
        try:
            manifest = assemble([json.loads(g) for g in gathered], group.size, staged.metadata)
            staged.storage.write_atomic(MANIFEST_NAME, manifest.to_json().encode())
        except UnickptError as e:
            result = f"{type(e).__name__}\n{e}".encode()
        except Exception as e:
            result = f"SaveError\n{type(e).__name__}: {e}".encode()
    result = broadcast_bytes(group, result, 0)
    if result != b"ok":
        kind, _, text = result.decode().partition("\n")
        raise getattr(errors, kind, SaveError)(text)


def save(
    state_dict: dict[str, Any],
    path: str,
    *,
    process_group: Any = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    threads: int = 4,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> None:
    """Save ``state_dict`` to the checkpoint directory ``path``.

    Collective over ``process_group`` (default: the default group if initialised, else a
    single process): every rank calls it with its own shards. Each rank writes the
    fragments it owns to ``rank_XXXXX.safetensors``; rank 0 writes ``manifest.json``
    last, atomically, after every file is durable. Raises :class:`SaveError` on every
    rank if any rank failed; then nothing is committed.
    """
    staged = stage(
        state_dict, path, process_group=process_group, metadata=metadata,
        overwrite=overwrite, threads=threads, block_bytes=block_bytes,
    )
    write_and_commit(staged)
