"""Whole files written atomically below a root directory, for writers of other tools' formats
(DeepSpeed's universal checkpoint: one ``torch.save`` file per parameter state).

A file either exists whole and durable under its final name or not at all: it is written
under a temporary name in the same directory, flushed and fsynced, renamed, and the
directory fsynced. Subdirectories are created as needed; names may contain ``/`` but may
not leave the root.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from ..errors import SaveError


def _target(root: str | os.PathLike, name: str) -> Path:
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name or "\x00" in name:
        raise SaveError(f"refusing to write {name!r}: only paths inside {root} are allowed")
    return Path(root, *p.parts)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(root: str | os.PathLike, name: str, durable: bool = True) -> Iterator[BinaryIO]:
    """A binary file object for ``root/name``; the file appears under its name, durable,
    only when the ``with`` block ends without an exception."""
    target = _target(root, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    f = open(tmp, "wb")
    try:
        yield f
        f.flush()
        if durable:
            os.fsync(f.fileno())
        f.close()
        os.replace(tmp, target)
        if durable:
            _fsync_dir(target.parent)
    except BaseException:
        f.close()
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_file_atomic(root: str | os.PathLike, name: str, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``root/name`` atomically (see :func:`atomic_file`)."""
    with atomic_file(root, name, durable) as f:
        f.write(data)


def sync_tree(root: str | os.PathLike) -> None:
    """fsync every directory below ``root`` (and ``root``): makes new entries durable."""
    for dirpath, _, _ in os.walk(root):
        _fsync_dir(Path(dirpath))
