"""Local (and network-mounted) file system storage: the only module that touches files.

Writes go to pre-sized files with ``pwrite`` from several threads and one ``fsync`` per
file; reads are ``pread`` into caller-owned buffers. Small documents (the manifest) are
committed atomically: temp name, fsync, rename, fsync of the directory.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..errors import CorruptionError, NotACheckpointError


class FileWriter:
    """A file open for positional writes from several threads."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if size:
            os.ftruncate(self._fd, size)

    def pwrite(self, offset: int, data: memoryview | bytes) -> None:
        """Write all of ``data`` at ``offset`` (thread-safe)."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.pwrite(self._fd, view, offset)
            view = view[n:]
            offset += n

    def close(self, durable: bool = True) -> None:
        """Flush to stable storage (when ``durable``) and close."""
        try:
            if durable:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)


class FileReader:
    """A file open for positional reads from several threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptionError(f"data file {path.name} is missing from {path.parent}") from None
        self.size = os.fstat(self._fd).st_size

    def pread_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; a short file is a CorruptionError."""
        view = memoryview(out).cast("B")
        while view.nbytes:
            n = os.preadv(self._fd, [view], offset)
            if n == 0:
                raise CorruptionError(f"{self.path.name} is truncated: no data at byte {offset} (file has {self.size})")
            view = view[n:]
            offset += n

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


class LocalStorage:
    """A checkpoint directory on a local or mounted file system."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._readers: dict[str, FileReader] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def path(self, name: str) -> Path:
        """Absolute path of a file of the checkpoint (the name is validated by the manifest)."""
        return self.root / name

    def prepare(self) -> None:
        """Create the checkpoint directory if needed."""
        self.root.mkdir(parents=True, exist_ok=True)

    def exists(self, name: str) -> bool:
        """True when the file exists."""
        return (self.root / name).exists()

    def size(self, name: str) -> int:
        """Size of a file in bytes; CorruptionError when it is missing."""
        try:
            return (self.root / name).stat().st_size
        except FileNotFoundError:
            raise CorruptionError(f"data file {name} is missing from {self.root}") from None

    def read_small(self, name: str) -> bytes:
        """The whole content of a small file (the manifest)."""
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            raise NotACheckpointError(f"{self.root}: not a committed checkpoint (no {name})") from None
        except NotADirectoryError:
            raise NotACheckpointError(f"{self.root}: not a checkpoint directory") from None

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write a file so that it either exists whole and durable or not at all."""
        tmp = self.root / f".{name}.tmp"
        w = FileWriter(tmp, 0)
        w.pwrite(0, data)
        w.close(durable=True)
        os.replace(tmp, self.root / name)
        self.sync_dir()

    def sync_dir(self) -> None:
        """Make the directory's entries (new and renamed files) durable."""
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def open_writer(self, name: str, size: int) -> FileWriter:
        """Create (or replace) a file of ``size`` bytes for positional writes."""
        return FileWriter(self.root / name, size)

    def reader(self, name: str) -> FileReader:
        """A shared positional reader of a file, opened on first use."""
        with self._lock:
            r = self._readers.get(name)
            if r is None:
                r = self._readers[name] = FileReader(self.root / name)
            return r

    def remove(self, name: str) -> None:
        """Delete a file if present."""
        try:
            (self.root / name).unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Close every open reader."""
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()


def list_subdirs(root: str | os.PathLike) -> list[str]:
    """Names of the directories directly under ``root`` (empty when it does not exist)."""
    try:
        return sorted(e.name for e in os.scandir(root) if e.is_dir())
    except FileNotFoundError:
        return []


def remove_checkpoint(path: str | os.PathLike, manifest_name: str) -> None:
    """Delete a checkpoint directory: the manifest first, so a crash midway leaves an
    uncommitted directory, never a committed checkpoint with missing files."""
    root = Path(path)
    try:
        (root / manifest_name).unlink()
    except FileNotFoundError:
        pass
    for entry in os.scandir(root):
        if entry.is_file() or entry.is_symlink():
            os.unlink(entry.path)
    os.rmdir(root)
