"""Reading PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``, DCP) directories.

A DCP checkpoint is a directory holding ``.metadata`` (a pickle of
``torch.distributed.checkpoint.metadata.Metadata``) and data files ``__{rank}_{k}.distcp``.
Every item of a data file is a byte range holding one complete ``torch.save`` archive: one
chunk (an N-d box) of a tensor, or one non-tensor object.

Nothing is executed to read it: ``.metadata`` goes through unickpt's allow-listing
unpickler with only DCP's metadata data classes, ``torch.Size``, dtypes, layouts and
pure path classes allowed (the planner's ``SavePlan``/``WriteItem`` objects that
Megatron-Core adds as ``all_local_plans`` are kept as inert records: data, never built);
every item is opened with :func:`read_archive`, which parses the archive's zip directory and its small ``data.pkl`` (again allow-listed) and returns where
the tensor's bytes lie instead of reading them. The result is an in-memory
:class:`Manifest` whose fragments point into the ``.distcp`` files (one fragment per
chunk, no checksums: DCP stores none), so loading reshards DCP checkpoints in place with
unickpt's own planner, reading only the bytes each rank needs.

A checkpoint saved with ``dcp.save(..., use_collectives=False)`` has no global
``.metadata`` but one ``__{rank}.metadata`` per rank, each describing only the items that
rank wrote. They are merged: the chunks of all ranks form each global tensor (a chunk that
several ranks wrote, a replica, is read from the lowest rank and the other copies are
listed in ``manifest.provenance["replicas"]``); a non-tensor item that differs between ranks becomes a per-rank
value (``load_rank_values``).

Non-tensor items become plain values when the restricted unpickler accepts them and they
are JSON-like; DCP flattens lists of dicts (``optim.param_groups.0.lr``) where unickpt keeps
them whole (``optim.param_groups``), so such items are regrouped using the saved
flattening map (``Metadata.planner_data``). Items that cannot be read safely are left out
and listed with the reason in ``manifest.provenance["skipped"]``.
"""

from __future__ import annotations

import re
from math import prod
from pathlib import PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Any

from ..errors import LayoutError, ManifestError, UnickptError, UnsafePickleError
from ..format.dtypes import dtype_name, itemsize
from ..format.manifest import Fragment, Manifest, TensorEntry
from ..format.values import encode_value
from ..plan.box import Box, intersect
from ..plan.piece import box_piece
from ..storage.local import LocalStorage
from ..storage.open import open_storage
from .detect import check_relative_path
from .torch_archive import StoredTensor, inert_records, loads_restricted, read_archive, stored_tensors

if TYPE_CHECKING:
    import torch

METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
_WRITER_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA_CLASSES = (
    "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "BytesStorageMetadata",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
)
# the save planner's records (Megatron-Core keeps every rank's SavePlan in the metadata)
_PLANNER_MODULE = "torch.distributed.checkpoint.planner"
_PLANNER_RECORDS = ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
# Megatron-Core <= 0.15 pickled its own subclasses: MCoreMetadata (Metadata + mcore_data)
# and MCoreSavePlan (SavePlan + mcore_data)
_MCORE_MODULE = "megatron.core.dist_checkpointing.strategies.torch"


def is_dcp(path: str) -> bool:
    """True when ``path`` is a directory holding a DCP ``.metadata`` file (or the per-rank
    ``__{rank}.metadata`` files of a save without collectives)."""
    storage = open_storage(path)
    return storage.root.is_dir() and ((storage.root / METADATA_NAME).is_file() or bool(rank_metadata_files(path)))


def rank_metadata_files(path: str) -> dict[int, str]:
    """``{rank: "__{rank}.metadata"}`` of a DCP save without collectives (empty otherwise)."""
    root = open_storage(path).root
    if not root.is_dir():
        return {}
    return {int(m.group(1)): f.name for f in root.iterdir() if (m := _RANK_METADATA.match(f.name)) and f.is_file()}


def _layout_by_name(name: Any) -> torch.layout:
    """Safe stand-in for ``torch.serialization._get_layout``: a layout from its name only
    (looked up among torch's layout objects, never through ``getattr`` on a module)."""
    import torch

    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise UnsafePickleError(f"unknown torch layout {name!r:.80}")
    return layouts[name]


def _dcp_modules() -> tuple[Any, Any]:
    try:
        from torch.distributed.checkpoint import filesystem, metadata
    except ImportError as e:  # a torch build without torch.distributed
        raise UnickptError(f"reading a PyTorch DCP checkpoint needs torch.distributed.checkpoint ({e})") from None
    return metadata, filesystem


