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
from .local import fsync_dir, is_inside


def _target(root: str | os.PathLike, name: str) -> Path:
    if not is_inside(name):
        raise SaveError(f"refusing to write {name!r}: only paths inside {root} are allowed")
    return Path(root, *PurePosixPath(name).parts)


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
            fsync_dir(target.parent)
    except BaseException:
        f.close()
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
