"""Which format a checkpoint directory holds, and its manifest whatever the format.

unickpt's own checkpoints have ``manifest.json``. Foreign ones (Megatron-Core
``dist_checkpointing``, PyTorch DCP, DeepSpeed ZeRO and universal, Hugging Face
safetensors) are described by an in-memory manifest that an adapter builds from the
format's own metadata: its fragments point into the foreign files (nothing is copied) and
carry no checksums (``crc32c == []``), so load, convert, export, inspect and verify work on
every format through the same planner.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

from ..errors import CorruptionError, ManifestError, NotACheckpointError
from ..format.index import INDEX_NAME
from ..format.manifest import MANIFEST_NAME, Manifest
from ..storage.base import Storage
from ..storage.local import is_inside
from ..storage.open import is_remote, open_storage
from ..engine.bases import check_bases

# (name, module, detector, reader); detectors are tried in this order (Megatron-Core's
# torch_dist checkpoints are DCP checkpoints with more: it comes first)
FORMATS = [
    ("megatron", "unickpt.adapters.megatron", "is_megatron", "read_megatron"),
    ("megatron-legacy", "unickpt.adapters.megatron_legacy", "is_megatron_legacy", "read_megatron_legacy"),
    ("dcp", "unickpt.adapters.dcp", "is_dcp", "read_dcp"),
    ("deepspeed", "unickpt.adapters.deepspeed", "is_deepspeed", "read_deepspeed"),
    ("dcp-hf", "unickpt.adapters.dcp_hf", "is_dcp_hf", "read_dcp_hf"),  # sharded safetensors of DCP's HF storage
    ("hf", "unickpt.adapters.hf", "is_hf", "read_hf"),
]
# formats whose readers declare the byte regions of the files they read (for the ledger)
REGION_FORMATS = ("deepspeed", "megatron-legacy")


def checkpoint_format(path: str, storage: Storage | None = None, storage_options: dict[str, Any] | None = None) -> str:
    """``"unickpt"``, ``"megatron"``, ``"megatron-legacy"``, ``"dcp"``, ``"deepspeed"``, ``"dcp-hf"`` or ``"hf"``;
    NotACheckpointError otherwise. ``storage``: the location already opened (a native
    checkpoint is recognised through it, on any backend); at a URL (object store) only
    unickpt checkpoints are read, foreign formats from a local directory."""
    storage = storage if storage is not None else open_storage(path, storage_options)
    if is_remote(storage):
        if storage.exists(MANIFEST_NAME):
            return "unickpt"
        raise NotACheckpointError(_no_remote_manifest(path))
    if not os.path.isdir(storage.root):
        raise NotACheckpointError(f"{path}: " + ("not a directory" if os.path.exists(storage.root) else "no such directory"))
    if storage.exists(MANIFEST_NAME):
        return "unickpt"
    if any(f.startswith("rank_") and f.endswith(".safetensors") for f in storage.names()):
        raise NotACheckpointError(f"{path}: not a committed checkpoint (no {MANIFEST_NAME})")
    for name, module, detector, _ in FORMATS:
        if getattr(importlib.import_module(module), detector)(str(storage.root)):
            return name
    newest = _newest_step(str(storage.root))
    if newest is not None:
        raise NotACheckpointError(f"{path}: not a checkpoint but a CheckpointManager's root (`unickpt inspect {path}` "
                                  f"lists its checkpoints): give one of them, e.g. the newest committed, "
                                  f"{os.path.join(path, newest)}")
    raise NotACheckpointError(
        f"{path}: not a checkpoint (no manifest.json of unickpt, no metadata.json of Megatron-Core, "
        "no latest_checkpointed_iteration.txt or mp_rank_*/model_optim_rng.pt of Megatron-LM, "
        "no .metadata of PyTorch DCP, no DeepSpeed model/optimizer states, no Hugging Face *.safetensors)"
    )


def _newest_step(root: str) -> str | None:
    """The newest ``step_N`` directory under ``root`` holding a committed manifest (a
    manager's root), or None."""
    try:
        names = [e.name for e in os.scandir(root) if e.is_dir() and re.fullmatch(r"step_\d+", e.name)]
    except OSError:
        return None
    done = [n for n in names if os.path.isfile(os.path.join(root, n, MANIFEST_NAME))]
    return max(done, key=lambda n: int(n[5:]), default=None)


def _no_remote_manifest(path: str) -> str:
    return (f"{path}: not a committed unickpt checkpoint (no {MANIFEST_NAME}; other formats are read from "
            "local paths only)")


def open_manifest(path: str, storage: Storage | None = None, regions: dict | None = None,
                  storage_options: dict[str, Any] | None = None, *, bases: bool = True) -> Manifest:
    """The manifest of the checkpoint at ``path`` (``storage``: the location already
    opened, else opened with ``storage_options``) in any supported format (validated).
    ``regions``, when given, receives the byte regions a foreign reader declares while it
    reads (DeepSpeed's: the ledger then needs no second pass). For an incremental
    checkpoint, every base it references must still be there (CorruptionError naming the
    missing one) unless ``bases=False``."""
    storage = storage if storage is not None else open_storage(path, storage_options)
    fmt = checkpoint_format(path, storage)
    if fmt == "unickpt":
        manifest = Manifest.from_json(storage.read_small(MANIFEST_NAME),
                                      index=lambda at, n: read_range(storage, INDEX_NAME, at, n))
        if bases and manifest.bases:
            if is_remote(storage):
                raise CorruptionError(f"{path}: an incremental checkpoint (it references bases) on an object store: "
                                      "not supported; save whole checkpoints there")
            check_bases(str(storage.root), manifest)
        return manifest
    _, module, _, reader = next(f for f in FORMATS if f[0] == fmt)
    read = getattr(importlib.import_module(module), reader)
    manifest = read(str(storage.root), regions) if fmt in REGION_FORMATS and regions is not None else read(str(storage.root))
    manifest.provenance.setdefault("format", fmt)
    check_foreign(manifest)
    return manifest


def read_range(storage: Storage, name: str, offset: int, length: int) -> bytes:
    """Bytes ``[offset, offset + length)`` of a checkpoint file (fewer when it is shorter);
    a missing file is a CorruptionError."""
    try:
        reader = storage.reader(name)
    except FileNotFoundError:
        raise CorruptionError(f"{name} is missing from the checkpoint") from None
    buf = bytearray(max(0, min(length, reader.size - offset)))
    if buf:
        reader.pread_into(offset, memoryview(buf))
    return bytes(buf)


def check_relative_path(name: str) -> str:
    """Refuse a file path that is absolute or climbs out of the checkpoint directory."""
    if not is_inside(name):
        raise ManifestError(f"unsafe file path {name!r}: only paths inside the checkpoint are allowed")
    return name


def check_foreign(manifest: Manifest) -> None:
    """Every fragment of an adapter-built manifest names a listed file inside the
    checkpoint and lies within that file."""
    for name in manifest.files:
        check_relative_path(name)
    entries = list(manifest.tensors.values()) + [e for row in manifest.rank_tensors.values() for e in row if e is not None]
    for e in entries:
        for f in e.fragments:
            size = manifest.files.get(f.file)
            if size is None:
                raise ManifestError(f"{e.name!r}: fragment file {f.file!r} is not listed in the checkpoint")
            if f.offset < 0 or f.offset + f.nbytes(e.dtype) > size:
                raise ManifestError(
                    f"{e.name!r}: bytes {f.offset}-{f.offset + f.nbytes(e.dtype)} lie past the end of {f.file} ({size} bytes)"
                )
