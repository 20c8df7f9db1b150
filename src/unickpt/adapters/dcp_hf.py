"""Reading the sharded safetensors that DCP's Hugging Face storage writes
(``torch.distributed.checkpoint.HuggingFaceStorageWriter``) in place.

Each rank writes safetensors files (``shard-0000R-model-0000K-of-0000N.safetensors`` with
``save_distributed=True``, else ``model-0000K-of-0000N.safetensors``) holding its chunks of
the tensors; the header's ``__metadata__`` has ``DCP_SHARDING_INFO``: for each tensor its
``saved_offsets`` in the global tensor. The global shape is not stored: like DCP's own
reader, it is the largest ``offset + shape`` over all chunks. Unlike DCP's reader, the
chunks must cover the whole tensor: a save on several ranks without
``save_distributed=True`` makes every rank write the same file name, so one rank's chunks
overwrite the others' — refused with an error naming this, never read as a smaller or
half-filled tensor. A chunk present in several files (a replica) is read from the first
file and the other copies are listed in ``manifest.provenance["replicas"]``.

Consolidated output (``enable_consolidation=True``) and files whose tensors are all whole
(one process) are plain Hugging Face safetensors, read by :mod:`unickpt.adapters.hf`.
"""

from __future__ import annotations

from math import prod
from typing import Any

from ..errors import LayoutError, ManifestError
from ..format.dtypes import itemsize
from ..format.manifest import Fragment, Manifest, TensorEntry
from ..format.values import loads_json
from ..format.safetensors_header import header_tensors, read_header
from ..plan.box import Box, intersect
from ..plan.piece import box_piece
from ..storage.local import LocalStorage
from ..storage.open import open_storage

SHARDING_KEY = "DCP_SHARDING_INFO"
OFFSETS_KEY = "saved_offsets"
INDEX_NAME = "model.safetensors.index.json"


def _header(storage: LocalStorage, name: str) -> tuple[dict[str, Any], int]:
    header, data_start = read_header(storage.reader(name))
    if not isinstance(header, dict):
        raise ManifestError(f"{name}: safetensors header is not a JSON object")
    return header, data_start


def _sharding_info(header: dict[str, Any], name: str) -> dict[str, Any] | None:
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or SHARDING_KEY not in meta:
        return None
    try:
        info = loads_json(meta[SHARDING_KEY])
    except (TypeError, ValueError):
        raise ManifestError(f"{name}: {SHARDING_KEY} is not valid JSON") from None
    if not isinstance(info, dict):
        raise ManifestError(f"{name}: {SHARDING_KEY} is not a JSON object")
    return info


def _files(storage: LocalStorage) -> list[str]:
    return sorted(f for f in storage.names() if f.endswith(".safetensors") and "/" not in f)


def is_dcp_hf(path: str) -> bool:
    """True when ``path`` holds safetensors files written by DCP's Hugging Face storage that
    are sharded: ``DCP_SHARDING_INFO`` with a chunk off the origin or a tensor in several
    files. (Unsharded ones, every tensor whole, are plain Hugging Face files.)"""
    storage = open_storage(path)
    if not storage.root.is_dir():
        return False
    seen: set[str] = set()
    nbytes = 0
    try:
        for name in _files(storage):
            header, _ = _header(storage, name)
            info = _sharding_info(header, name)
            if info is None:
                return False
            for key, v in info.items():
                if key in seen or any(o != 0 for o in (v or {}).get(OFFSETS_KEY, ())):
                    return True
                seen.add(key)
            nbytes += sum(d["data_offsets"][1] - d["data_offsets"][0] for k, d in header.items() if k != "__metadata__")
        return bool(seen) and _index_total(storage) not in (None, nbytes)
    except Exception:  # not readable as safetensors: the Hugging Face reader reports it
        return False
    finally:
        storage.close()