def metadata_allow_list() -> dict[tuple[str, str], Any]:
    """The globals a DCP ``.metadata`` pickle may name: data classes only, nothing that
    touches files, imports modules or runs commands (paths become pure paths)."""
    metadata, filesystem = _dcp_modules()
    allowed: dict[tuple[str, str], Any] = {(_METADATA_MODULE, n): getattr(metadata, n) for n in _METADATA_CLASSES}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch.serialization", "_get_layout")] = _layout_by_name
    allowed.update(inert_records(_PLANNER_MODULE, _PLANNER_RECORDS))
    allowed.update(inert_records(_MCORE_MODULE, ("MCoreSavePlan",)))
    allowed[(_MCORE_MODULE, "MCoreMetadata")] = metadata.Metadata  # its fields are Metadata's plus mcore_data
    for module in ("pathlib", "pathlib._local"):
        for name in ("PurePath", "PurePosixPath", "PosixPath", "Path"):
            allowed[(module, name)] = PurePosixPath
        for name in ("PureWindowsPath", "WindowsPath"):
            allowed[(module, name)] = PureWindowsPath
    return allowed


def read_metadata(path: str, name: str = METADATA_NAME) -> Any:
    """The ``Metadata`` object of the DCP checkpoint at ``path`` (its file ``name``),
    unpickled with the allow list and checked for the structure a reader relies on."""
    storage = open_storage(path)
    data = storage.read_small(name)
    md = loads_restricted(data, f"{path}/{name}", metadata_allow_list())
    _check_metadata(md, path, name)
    return md


