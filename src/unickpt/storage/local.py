"""Local (and network-mounted) file system storage: the only module that touches files.

Writes go to pre-sized files with ``pwrite`` from several threads and one ``fsync`` per
file; on Linux each large write also starts the kernel's writeback of its range at once
(``sync_file_range``), so the disk works while later chunks are still being copied and the
final ``fsync`` has little left to flush (about 1.5x faster than write-then-fsync here,
see docs/PERFORMANCE.md). Reads are ``preadv`` straight into caller-owned buffers
(several buffers per call: scatter reads into target tensors). Small documents (the
manifest) are committed atomically: temp name, fsync, rename, fsync of the directory.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import mmap
import os
import re
import secrets
import stat
import sys
import threading
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from ..errors import CorruptionError, NotACheckpointError, StorageError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
IOV_MAX = 1024
EARLY_WRITEBACK_MIN = 1 << 20
_SYNC_FILE_RANGE_WRITE = 2


def libc_function(name: str, argtypes: list[Any]) -> Any:
    """The Linux C library's ``name`` (returning int, errno kept), or None elsewhere or
    when this libc lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = libc_function("sync_file_range", [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint])


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a dirty range to disk now, without waiting (Linux;
    a no-op elsewhere). Durability still comes from the final fsync."""
    if _sync_file_range is not None and nbytes >= EARLY_WRITEBACK_MIN:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def fsync_path(path: str | os.PathLike) -> None:
    """Make a file's data, or a directory's entries (new and renamed files), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_inside(name: str) -> bool:
    """True for a relative ``/``-separated path that stays inside its root directory."""
    p = PurePosixPath(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts and "\\" not in name and "\x00" not in name


def create_file(path: str | os.PathLike, direct: bool = False) -> int:
    """Create ``path`` as a new, empty file and return a descriptor open for writing.
    Whatever held the name before (a file, a symbolic link planted there) is replaced,
    never written through. ``direct``: opened with ``O_DIRECT`` where the platform has it
    (the file system may still refuse it: :func:`write_direct` falls back)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return _create(path, flags | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this file system does not do O_DIRECT
                raise
    return _create(path, flags)


def _create(path: str | os.PathLike, flags: int) -> int:
    try:
        return os.open(path, flags, 0o644)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, flags, 0o644)


DIRECT_ALIGNMENT = 4096  # what O_DIRECT asks of memory addresses, file offsets and lengths
_DIRECT_CHUNK = 1 << 30


def write_direct(fd: int, image: memoryview, size: int) -> None:
    """Write ``image[:size]`` at offset 0 of the new file ``fd`` (see :func:`create_file`).
    With ``O_DIRECT`` (``image`` page-aligned memory of ``size`` rounded up to
    :data:`DIRECT_ALIGNMENT` bytes) the bytes go from this memory to the disk: no copy into
    the page cache, nothing left to write back at the ``fsync``; the rounding is truncated
    away. Where the descriptor is not direct, or the file system refuses a direct write,
    ordinary writes (their writeback started at once)."""
    view = memoryview(image).cast("B")
    if _is_direct(fd):
        whole = -(-size // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT
        try:
            _pwrite_all(fd, view[:whole], 0)
            os.ftruncate(fd, size)
            return
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.ftruncate(fd, 0)
    _pwrite_all(fd, view[:size], 0)
    start_writeback(fd, 0, size)


def _is_direct(fd: int) -> bool:
    return hasattr(os, "O_DIRECT") and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    at = 0
    while at < view.nbytes:
        at += os.pwrite(fd, view[at : at + _DIRECT_CHUNK], offset + at)


def named_os_error(e: OSError, path: Path | str) -> OSError:
    """``e`` carrying ``path`` as its file name (when it names none)."""
    return e if e.filename is not None else OSError(e.errno, e.strerror, os.path.normpath(path))


class FileWriter:
    """A new file open for positional writes from several threads (see :func:`create_file`)."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self._fd = create_file(path)
        if size:
            try:
                os.ftruncate(self._fd, size)
            except BaseException as e:
                os.close(self._fd)
                if isinstance(e, OSError):
                    raise named_os_error(e, path) from None
                raise

    def pwrite(self, offset: int, data: memoryview | bytes) -> None:
        """Write all of ``data`` at ``offset`` (thread-safe) and start its writeback."""
        view = memoryview(data).cast("B")
        try:
            _pwrite_all(self._fd, view, offset)
        except OSError as e:  # a full disk: named with its file, as open() names one it cannot create
            raise named_os_error(e, self.path) from None
        start_writeback(self._fd, offset, view.nbytes)

    def close(self, durable: bool = True) -> None:
        """Flush to stable storage (when ``durable``) and close (once: later calls do nothing)."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            if durable:
                os.fsync(fd)
        except OSError as e:
            raise named_os_error(e, self.path) from None
        finally:
            os.close(fd)


def open_regular(path: Path) -> int:
    """A descriptor of the regular file ``path`` open for reading. IsADirectoryError (with
    the path, saying what it is) when it is a directory, a pipe or a device: opened without
    blocking (a pipe would wait for a writer), refused before any read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = "a directory" if stat.S_ISDIR(mode) else "a pipe, socket or device"
            raise IsADirectoryError(errno.EISDIR, f"is {what}, not a regular file", str(path))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_data_file(path: Path) -> int:
    """A descriptor of ``path`` open for reading; a missing file, or one that is not a
    regular file (a directory), is a CorruptionError naming it."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise CorruptionError(f"data file {path.name} is missing from {path.parent}") from None
    except IsADirectoryError as e:
        raise CorruptionError(f"data file {path.name} of {path.parent} {e.strerror}") from None


class FileReader:
    """A file open for positional reads from several threads. ``piece_bytes``: a group of
    at least two pieces with checksums is read a piece at a time, each piece checked while
    it is still in the cache (:func:`unickpt.engine.reads.read_group`)."""

    piece_bytes = 1 << 20

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = _open_data_file(path)
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

    def preadv_into(self, offset: int, views: list[memoryview]) -> None:
        """Fill the buffers ``views`` one after the other with the bytes from ``offset`` on
        (one scatter read per ``IOV_MAX`` buffers, retried on short reads)."""
        pending = [memoryview(v).cast("B") for v in views]
        pending = [v for v in pending if v.nbytes]
        while pending:
            batch = pending[:IOV_MAX]
            n = os.preadv(self._fd, batch, offset)
            if n == 0:
                raise CorruptionError(f"{self.path.name} is truncated: no data at byte {offset} (file has {self.size})")
            offset += n
            while n and pending:
                head = pending[0]
                if n >= head.nbytes:
                    n -= head.nbytes
                    pending.pop(0)
                else:
                    pending[0] = head[n:]
                    n = 0

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


class MappedReader:
    """A file held in memory (tmpfs, a snapshot's shm root) read by copying out of a
    shared read-only map of it: a plain ``memcpy`` with the GIL released, its pages mapped
    by one ``madvise`` per read; about 1.3x as fast as ``preadv`` where the file system
    keeps huge pages, slower where it does not (:func:`memory_file_reader` chooses).
    ``piece_bytes`` asks :mod:`unickpt.engine.reads` to copy and check a group a piece at
    a time, while the piece is still in the cache. The file must not be truncated while
    it is mapped (touching the lost pages would raise SIGBUS); removing it is fine."""

    piece_bytes = 1 << 20
    _can_populate = hasattr(mmap.mmap, "madvise")

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = _open_data_file(path)
        try:
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if self.size else None
        finally:
            os.close(fd)
        self._bytes = np.frombuffer(self._map, np.uint8) if self._map is not None else None  # read-only: its address
        self._base = self._bytes.ctypes.data if self._bytes is not None else 0

    def pread_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; past the end is a CorruptionError."""
        self.preadv_into(offset, [out])

    def preadv_into(self, offset: int, views: list[memoryview]) -> None:
        """Fill the buffers ``views`` one after the other with the bytes from ``offset`` on."""
        views = [memoryview(v).cast("B") for v in views]
        end = offset + sum(v.nbytes for v in views)
        if end > self.size:
            raise CorruptionError(f"{self.path.name} is truncated: no data at byte {max(offset, self.size)} (file has {self.size})")
        self._populate(offset, end)
        for v in views:
            if v.nbytes:
                _memmove(_address(v), self._base + offset, v.nbytes)
            offset += v.nbytes

    def _populate(self, start: int, end: int) -> None:
        """Map the pages of bytes ``[start, end)`` in one call (``MADV_POPULATE_READ``,
        Linux >= 5.14) rather than one page fault per 4 KiB page; skipped where the kernel
        lacks it (the copy then faults them in)."""
        if not MappedReader._can_populate or end <= start:
            return
        lo = start - start % mmap.PAGESIZE
        try:
            self._map.madvise(_MADV_POPULATE_READ, lo, end - lo)
        except OSError:
            MappedReader._can_populate = False

    def close(self) -> None:
        """Unmap the file."""
        if self._map is not None:
            self._bytes = None
            self._map.close()
            self._map = None


HUGE_PAGE = 2 << 20


def memory_file_reader(path: Path) -> "FileReader | MappedReader":
    """The faster reader of a file held in memory (tmpfs): a :class:`MappedReader` where
    the file system backs the file with huge pages (tmpfs then reports a huge page as
    the file's ``st_blksize``), a :class:`FileReader` otherwise: with 4 KiB pages,
    mapping them from the load's threads at once contends in the process's page tables
    and runs ~1.5x slower than ``preadv`` (docs/PERFORMANCE.md)."""
    try:
        huge = os.stat(path).st_blksize >= HUGE_PAGE
    except FileNotFoundError:
        huge = False  # FileReader names the missing file
    return MappedReader(path) if huge else FileReader(path)


def _address(view: memoryview) -> int:
    """The address of the first byte of a writable buffer."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


_memmove = ctypes.memmove  # a foreign call: the GIL is released while it copies
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


class RangeFile(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a file as a read-only, seekable file object
    (positional reads: several may share one ``FileReader``). Lets a parser that wants a
    file (``zipfile``) read one archive stored inside a larger file."""

    def __init__(self, reader: FileReader, start: int, length: int) -> None:
        if start < 0 or length < 0 or start + length > reader.size:
            raise CorruptionError(
                f"{reader.path.name} is truncated: bytes {start}-{start + length} are past its end ({reader.size} bytes)"
            )
        self._reader, self._start, self._length, self._pos = reader, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b) -> int:  # type: ignore[override]
        n = max(0, min(len(b), self._length - self._pos))
        if n:
            self._reader.pread_into(self._start + self._pos, memoryview(b)[:n])
            self._pos += n
        return n


class LocalStorage:
    """A checkpoint directory on a local or mounted file system."""

    def __init__(self, root: str | os.PathLike) -> None:
        if isinstance(root, str) and _URL.match(root):
            raise StorageError(f"{root}: a URL is not a local path (open it with unickpt.storage.open.open_storage)")
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
        """The whole content of a small file (the manifest); NotACheckpointError when it is
        missing or not a regular file (a directory)."""
        try:
            fd = open_regular(self.root / name)
        except FileNotFoundError:
            raise NotACheckpointError(f"{self.root}: not a committed checkpoint (no {name})") from None
        except NotADirectoryError:
            raise NotACheckpointError(f"{self.root}: not a checkpoint directory") from None
        except IsADirectoryError as e:
            raise NotACheckpointError(f"{self.root}: not a committed checkpoint ({name} {e.strerror})") from None
        with open(fd, "rb") as f:
            return f.read()

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write a file so that it either exists whole and durable or not at all: under
        a fresh temporary name (unique to this call), renamed over ``name`` (which
        replaces a link there, never follows it)."""
        tmp = self.root / f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            w = FileWriter(tmp, 0)
            try:
                w.pwrite(0, data)
            finally:
                w.close(durable=True)
            os.replace(tmp, self.root / name)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        self.sync_dir()

    def sync_dir(self) -> None:
        """Make the directory's entries (new and renamed files) durable."""
        fsync_path(self.root)

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

    def open_range(self, name: str, start: int = 0, length: int | None = None) -> RangeFile:
        """A file object over bytes ``[start, start + length)`` of a file (to its end when
        ``length`` is None)."""
        r = self.reader(name)
        return RangeFile(r, start, r.size - start if length is None else length)

    def map_range(self, name: str, offset: int, nbytes: int) -> tuple[mmap.mmap, int]:
        """A private (copy-on-write) memory map holding bytes ``[offset, offset + nbytes)``
        of a file, and where they start in it. Nothing is read until the pages are touched,
        and writes to the map stay in this process. A file shorter than the range is a
        CorruptionError (a file truncated later makes touching its pages fail with SIGBUS,
        as with any mapped file)."""
        r = self.reader(name)
        if offset + nbytes > r.size:
            raise CorruptionError(f"{name} is truncated: bytes {offset}-{offset + nbytes} asked, the file has {r.size}")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        with open(r.path, "rb") as f:
            m = mmap.mmap(f.fileno(), offset + nbytes - start, access=mmap.ACCESS_COPY, offset=start)
        return m, offset - start

    def names(self) -> list[str]:
        """Names of the entries directly in the checkpoint directory (empty when it is not a directory)."""
        try:
            return sorted(os.listdir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_files(self, under: str = "") -> list[str]:
        """Relative paths (``/``-separated) of the regular files below ``under``, sorted."""
        base = self.root / under if under else self.root
        out = []
        for dirpath, _, files in os.walk(base):
            rel = Path(dirpath).relative_to(self.root)
            out.extend(str(rel / f) if str(rel) != "." else f for f in files)
        return sorted(out)

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


def remove_checkpoint(path: str | os.PathLike, manifest_name: str, after_unlink: Any = None) -> None:
    """Delete a checkpoint directory: the manifest first, so a crash midway leaves an
    uncommitted directory, never a committed checkpoint with missing files; then its
    files, then the directory. ``after_unlink()``, if given, is called after each file
    removed. A directory already (partly) gone is not an error."""
    root = Path(path)
    try:
        (root / manifest_name).unlink()
        if after_unlink is not None:
            after_unlink()
    except FileNotFoundError:
        pass
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.is_file(follow_symlinks=False) or entry.is_symlink():
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            if after_unlink is not None:
                after_unlink()
    try:
        os.rmdir(root)
    except FileNotFoundError:
        pass
