"""Reading Megatron-Core ``dist_checkpointing`` directories (the ``torch_dist`` backend) in place.

Megatron-Core's ``dist_checkpointing.save`` writes:

- ``metadata.json``: the backends (``{"sharded_backend": "torch_dist", ...}``);
- a PyTorch DCP checkpoint (``.metadata`` + ``__{rank}_{k}.distcp``) of its ShardedTensors:
  column/row-parallel slices, stacked layers (``prepend_axis_num``), the distributed
  optimizer's flat per-DP-rank buffers (1-D chunks of uneven length) — each one chunk of a
  global tensor, written once whatever its replica id (only replica 0 is saved) — and its
  ShardedObjects as byte items (``key/shard_...``). Its ``.metadata`` also carries every
  rank's DCP ``SavePlan`` (``all_local_plans``): read as inert records (data), never built;
- ``common.pt``: the state every rank shares, one ``torch.save`` archive.

The DCP part is read by :mod:`unickpt.adapters.dcp` (so it reshards onto any layout, as DCP
checkpoints do). ``common.pt`` goes through the allow-listing unpickler with unknown classes
kept as inert records: each leaf of its nested dicts becomes a tensor (a fragment pointing
into ``common.pt``), a plain value, or an entry of ``manifest.provenance["skipped"]`` saying
why not (an ``argparse.Namespace`` of training args, a NumPy array...).

Megatron-Core up to 0.15 also saved ``flattened_range`` ShardedTensors (the distributed
optimizer's per-DP-rank flat slices of a TP chunk): a global ``[X, Y, Z]`` tensor cut into
``[x, y, z]`` chunks was stored as a ``[X/x, Y/y, Z/z, x*y*z]`` DCP tensor whose last axis
each DP rank wrote a range of, and ``.metadata`` (an ``MCoreMetadata``) kept the original
shape in ``mcore_data``. Such a tensor is read back as the original tensor: each stored
chunk is the flat range ``[start, stop)`` of one ``[x, y, z]`` box, which unickpt's plan
layer addresses directly (flat pieces), so it reshards like any other tensor.
The ``zarr`` backend is refused with an error naming it.
"""

from __future__ import annotations

from math import prod
from typing import Any

from ..errors import ManifestError, UnickptError, UnsafePickleError
from ..format.dtypes import itemsize
from ..format.manifest import Fragment, Manifest, TensorEntry
from ..format.values import encode_value, loads_json
from ..plan.box import Box
from ..plan.piece import flat_pieces, whole_piece
from ..storage.local import LocalStorage
from ..storage.open import open_storage
from .dcp import METADATA_NAME, read_dcp, read_metadata
from .torch_archive import InertRecord, StoredTensor, read_archive, records_in, stored_tensors

CONFIG_NAME = "metadata.json"
COMMON_NAME = "common.pt"


def read_config(path: str) -> dict[str, Any] | None:
    """The parsed ``metadata.json`` of a Megatron-Core checkpoint at ``path``, or None when
    there is none or it is not Megatron-Core's (no ``sharded_backend``)."""
    storage = open_storage(path)
    if not storage.root.is_dir() or not (storage.root / CONFIG_NAME).is_file():
        return None
    try:
        config = loads_json(storage.read_small(CONFIG_NAME))
    except (ValueError, UnicodeDecodeError):
        return None
    return config if isinstance(config, dict) and "sharded_backend" in config else None


def is_megatron(path: str) -> bool:
    """True when ``path`` is a Megatron-Core ``dist_checkpointing`` directory (any backend:
    the reader names the ones it refuses)."""
    return read_config(path) is not None


def read_megatron(path: str) -> Manifest:
    """An in-memory manifest of the Megatron-Core ``torch_dist`` checkpoint at ``path``
    (see the module docstring)."""
    config = read_config(path)
    if config is None:
        raise ManifestError(f"{path}: no Megatron-Core {CONFIG_NAME}")
    backend = config.get("sharded_backend")
    if backend != "torch_dist":
        raise UnickptError(
            f"{path}: Megatron-Core dist_checkpointing backend {backend!r} is not supported "
            "(unickpt reads the torch_dist backend, Megatron-Core's default)"
        )
    storage = open_storage(path)
    if not storage.exists(METADATA_NAME):
        raise ManifestError(f"{path}: a Megatron-Core torch_dist checkpoint without its DCP {METADATA_NAME}")
    md = read_metadata(path)
    manifest = read_dcp(path, md)
    mcore_data = getattr(md, "mcore_data", None)
    if isinstance(mcore_data, dict):
        _unflatten(manifest, mcore_data, path)
    skipped: dict[str, str] = dict(manifest.provenance.get("skipped", {}))
    try:
        if storage.exists(COMMON_NAME):
            _add_common(storage, manifest, skipped)
        for name in (CONFIG_NAME, COMMON_NAME):
            if storage.exists(name):
                manifest.files.setdefault(name, storage.size(name))
    finally:
        storage.close()
    manifest.provenance = {
        **{k: v for k, v in manifest.provenance.items() if k != "skipped"},
        "format": "megatron",
        "dcp_version": manifest.provenance.get("version"),
        "version": config.get("sharded_backend_version"),
        "sharded_backend": backend,
        "common_backend": config.get("common_backend"),
    }
    if skipped:
        manifest.provenance["skipped"] = skipped
    return manifest


