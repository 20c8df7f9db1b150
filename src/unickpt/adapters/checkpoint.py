"""A checkpoint location opened once: its storage and its manifest, native or foreign.

Every command (``load``, ``load_tensor``, ``convert``, ``verify``, ``export``, ``inspect``)
starts with :func:`open_checkpoint`: the path or URL becomes storage in one place
(:func:`unickpt.storage.open.open_storage`), the format is recognised
(:mod:`unickpt.adapters.detect`) and the manifest read or built, and the same storage
serves every read that follows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..format.manifest import Manifest
from ..storage.base import Storage
from ..storage.open import open_storage
from .detect import REGION_FORMATS, open_manifest


@dataclass
class OpenCheckpoint:
    """An open checkpoint: where it is, its storage, its (validated) manifest."""

    location: str
    storage: Storage
    manifest: Manifest
    regions: dict | None = None  # byte regions the format's reader declared while reading (DeepSpeed, legacy Megatron), for the ledger

    @property
    def format(self) -> str:
        """``"unickpt"`` or the foreign format the manifest was built from."""
        return self.manifest.provenance.get("format", "unickpt")

    def close(self) -> None:
        """Release the storage's open readers."""
        self.storage.close()

    def __enter__(self) -> "OpenCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(location: str | os.PathLike | Storage, storage_options: dict[str, Any] | None = None, *,
                    bases: bool = True) -> OpenCheckpoint:
    """Open the checkpoint at ``location`` (a path, a URL, or a Storage already open):
    NotACheckpointError when nothing committed is there, ManifestError when its manifest
    is invalid, CorruptionError when an incremental checkpoint's base is missing or
    replaced (unless ``bases=False``: inspect and verify report it themselves). Close it
    (or use it as a context manager) when done."""
    name = os.fspath(location) if isinstance(location, (str, os.PathLike)) else repr(location)
    storage = open_storage(location, storage_options)
    regions: dict = {}
    try:
        manifest = open_manifest(name, storage, regions, bases=bases)
    except BaseException:
        storage.close()
        raise
    return OpenCheckpoint(name, storage, manifest, regions if manifest.provenance.get("format") in REGION_FORMATS else None)


@contextmanager
def using_checkpoint(src: "str | os.PathLike | OpenCheckpoint", storage_options: dict[str, Any] | None = None, *,
                     bases: bool = True) -> Iterator[OpenCheckpoint]:
    """``src`` as an open checkpoint: used as it is when the caller opened it (and left
    open), else opened here (with ``storage_options``) and closed at the end."""
    if isinstance(src, OpenCheckpoint):
        yield src
        return
    with open_checkpoint(src, storage_options, bases=bases) as ckpt:
        yield ckpt