def _index_total(storage: LocalStorage) -> int | None:
    """``metadata.total_size`` of the index DCP's coordinator writes (the bytes of the whole
    save), or None."""
    if not storage.exists(INDEX_NAME):
        return None
    try:
        total = loads_json(storage.read_small(INDEX_NAME)).get("metadata", {}).get("total_size")
    except (ValueError, AttributeError):
        return None
    return total if isinstance(total, int) and not isinstance(total, bool) else None


def read_dcp_hf(path: str) -> Manifest:
    """An in-memory manifest of the DCP Hugging Face storage checkpoint at ``path``."""
    storage = open_storage(path)
    try:
        return _build(storage, str(path))
    finally:
        storage.close()


def _build(storage: LocalStorage, path: str) -> Manifest:
    chunks: dict[str, list[tuple[Box, str, int, str]]] = {}  # name -> (global box, file, byte offset, dtype)
    skipped: dict[str, str] = {}
    replicas: dict[str, str] = {}
    manifest = Manifest()
    for name in _files(storage):
        header, data_start = _header(storage, name)
        info = _sharding_info(header, name)
        if info is None:
            raise ManifestError(f"{path}: {name} has no {SHARDING_KEY}, unlike the other files of this DCP save")
        manifest.files[name] = storage.size(name)
        tensors = header_tensors(header, data_start, manifest.files[name], f"{path}: {name}", ManifestError)
        for key, (dtype, shape, at) in tensors.items():
            try:
                offsets = tuple(int(x) for x in info[key][OFFSETS_KEY])
            except (KeyError, TypeError, ValueError):
                raise ManifestError(f"{path}: {name}: malformed sharding info for {key!r}") from None
            if len(offsets) != len(shape) or any(o < 0 for o in offsets):
                raise ManifestError(f"{path}: {name}: {key!r} has offsets that do not fit its shape")
            chunks.setdefault(key, []).append((Box(offsets, shape), name, at, dtype))
    for key, parts in chunks.items():
        if len({p[3] for p in parts}) != 1 or len({len(p[0].offsets) for p in parts}) != 1:
            raise ManifestError(f"{path}: the chunks of {key!r} disagree on dtype or rank")
        shape = tuple(max(b.offsets[d] + b.lengths[d] for b, *_ in parts) for d in range(len(parts[0][0].offsets)))
        entry = TensorEntry(key, shape, parts[0][3], [], "dcp-hf")
        kept: list[Box] = []
        for box, file, at, dtype in parts:
            if box in kept:
                replicas[f"{key} (copy in {file})"] = "the same chunk as in an earlier file (a replica); read from that file"
                continue
            if any(intersect(box, b) is not None for b in kept):
                raise ManifestError(f"{path}: {key!r} has overlapping chunks of different shapes ({file})")
            kept.append(box)
            if prod(box.lengths):
                entry.fragments.append(Fragment(
                    file=file, offset=at, shape=box.lengths, pieces=[box_piece(box.lengths, Box.whole(box.lengths), box)],
                    crc32c=[], block_bytes=itemsize(dtype), rank=0,
                ))
        covered = sum(prod(b.lengths) for b in kept)
        if covered != prod(shape):
            raise LayoutError(
                f"{path}: {key!r} is incomplete: its chunks cover {covered} of {prod(shape)} elements of shape "
                f"{list(shape)}. A DCP HuggingFaceStorageWriter save on several ranks needs save_distributed=True "
                "(without it every rank writes the same file names and overwrites the others' chunks)"
            )
        manifest.tensors[key] = entry
    total, stored = _index_total(storage), sum(e.nbytes for e in manifest.tensors.values())
    if total is not None and total != stored:
        raise LayoutError(
            f"{path}: holds {stored} bytes of tensors where its {INDEX_NAME} counts {total}: chunks of other "
            "ranks are missing. A DCP HuggingFaceStorageWriter save on several ranks needs save_distributed=True "
            "(without it every rank writes the same file names and overwrites the others' chunks)"
        )
    manifest.provenance = {"format": "dcp-hf"}
    if skipped:
        manifest.provenance["skipped"] = skipped
    if replicas:
        manifest.provenance["replicas"] = replicas
    return manifest
