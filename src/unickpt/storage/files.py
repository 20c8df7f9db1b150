"""Many whole files written below a root directory and made durable together, for writers
of other tools' formats (DeepSpeed's universal checkpoint: one ``torch.save`` file per
parameter state).

A file appears under its final name only complete: it is written under a temporary name
in the same directory and renamed. Subdirectories are created as needed; names may
contain ``/`` but may not leave the root. Durability comes once for all of them
(:meth:`DurableBatch.commit`), before the writer commits its own marker.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, TypeVar

from ..errors import SaveError
from .local import create_file, fsync_path, is_inside, named_os_error, start_writeback, write_direct


def _target(root: str | os.PathLike, name: str) -> Path:
    if not is_inside(name):
        raise SaveError(f"refusing to write {name!r}: only paths inside {root} are allowed")
    return Path(root, *PurePosixPath(name).parts)


class DurableBatch:
    """Many whole files below ``root``, made durable together by :meth:`commit`.

    Each file is written under a temporary name and renamed when its ``with`` block ends
    (so a file under its final name is always complete), and the kernel starts writing it
    back at once; ``commit`` then fsyncs every file and every directory written, from
    ``threads`` threads. One fsync per file, back to back, costs a journal commit each
    (1.5 s of 3 s for a 231-file DeepSpeed universal checkpoint here); together they
    overlap. Until ``commit`` returns nothing is durable: a writer commits its own marker
    after it.
    """

    def __init__(self, root: str | os.PathLike, threads: int = 8) -> None:
        self.root = Path(root)
        self.threads = max(1, threads)
        self._files: list[Path] = []
        self._dirs: set[Path] = set()
        self._lock = threading.Lock()

    @contextmanager
    def file(self, name: str) -> Iterator[BinaryIO]:
        """A binary file object for ``root/name``, renamed into place when the block ends
        without an exception (and removed otherwise)."""
        with self._renamed_into_place(name) as tmp:
            f = os.fdopen(create_file(tmp), "wb")
            try:
                yield f
                f.flush()
                start_writeback(f.fileno(), 0, f.tell())
            finally:
                f.close()

    def write_whole(self, name: str, image: memoryview, size: int) -> None:
        """Write ``root/name`` whole from ``image[:size]`` (page-aligned memory of ``size``
        rounded up to 4096 bytes), renamed into place when complete: with ``O_DIRECT``
        where the file system takes it, straight from this memory to the disk (no copy
        into the page cache, which on a loaded machine costs more CPU than everything
        else a conversion does; see docs/PERFORMANCE.md), else with ordinary writes."""
        with self._renamed_into_place(name) as tmp:
            fd = create_file(tmp, direct=True)
            try:
                write_direct(fd, image, size)
            except BaseException:
                with suppress(OSError):
                    os.close(fd)
                raise
            os.close(fd)

    @contextmanager
    def _renamed_into_place(self, name: str) -> Iterator[Path]:
        """A fresh temporary path beside ``root/name``: renamed to it (and recorded for
        :meth:`commit`) when the block ends without an exception, removed otherwise."""
        target = _target(self.root, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
        try:
            yield tmp
            os.replace(tmp, target)
        except BaseException as e:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(e, OSError):  # a full disk: named with the file being written
                raise named_os_error(e, target) from None
            raise
        with self._lock:
            self._files.append(target)
            self._dirs.update(_parents_below(target.parent, self.root))

    def commit(self) -> None:
        """Make every file written so far, and its name, durable."""
        with self._lock:
            files, dirs = self._files, sorted(self._dirs)
            self._files, self._dirs = [], set()
        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            list(pool.map(fsync_path, files + dirs))


def _parents_below(directory: Path, root: Path) -> list[Path]:
    """``directory`` and each parent up to and including ``root`` (new subdirectories'
    own entries live in their parents)."""
    out = [directory]
    while directory != root and directory.parent != directory:
        directory = directory.parent
        out.append(directory)
    return out



def _entries(root: Path) -> dict[Path, tuple[int, int]]:
    """Every path below ``root`` (not following links) and its identity (device, inode)."""
    out: dict[Path, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            out[p] = (st.st_dev, st.st_ino)
    return out


@contextmanager
def removed_on_failure(root: str | os.PathLike) -> Iterator[None]:
    """When the block raises, remove what it left below ``root``: every file and
    directory that is new, or replaced by a new one (a partial output), and ``root``
    itself when the block created it. What was there before and untouched stays; a
    directory that existed before is never removed."""
    root = Path(root)
    existed = os.path.lexists(root)
    before = _entries(root) if existed and root.is_dir() else {}
    try:
        yield
    except BaseException:
        if not existed:
            shutil.rmtree(root, ignore_errors=True)
        elif root.is_dir() and not root.is_symlink():
            after = _entries(root)
            for p in sorted(after, key=lambda q: len(q.parts), reverse=True):
                if before.get(p) == after[p]:
                    continue
                try:
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        os.unlink(p)
                except OSError:
                    pass
        raise


F = TypeVar("F", bound=Callable[..., Any])


def cleans_up_output(fn: F) -> F:
    """Decorate a writer ``fn(src, dst, ...)`` so that a failure removes the partial
    output it left in ``dst`` (:func:`removed_on_failure`)."""

    @functools.wraps(fn)
    def run(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
        from .open import is_remote

        if is_remote(dst):  # an object store: the writer removes its partial files itself
            return fn(src, dst, *args, **kwargs)
        with removed_on_failure(dst):
            return fn(src, dst, *args, **kwargs)

    return run  # type: ignore[return-value]