def _unflatten(manifest: Manifest, mcore_data: dict[Any, Any], path: str) -> None:
    """Tensors saved with ``flattened_range`` (``nd_reformulated_orig_global_shape`` in
    ``mcore_data``) as their original global tensors, each chunk a flat range of a box."""
    for key, data in mcore_data.items():
        shape = data.get("nd_reformulated_orig_global_shape") if isinstance(data, dict) else None
        entry = manifest.tensors.get(key) if isinstance(key, str) else None
        if shape is None or entry is None:
            continue
        where = f"{path}: {key!r} (saved with flattened_range)"
        if not isinstance(shape, (tuple, list)) or not all(isinstance(n, int) and n > 0 for n in shape):
            raise ManifestError(f"{where}: malformed original shape {shape!r:.80}")
        grid, chunk = entry.shape[:-1], entry.shape[-1] if entry.shape else 0
        if len(grid) != len(shape) or any(g <= 0 or n % g for n, g in zip(shape, grid)) \
                or prod(n // g for n, g in zip(shape, grid)) != chunk:
            raise ManifestError(f"{where}: stored shape {list(entry.shape)} does not reformulate {list(shape)}")
        local = tuple(n // g for n, g in zip(shape, grid))
        flat = TensorEntry(key, tuple(shape), entry.dtype, [], "megatron-flat")
        for f in entry.fragments:
            box = f.pieces[0].global_box if len(f.pieces) == 1 else None
            if box is None or any(n != 1 for n in box.lengths[:-1]):
                raise ManifestError(f"{where}: a chunk that is not one flat range ({f.file})")
            start, stop = box.offsets[-1], box.offsets[-1] + box.lengths[-1]
            cell = Box(tuple(o * n for o, n in zip(box.offsets[:-1], local)), local)
            flat.fragments.append(Fragment(
                file=f.file, offset=f.offset, shape=(stop - start,), pieces=flat_pieces(cell, start, stop), crc32c=[],
                block_bytes=f.block_bytes, rank=f.rank,
            ))
        manifest.tensors[key] = flat


def _add_common(storage: LocalStorage, manifest: Manifest, skipped: dict[str, str]) -> None:
    """Tensors, values and skipped entries of ``common.pt``, one per leaf of its dicts."""
    try:
        common = read_archive(storage, COMMON_NAME, unknown_as_records=True)
    except UnsafePickleError as e:  # a malformed storage record: nothing of the file is read
        skipped[COMMON_NAME] = f"refused by the allow-listing unpickler: {e}"
        return
    if not isinstance(common, dict):
        skipped[COMMON_NAME] = f"holds a {type(common).__name__}, not a dict of state"
        return
    manifest.files[COMMON_NAME] = storage.size(COMMON_NAME)
    for name, value in _leaves(common, ""):
        if name in manifest.tensors or name in manifest.values:
            skipped[f"{COMMON_NAME}:{name}"] = "its name is also a sharded item of the checkpoint"
        elif isinstance(value, StoredTensor):
            reason = _add_tensor(manifest, name, value)
            if reason:
                skipped[name] = reason
        elif records := records_in(value):
            kinds = sorted({r.global_name for r in records})
            skipped[name] = f"holds objects of {', '.join(kinds)}, which the allow-listing unpickler does not build"
        elif stored_tensors(value):
            skipped[name] = "tensors inside a container that is not a dict or list"
        else:
            try:
                manifest.values[name] = encode_value(value, name)
            except UnickptError as e:
                skipped[name] = str(e)


def _leaves(obj: Any, prefix: str) -> list[tuple[str, Any]]:
    """(dotted name, value) of the leaves of nested str-keyed dicts; lists are descended
    (``name.0``) only when they hold tensors, else kept whole as values."""
    out: list[tuple[str, Any]] = []
    if isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj):
        for k, v in obj.items():
            out.extend(_leaves(v, f"{prefix}.{k}" if prefix else k))
    elif isinstance(obj, (list, tuple)) and prefix and stored_tensors(obj) and not isinstance(obj, InertRecord):
        for i, v in enumerate(obj):
            out.extend(_leaves(v, f"{prefix}.{i}"))
    else:
        out.append((prefix, obj))
    return out


def _add_tensor(manifest: Manifest, name: str, t: StoredTensor) -> str | None:
    """A whole tensor of ``common.pt`` as a manifest entry; the reason when it cannot be."""
    if not t.is_contiguous():
        return f"stored non-contiguously in {COMMON_NAME} (stride {list(t.stride)})"
    entry = TensorEntry(name, t.shape, t.dtype, [], "megatron-common")
    if t.numel:
        entry.fragments.append(Fragment(
            file=COMMON_NAME, offset=t.offset, shape=t.shape, pieces=[whole_piece(t.shape)], crc32c=[],
            block_bytes=itemsize(t.dtype), rank=0,
        ))
    manifest.tensors[name] = entry
    return None

