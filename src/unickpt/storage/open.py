"""Open a checkpoint location (a path or a URL) as a :class:`~unickpt.storage.base.Storage`.

Every entry point turns its ``path`` argument into storage here, once. A string with a URL
scheme (``scheme://...``) is never taken for a local path: ``file://`` is a local path, other
schemes are object stores and other file systems through fsspec
(:class:`~unickpt.storage.fsspec_store.FsspecStorage`: ``s3://``, ``gs://``, ``az://``,
``memory://`` ...), and a scheme fsspec does not know is a :class:`StorageError`.
"""

from __future__ import annotations

import os
import re
from typing import Any

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
    LocalStorage; any other URL as FsspecStorage with ``storage_options`` (for S3 also
    the environment: ``AWS_ENDPOINT_URL``, credentials); a Storage object is returned as
    it is. A scheme no installed file system knows is a StorageError naming it, never a
    local directory called ``s3:``."""
    if isinstance(location, Storage) and not isinstance(location, (str, os.PathLike)):
        return location
    scheme = url_scheme(location)
    if scheme is None:
        return LocalStorage(location)
    if scheme == "file":
        return LocalStorage(str(location)[len("file://"):])
    from .fsspec_store import FsspecStorage

    return FsspecStorage(str(location), storage_options)


def is_remote(location: str | os.PathLike | Storage) -> bool:
    """True for a location that is not a local path (a URL other than ``file://``, or a
    Storage object other than LocalStorage)."""
    if isinstance(location, (str, os.PathLike)):
        return url_scheme(location) not in (None, "file")
    return not isinstance(location, LocalStorage)


def local_path(location: str | os.PathLike) -> str:
    """A local location as a path (``file://`` stripped)."""
    s = os.fspath(location)
    return s[len("file://"):] if url_scheme(s) == "file" else s


def same_location(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when two locations name the same checkpoint (resolved paths, or equal URLs)."""
    if is_remote(a) or is_remote(b):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return os.path.realpath(local_path(a)) == os.path.realpath(local_path(b))