def _check_metadata(md: Any, path: str, name: str = METADATA_NAME) -> None:
    metadata, filesystem = _dcp_modules()
    import torch  # imported with torch.distributed.checkpoint above

    where = f"{path}/{name}"
    if not isinstance(md, metadata.Metadata):
        raise ManifestError(f"{where}: not DCP metadata (a {type(md).__name__})")
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise ManifestError(f"{where}: state_dict_metadata is not a dict")
    for fqn, item in sdm.items():
        if not isinstance(fqn, str):
            raise ManifestError(f"{where}: key {fqn!r} is not a string")
        if isinstance(item, metadata.TensorStorageMetadata):
            if not isinstance(getattr(item, "properties", None), metadata.TensorProperties) or not isinstance(
                getattr(item.properties, "dtype", None), torch.dtype
            ):
                raise ManifestError(f"{where}: {fqn!r} has no valid tensor properties")
            if not _int_tuple(getattr(item, "size", None)) or not isinstance(getattr(item, "chunks", None), list):
                raise ManifestError(f"{where}: {fqn!r} has no valid size or chunk list")
            for c in item.chunks:
                if not isinstance(c, metadata.ChunkStorageMetadata) or not _int_tuple(getattr(c, "offsets", None)) \
                        or not _int_tuple(getattr(c, "sizes", None)):
                    raise ManifestError(f"{where}: {fqn!r} has a malformed chunk")
        elif not isinstance(item, metadata.BytesStorageMetadata):
            raise ManifestError(f"{where}: {fqn!r} has unknown storage metadata {type(item).__name__}")
    sd = getattr(md, "storage_data", None)
    if not isinstance(sd, dict):
        raise ManifestError(f"{where}: storage_data is not a dict (not written by DCP's file system writer?)")
    for k, v in sd.items():
        if not isinstance(k, metadata.MetadataIndex) or not isinstance(getattr(k, "fqn", None), str):
            raise ManifestError(f"{where}: malformed storage index {k!r:.80}")
        if getattr(k, "offset", None) is not None and not _int_tuple(k.offset):
            raise ManifestError(f"{where}: malformed storage index {k!r:.80}")
        if not isinstance(v, filesystem._StorageInfo) or not isinstance(getattr(v, "relative_path", None), str) \
                or not _int(getattr(v, "offset", None)) or not _int(getattr(v, "length", None)) \
                or v.offset < 0 or v.length < 0:
            raise ManifestError(f"{where}: malformed storage entry for {k.fqn!r}")


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_tuple(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and all(_int(i) and i >= 0 for i in x)


def writer_rank(file: str) -> int | None:
    """The rank that wrote ``__{rank}_{k}.distcp``, or None for another name."""
    m = _WRITER_FILE.match(PurePosixPath(file).name)
    return int(m.group(1)) if m else None


def read_dcp(path: str, md: Any = None) -> Manifest:
    """An in-memory manifest of the DCP checkpoint at ``path`` (see the module docstring);
    ``md``: its metadata when the caller has read it already."""
    storage = open_storage(path)
    try:
        if md is None and not storage.exists(METADATA_NAME) and (per_rank := rank_metadata_files(path)):
            return _build_rank_local(storage, per_rank, str(path))
        return _build(storage, read_metadata(path) if md is None else md, str(path))
    finally:
        storage.close()


def _build_rank_local(storage: LocalStorage, per_rank: dict[int, str], path: str) -> Manifest:
    """The manifest of a save without collectives: every rank's metadata merged into one."""
    metadata, _ = _dcp_modules()
    mds = {r: read_metadata(path, per_rank[r]) for r in sorted(per_rank)}
    first = mds[min(mds)]
    merged = metadata.Metadata(state_dict_metadata={}, planner_data={}, storage_data={},
                               storage_meta=first.storage_meta, version=first.version)
    copies: dict[str, set[int]] = {}
    values_by_rank: dict[str, dict[int, Any]] = {}
    for rank, md in mds.items():
        if isinstance(md.planner_data, dict):
            merged.planner_data.update(md.planner_data)
        stored: dict[str, dict[Any, Any]] = {}  # fqn -> {chunk offsets or None: (index, storage info)}
        for k, v in md.storage_data.items():
            stored.setdefault(k.fqn, {})[None if k.offset is None else tuple(k.offset)] = (k, v)
        for fqn, item in md.state_dict_metadata.items():
            if isinstance(item, metadata.BytesStorageMetadata):
                index, info = stored.get(fqn, {}).get(None, (None, None))
                values_by_rank.setdefault(fqn, {})[rank] = info
                if fqn not in merged.state_dict_metadata and index is not None:
                    merged.state_dict_metadata[fqn] = item
                    merged.storage_data[index] = info
                continue
            have = merged.state_dict_metadata.setdefault(
                fqn, metadata.TensorStorageMetadata(item.properties, item.size, []))
            if not isinstance(have, metadata.TensorStorageMetadata) or tuple(have.size) != tuple(item.size) \
                    or have.properties.dtype != item.properties.dtype:
                raise ManifestError(f"{path}: {fqn!r} is described differently in {per_rank[rank]} than by a lower rank")
            for chunk in item.chunks:
                box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
                seen = [Box(tuple(c.offsets), tuple(c.sizes)) for c in have.chunks]
                if box in seen:
                    copies.setdefault(fqn, set()).add(rank)
                    continue
                if any(intersect(box, b) is not None for b in seen):
                    raise ManifestError(f"{path}: {fqn!r} has overlapping chunks of different shapes in {per_rank[rank]}")
                have.chunks.append(chunk)
                index, info = stored.get(fqn, {}).get(tuple(chunk.offsets), (None, None))
                if index is not None:  # else _build names the chunk without a storage entry
                    merged.storage_data[index] = info
    manifest = _build(storage, merged, path)
    skipped = manifest.provenance.setdefault("skipped", {})
    if copies:
        manifest.provenance["replicas"] = {}
    for fqn, ranks in copies.items():
        manifest.provenance["replicas"][f"{fqn} (copies of ranks {', '.join(map(str, sorted(ranks)))})"] = (
            "the same chunk as a lower rank's (a replica written by every rank without collectives); "
            "read from the lowest rank")
    _per_rank_values(storage, manifest, values_by_rank, skipped)
    if not skipped:
        del manifest.provenance["skipped"]
    manifest.world_size = max(max(per_rank) + 1, manifest.world_size)
    manifest.provenance["world_size"] = manifest.world_size
    manifest.provenance["rank_local_metadata"] = True
    return manifest


def _per_rank_values(storage: LocalStorage, manifest: Manifest, values_by_rank: dict[str, dict[int, Any]],
                     skipped: dict[str, str]) -> None:
    """A non-tensor item whose ranks saved different values becomes a per-rank value."""
    for fqn, infos in values_by_rank.items():
        if len(infos) < 2 or fqn in skipped:
            continue
        encoded: dict[int, Any] = {}
        for rank, info in infos.items():
            if info is None:
                raise ManifestError(f"{storage.root}: {fqn!r} of rank {rank} has no storage entry")
            check_relative_path(info.relative_path)
            try:
                encoded[rank] = encode_value(read_archive(storage, info.relative_path, info.offset, info.length), fqn)
            except UnickptError as e:
                skipped[fqn] = f"rank {rank}'s value: {e}"
                manifest.values.pop(fqn, None)
                break
        if fqn in skipped or all(v == encoded[min(encoded)] for v in encoded.values()):
            continue
        name = next((n for n in manifest.values if n == fqn or fqn.startswith(n + ".")), fqn)
        if name != fqn:  # regrouped into a container: keep the items flat and per rank
            skipped[fqn] = "differs between ranks inside a regrouped container; read from the lowest rank"
            continue
        manifest.values.pop(fqn, None)
        world = max(max(infos) + 1, manifest.world_size)
        manifest.rank_values[fqn] = [encoded.get(r) for r in range(world)]
        manifest.files.update({i.relative_path: storage.size(i.relative_path) for i in infos.values()})


def _build(storage: LocalStorage, md: Any, path: str) -> Manifest:
    infos: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for k, v in md.storage_data.items():
        infos[(k.fqn, None if k.offset is None else tuple(int(x) for x in k.offset))] = v
    manifest = Manifest()
    skipped: dict[str, str] = {}
    files: dict[str, int] = {}

    def file_size(rel: str) -> int:
        if rel not in files:
            check_relative_path(rel)
            files[rel] = storage.size(rel)
        return files[rel]

    def info_of(fqn: str, offsets: tuple[int, ...] | None) -> Any:
        info = infos.get((fqn, offsets))
        if info is None:
            where = "" if offsets is None else f" (chunk at {list(offsets)})"
            raise ManifestError(f"{path}: {fqn!r}{where} has no storage entry in {METADATA_NAME}")
        if info.transform_descriptors:
            raise LayoutError(
                f"{path}: {fqn!r} is stored with DCP stream transforms {list(info.transform_descriptors)} "
                "(e.g. compression), which unickpt does not read"
            )
        file_size(info.relative_path)
        return info

    paths = _planner_paths(md)
    value_items: list[tuple[str, Any]] = []
    tensor_prefixes: set[tuple[Any, ...]] = set()
    metadata, _ = _dcp_modules()
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, metadata.BytesStorageMetadata):
            value_items.append((fqn, item))
            continue
        p = paths.get(fqn)
        if p is not None:
            tensor_prefixes.update(p[:i] for i in range(1, len(p) + 1))
        try:
            dtype = dtype_name(item.properties.dtype)
        except LayoutError:
            skipped[fqn] = f"dtype {item.properties.dtype} has no unickpt equivalent"
            continue
        shape = tuple(int(n) for n in item.size)
        entry = TensorEntry(fqn, shape, dtype, [], "dcp")
        whole = Box.whole(shape)
        for chunk in item.chunks:
            offsets, sizes = tuple(int(x) for x in chunk.offsets), tuple(int(x) for x in chunk.sizes)
            if len(offsets) != len(shape) or len(sizes) != len(shape) or not whole.contains(Box(offsets, sizes)):
                raise ManifestError(
                    f"{path}: {fqn!r} has a chunk {list(offsets)}+{list(sizes)} outside its shape {list(shape)}"
                )
            if prod(sizes) == 0:
                continue
            info = info_of(fqn, offsets)
            stored = read_archive(storage, info.relative_path, info.offset, info.length)
            where = f"{fqn!r} (chunk at {list(offsets)} in {info.relative_path})"
            if not isinstance(stored, StoredTensor):
                raise ManifestError(f"{path}: {where} does not hold a tensor but a {type(stored).__name__}")
            if stored.dtype != dtype or stored.shape != sizes:
                raise ManifestError(
                    f"{path}: {where} holds a {stored.dtype} tensor of shape {list(stored.shape)}, "
                    f"the metadata says {dtype} {list(sizes)}"
                )
            if not stored.is_contiguous():
                raise LayoutError(
                    f"{path}: {where} is stored non-contiguously (stride {list(stored.stride)}); "
                    "unickpt reads only row-major chunks (DCP's own writer stores them so)"
                )
            manifest.files[info.relative_path] = files[info.relative_path]
            entry.fragments.append(Fragment(
                file=info.relative_path, offset=stored.offset, shape=sizes,
                pieces=[box_piece(sizes, Box.whole(sizes), Box(offsets, sizes))], crc32c=[],
                block_bytes=itemsize(dtype), rank=writer_rank(info.relative_path) or 0,
            ))
        manifest.tensors[fqn] = entry

    values: dict[str, Any] = {}
    for fqn, _ in value_items:
        info = info_of(fqn, None)
        manifest.files[info.relative_path] = files[info.relative_path]
        try:
            obj = read_archive(storage, info.relative_path, info.offset, info.length)
        except UnsafePickleError as e:
            skipped[fqn] = f"refused by the allow-listing unpickler: {e}"
            continue
        if stored_tensors(obj):
            skipped[fqn] = "a non-tensor item holding tensors"
            continue
        try:
            encode_value(obj, fqn)
        except UnickptError as e:
            skipped[fqn] = str(e)
            continue
        values[fqn] = obj
    for name, value in _regroup(values, paths, tensor_prefixes, skipped).items():
        manifest.values[name] = encode_value(value, name)

    # the saving ranks: the highest writer rank of a file the metadata refers to, plus one
    # (files of a larger earlier save into the same directory may linger: DCP overwrites)
    ranks = [r for f in manifest.files if (r := writer_rank(f)) is not None]
    manifest.world_size = max(ranks, default=0) + 1
    for name in storage.list_files():
        if name.endswith(DATA_SUFFIX) and "/" not in name:
            manifest.files.setdefault(name, storage.size(name))
    version = md.version if isinstance(md.version, str) else None
    manifest.provenance = {"format": "dcp", "version": version, "world_size": manifest.world_size}
    meta = getattr(md, "storage_meta", None)
    if meta is not None and isinstance(getattr(meta, "save_id", None), str):
        manifest.provenance["save_id"] = meta.save_id
    if skipped:
        manifest.provenance["skipped"] = skipped
    return manifest


