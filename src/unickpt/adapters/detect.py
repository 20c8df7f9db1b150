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
from ..errors import CorruptionError, ManifestError, NotACheckpointError
from ..format.index import INDEX_NAME
from ..format.manifest import MANIFEST_NAME, Manifest
from ..storage.local import LocalStorage, is_inside

# (name, module, detector, reader); detectors are tried in this order (Megatron-Core's
# torch_dist checkpoints are DCP checkpoints with more: it comes first)
FORMATS = [
    ("megatron", "unickpt.adapters.megatron", "is_megatron", "read_megatron"),
    ("dcp", "unickpt.adapters.dcp", "is_dcp", "read_dcp"),
    ("deepspeed", "unickpt.adapters.deepspeed", "is_deepspeed", "read_deepspeed"),
    ("dcp-hf", "unickpt.adapters.dcp_hf", "is_dcp_hf", "read_dcp_hf"),  # sharded safetensors of DCP's HF storage
    ("hf", "unickpt.adapters.hf", "is_hf", "read_hf"),
]


def checkpoint_format(path: str) -> str:
    """``"unickpt"``, ``"megatron"``, ``"dcp"``, ``"deepspeed"``, ``"dcp-hf"`` or ``"hf"``;
    NotACheckpointError otherwise."""
    if not os.path.isdir(path):
        raise NotACheckpointError(f"{path}: " + ("not a directory" if os.path.exists(path) else "no such directory"))
    storage = LocalStorage(path)
    if storage.exists(MANIFEST_NAME):
        return "unickpt"
    if any(f.startswith("rank_") and f.endswith(".safetensors") for f in storage.names()):
        raise NotACheckpointError(f"{path}: not a committed checkpoint (no {MANIFEST_NAME})")
    for name, module, detector, _ in FORMATS:
        if getattr(importlib.import_module(module), detector)(str(path)):
            return name
    raise NotACheckpointError(
        f"{path}: not a checkpoint (no manifest.json of unickpt, no metadata.json of Megatron-Core, "
        "no .metadata of PyTorch DCP, no DeepSpeed model/optimizer states, no Hugging Face *.safetensors)"
    )


def open_manifest(path: str) -> Manifest:
    """The manifest of the checkpoint at ``path`` in any supported format (validated)."""
    fmt = checkpoint_format(path)
    if fmt == "unickpt":
        storage = LocalStorage(path)
        return Manifest.from_json(storage.read_small(MANIFEST_NAME), index=lambda at, n: read_range(storage, INDEX_NAME, at, n))
    _, module, _, reader = next(f for f in FORMATS if f[0] == fmt)
    manifest = getattr(importlib.import_module(module), reader)(str(path))
    manifest.provenance.setdefault("format", fmt)
    check_foreign(manifest)
    return manifest


def read_range(storage: LocalStorage, name: str, offset: int, length: int) -> bytes:
    """Bytes ``[offset, offset + length)`` of a checkpoint file (fewer when it is shorter);
    a missing file is a CorruptionError."""
    try:
        fd = os.open(storage.path(name), os.O_RDONLY)
    except FileNotFoundError:
        raise CorruptionError(f"{name} is missing from {storage.root}") from None
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


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
