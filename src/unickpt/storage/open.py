"""Open a checkpoint location (a path or a URL) as a :class:`~unickpt.storage.base.Storage`.

Every entry point turns its ``path`` argument into storage here, once. A string with a URL
scheme (``scheme://...``) is never taken for a local path: ``file://`` is a local path, other
schemes need a backend that knows them, and an unknown scheme is a :class:`StorageError`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import StorageError
from .base import Storage
from .local import LocalStorage

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(location: str | os.PathLike) -> str | None:
    """The URL scheme of ``location`` (``"s3"`` for ``s3://b/k``), None for a plain path."""
    if not isinstance(location, str):
        return None
    m = _URL.match(location)
    return m.group(1).lower() if m else None


def open_storage(location: str | os.PathLike | Storage, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage of a checkpoint location: a local path (or ``file://`` URL) as
    LocalStorage; a Storage object is returned as it is. Any other scheme is a
    StorageError naming it, never a local directory called ``s3:``."""
    if isinstance(location, Storage) and not isinstance(location, (str, os.PathLike)):
        return location
    scheme = url_scheme(location)
    if scheme is None:
        return LocalStorage(location)
    if scheme == "file":
        return LocalStorage(str(location)[len("file://"):])
    raise StorageError(f"{location}: unsupported storage URL scheme {scheme!r} (supported: local paths, file://)")