def _planner_paths(md: Any) -> dict[str, tuple[Any, ...]]:
    """DCP's flattening map (flat name -> object path of str keys and int list positions),
    kept only where it is well formed and agrees with the flat name."""
    data = getattr(md, "planner_data", None)
    out: dict[str, tuple[Any, ...]] = {}
    if not isinstance(data, dict):
        return out
    for k, p in data.items():
        if isinstance(k, str) and isinstance(p, (tuple, list)) and p and all(isinstance(x, str) or _int(x) for x in p) \
                and ".".join(map(str, p)) == k:
            out[k] = tuple(p)
    return out


def _regroup(values: dict[str, Any], paths: dict[str, tuple[Any, ...]], tensor_prefixes: set[tuple[Any, ...]],
             skipped: dict[str, str]) -> dict[str, Any]:
    """Values keyed as unickpt names them: DCP descends lists of dicts (``param_groups.0.lr``);
    unickpt keeps a list that holds no tensor whole (``param_groups``). Items below such a
    list are put back together; where that is impossible they stay under their flat names."""
    out: dict[str, Any] = {}
    groups: dict[tuple[Any, ...], list[tuple[tuple[Any, ...], str]]] = {}
    for fqn in values:
        p = paths.get(fqn)
        cut = next((i for i in range(1, len(p)) if _int(p[i]) and p[:i] not in tensor_prefixes), None) if p else None
        if cut is None:
            out[fqn] = values[fqn]
        else:
            groups.setdefault(p[:cut], []).append((p[cut:], fqn))
    for prefix, members in groups.items():
        name = ".".join(map(str, prefix))
        lost = [skipped[f] for f in skipped if paths.get(f, ())[: len(prefix)] == prefix]
        built = None if lost or name in out else _nest([(rel, values[f]) for rel, f in members])
        if built is None:
            for _, f in members:
                out[f] = values[f]
        else:
            out[name] = built[0]
    return out


def _nest(items: list[tuple[tuple[Any, ...], Any]]) -> tuple[Any] | None:
    """Rebuild one container from (relative path, value) pairs; None when the paths do not
    describe one (gaps in a list, mixed key kinds, a value and a container at one path)."""
    if any(not rel for rel, _ in items):
        return (items[0][1],) if len(items) == 1 else None
    children: dict[Any, list[tuple[tuple[Any, ...], Any]]] = {}
    for rel, v in items:
        children.setdefault(rel[0], []).append((rel[1:], v))
    keys = list(children)
    built = {k: _nest(children[k]) for k in keys}
    if any(b is None for b in built.values()):
        return None
    if all(_int(k) for k in keys):
        if sorted(keys) != list(range(len(keys))):
            return None
        return ([built[i][0] for i in range(len(keys))],)
    if all(isinstance(k, str) for k in keys):
        return ({k: built[k][0] for k in keys},)
    return None
