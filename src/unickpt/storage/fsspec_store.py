"""Object stores (and every other fsspec file system) as checkpoint storage.

A checkpoint location is a URL prefix (``s3://bucket/run/step_5``, ``gs://...``,
``az://...``, ``memory://...``); its files are the objects below it. Options come from
``storage_options`` (passed to the fsspec file system) and, for S3, from the standard
environment that botocore reads (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).

- Reads are ranged GETs of only the bytes asked for; a long read is cut into
  ``READ_PART_BYTES`` ranges fetched concurrently.
- A data file is written on S3 as a multipart upload: the file is cut into parts of
  ``PART_BYTES``; the writer thread that completes a part uploads it, so several parts are
  in flight at once (one per writer thread) and at most a few parts are held in memory.
  Files of one part or less, and other file systems, are one PUT at ``close``.
- The commit is the manifest, written last with one PUT: an object store has no rename,
  but a PUT is atomic (the object exists whole or not at all). A save that dies leaves
  data files without a manifest (and unfinished multipart uploads): not a checkpoint;
  :class:`PrefixWrite` removes them before the next save to the prefix and the
  :class:`~unickpt.CheckpointManager` removes those of other steps.
- Every failure of the store (unreachable server, denied request) is a
  :class:`~unickpt.StorageError` naming the URL; S3 connections get bounded timeouts
  and retries unless ``storage_options`` set them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointExistsError, CorruptionError, NotACheckpointError, SaveError, StorageError, UnickptError
from .base import READ_RATE
from .write_end import WriteEnd

PART_BYTES = 16 << 20
READ_PART_BYTES = 16 << 20
MAX_PARTS = 10_000
S3_DEFAULT_CONFIG = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3, "mode": "standard"}}


class Transfer:
    """Requests and bytes this process moved through object stores (thread-safe): what a
    test or a benchmark counts at the storage boundary."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self.gets = self.get_bytes = self.puts = self.put_bytes = 0
            self.get_ranges: list[tuple[str, int, int]] = []

    def got(self, path: str, start: int, data_len: int) -> None:
        """Count one GET of ``data_len`` bytes of ``path`` from byte ``start``."""
        with self._lock:
            self.gets += 1
            self.get_bytes += data_len
            self.get_ranges.append((path, start, start + data_len))

    def put(self, nbytes: int) -> None:
        """Count one PUT (or uploaded part) of ``nbytes`` bytes."""
        with self._lock:
            self.puts += 1
            self.put_bytes += nbytes


TRANSFER = Transfer()


def filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """The fsspec file system of ``url`` and the path inside it. StorageError for a
    scheme fsspec does not know, or whose package is not installed."""
    import fsspec
    from fsspec.registry import known_implementations

    protocol = url.split("://", 1)[0].lower()
    if protocol not in known_implementations and protocol not in fsspec.available_protocols():
        raise StorageError(f"{url}: unsupported storage URL scheme {protocol!r} (not a local path, and fsspec knows no such file system)")
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        config = dict(S3_DEFAULT_CONFIG)
        config.update(options.get("config_kwargs") or {})
        options["config_kwargs"] = config
        options.setdefault("use_listings_cache", False)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        raise StorageError(f"{url}: the {protocol}:// file system needs a package that is not installed ({e})") from None
    except Exception as e:
        raise StorageError(f"{url}: cannot open storage: {type(e).__name__}: {e}") from None
    if protocol in ("s3", "s3a") and hasattr(fs, "retries"):
        # botocore's 3 attempts only: s3fs's own 5 on top of them held a request to a store
        # that stops answering for 5 x 3 x read_timeout (15 min), this about 3 min
        fs.retries = 1
    return fs, path.rstrip("/")


def _is_s3(fs: Any) -> bool:
    return hasattr(fs, "call_s3") and hasattr(fs, "split_path")


class ObjectReader:
    """Positional reads of one object by ranged GETs (several at once for a long read)."""

    def __init__(self, storage: FsspecStorage, name: str) -> None:
        self._storage, self.name = storage, name
        self.size = storage.size(name)

    def pread_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; a short object is a CorruptionError."""
        self.preadv_into(offset, [out])

    def preadv_into(self, offset: int, views: list[memoryview]) -> None:
        """Fill ``views`` one after the other with the bytes from ``offset`` on: ranged
        GETs of exactly those bytes, at most ``READ_PART_BYTES`` each, fetched concurrently."""
        views = [memoryview(v).cast("B") for v in views]
        total = sum(v.nbytes for v in views)
        if not total:
            return
        if offset + total > self.size:
            raise CorruptionError(f"{self.name} is truncated: no data at byte {min(self.size, offset + total)} (file has {self.size})")
        starts = list(range(offset, offset + total, READ_PART_BYTES))
        ends = [min(s + READ_PART_BYTES, offset + total) for s in starts]
        chunks = self._storage.get_ranges(self.name, starts, ends)
        k, at = 0, 0  # scatter: view k, byte at in it
        for s, e, data in zip(starts, ends, chunks):
            if len(data) != e - s:
                raise CorruptionError(f"{self.name} is truncated: asked bytes {s}-{e}, got {len(data)}")
            src = memoryview(data)
            while src.nbytes:
                n = min(src.nbytes, views[k].nbytes - at)
                views[k][at : at + n] = src[:n]
                src, at = src[n:], at + n
                if at == views[k].nbytes:
                    k, at = k + 1, 0

    def close(self) -> None:
        """Nothing to release (no connection is held per object)."""


class BufferedWriter:
    """A data file held in memory and stored with one PUT at ``close`` (small files, and
    file systems without a multipart API)."""

    def __init__(self, storage: FsspecStorage, name: str, size: int) -> None:
        self._storage, self._name = storage, name
        self._buf: bytearray | None = bytearray(size)

    def pwrite(self, offset: int, data: memoryview | bytes) -> None:
        """Copy ``data`` to ``offset`` of the file."""
        view = memoryview(data).cast("B")
        self._buf[offset : offset + view.nbytes] = view

    def close(self, durable: bool = True) -> None:
        """Store the file (when ``durable``; an abandoned file is never stored)."""
        buf, self._buf = self._buf, None
        if buf is not None and durable:
            self._storage.put(self._name, buf)


class MultipartWriter:
    """A data file stored as an S3 multipart upload. Part ``k`` holds bytes
    ``[k * part, (k + 1) * part)``; the ``pwrite`` that completes a part uploads it, so
    parts of one file go up from several writer threads at once, and only parts still
    being filled are held in memory. ``close`` completes the upload (or aborts it)."""

    def __init__(self, storage: FsspecStorage, name: str, size: int, part_bytes: int) -> None:
        self._storage, self._name, self.size = storage, name, size
        self.part = max(part_bytes, -(-size // MAX_PARTS))
        self.nparts = math.ceil(size / self.part)
        self._lock = threading.Lock()
        self._bufs: dict[int, bytearray] = {}
        self._filled: dict[int, int] = {}
        self._etags: dict[int, str] = {}
        self._bucket, self._key, _ = storage.fs.split_path(storage.full(name))
        self._upload_id = storage.s3_call(name, "create_multipart_upload", Bucket=self._bucket, Key=self._key)["UploadId"]

    def _part_len(self, k: int) -> int:
        return min(self.part, self.size - k * self.part)

    def pwrite(self, offset: int, data: memoryview | bytes) -> None:
        """Copy ``data`` into its parts; upload each part this write completes."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            k, at = divmod(offset, self.part)
            n = min(view.nbytes, self._part_len(k) - at)
            with self._lock:
                buf = self._bufs.get(k)
                if buf is None:
                    buf = self._bufs[k] = bytearray(self._part_len(k))
            buf[at : at + n] = view[:n]
            with self._lock:
                self._filled[k] = self._filled.get(k, 0) + n
                done = self._filled[k] == len(buf)
            if done:
                self._upload(k)
            view, offset = view[n:], offset + n

    def _upload(self, k: int) -> None:
        buf = self._bufs[k]
        out = self._storage.s3_call(self._name, "upload_part", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                                    PartNumber=k + 1, Body=bytes(buf))
        TRANSFER.put(len(buf))
        with self._lock:
            self._etags[k] = out["ETag"]
            del self._bufs[k]

    def close(self, durable: bool = True) -> None:
        """Complete the upload when ``durable`` (every byte must have been written), else abort it."""
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        if durable:
            missing = [k for k in range(self.nparts) if k not in self._etags]
            if missing:
                self._storage.s3_call(self._name, "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload_id)
                raise SaveError(f"{self._storage.full_url(self._name)}: parts {missing[:5]} were never fully written")
            parts = [{"PartNumber": k + 1, "ETag": self._etags[k]} for k in range(self.nparts)]
            self._storage.s3_call(self._name, "complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                                  UploadId=upload_id, MultipartUpload={"Parts": parts})
        else:
            self._bufs.clear()
            try:
                self._storage.s3_call(self._name, "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload_id)
            except StorageError:
                pass


class FsspecStorage:
    """A checkpoint location on an fsspec file system: objects under a URL prefix."""

    read_rate = READ_RATE["object"]  # bytes/s a rank reads (load's rule for sharing replicated reads)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, part_bytes: int = PART_BYTES) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = filesystem(self.url, self.storage_options)
        self.part_bytes = part_bytes
        self._sizes: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    # names -----------------------------------------------------------------------
    def full(self, name: str) -> str:
        """The file system's path of file ``name``."""
        return f"{self.root}/{name}" if name else self.root

    def full_url(self, name: str) -> str:
        """The URL of file ``name`` (for messages)."""
        return f"{self.url}/{name}" if name else self.url

    path = full_url

    def child(self, name: str) -> FsspecStorage:
        """The storage of the prefix ``name`` below this one (same file system and options)."""
        out = object.__new__(FsspecStorage)
        out.url, out.storage_options, out.fs = self.full_url(name), self.storage_options, self.fs
        out.root, out.part_bytes, out._sizes = self.full(name), self.part_bytes, {}
        return out

    def _call(self, name: str, what: str, fn: Callable[[], Any]) -> Any:
        """Run a request; every failure of the store becomes a StorageError naming the URL
        (FileNotFoundError passes, for the caller to word)."""
        try:
            return fn()
        except (FileNotFoundError, UnickptError):
            raise
        except Exception as e:
            raise StorageError(f"{self.full_url(name)}: {what} failed: {type(e).__name__}: {e}") from None

    def s3_call(self, name: str, method: str, **kwargs: Any) -> Any:
        """One S3 API request through s3fs (its retries and timeouts)."""
        return self._call(name, method, lambda: self.fs.call_s3(method, **kwargs))

    # reads -----------------------------------------------------------------------
    def get_ranges(self, name: str, starts: list[int], ends: list[int]) -> list[bytes]:
        """Bytes ``[starts[i], ends[i])`` of file ``name``, one ranged GET each, concurrently."""
        path = self.full(name)
        try:
            if len(starts) == 1:
                out = [self._call(name, "read", lambda: self.fs.cat_file(path, start=starts[0], end=ends[0]))]
            else:
                out = self._call(name, "read", lambda: self.fs.cat_ranges([path] * len(starts), starts, ends, on_error="raise"))
        except FileNotFoundError:
            raise CorruptionError(f"data file {name} is missing from {self.url}") from None
        for s, data in zip(starts, out):
            TRANSFER.got(name, s, len(data))
        return out

    def prepare(self) -> None:
        """Nothing to create on an object store (a prefix exists when an object is under it)."""
        if not _is_s3(self.fs):
            self._call("", "create", lambda: self.fs.makedirs(self.root, exist_ok=True))

    def exists(self, name: str) -> bool:
        """True when the file exists."""
        return bool(self._call(name, "stat", lambda: self.fs.exists(self.full(name))))

    def size(self, name: str) -> int:
        """Size of a file in bytes; CorruptionError when it is missing."""
        if name not in self._sizes:
            try:
                self._sizes[name] = int(self._call(name, "stat", lambda: self.fs.info(self.full(name))["size"]))
            except FileNotFoundError:
                raise CorruptionError(f"data file {name} is missing from {self.url}") from None
        return self._sizes[name]

    def read_small(self, name: str) -> bytes:
        """The whole content of a small file (the manifest); NotACheckpointError when missing."""
        try:
            data = self._call(name, "read", lambda: self.fs.cat_file(self.full(name)))
        except FileNotFoundError:
            raise NotACheckpointError(f"{self.url}: not a committed checkpoint (no {name})") from None
        TRANSFER.got(name, 0, len(data))
        return data

    def reader(self, name: str) -> ObjectReader:
        """A positional reader of a file (ranged GETs)."""
        return ObjectReader(self, name)

    # writes ----------------------------------------------------------------------
    def put(self, name: str, data: bytes | bytearray) -> None:
        """Store a whole file with one PUT (atomic: it appears whole or not at all)."""
        self._call(name, "write", lambda: self.fs.pipe_file(self.full(name), bytes(data)))
        TRANSFER.put(len(data))

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write a small document whole or not at all: one PUT (the commit point)."""
        self.put(name, data)

    def open_writer(self, name: str, size: int) -> MultipartWriter | BufferedWriter:
        """A writer of a data file of ``size`` bytes: a multipart upload on S3 when the file
        is larger than one part, else one PUT at ``close``."""
        if _is_s3(self.fs) and size > self.part_bytes:
            return MultipartWriter(self, name, size, self.part_bytes)
        return BufferedWriter(self, name, size)

    # listing and removal -----------------------------------------------------------
    def list_files(self, under: str = "") -> list[str]:
        """Relative ``/``-separated names of the files below ``under``, sorted."""
        base = self.full(under).rstrip("/")
        found = self._call(under, "list", lambda: self.fs.find(base))
        cut = len(self.root) + 1
        return sorted(p[cut:] for p in found if p.startswith(self.root + "/"))

    def names(self) -> list[str]:
        """Names of the files directly under the location."""
        return [n for n in self.list_files() if "/" not in n]

    def list_dirs(self) -> list[str]:
        """Names of the prefixes ("directories") directly under the location."""
        try:
            entries = self._call("", "list", lambda: self.fs.ls(self.root, detail=True))
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

    def remove(self, name: str) -> None:
        """Delete a file if present."""
        self._sizes.pop(name, None)
        try:
            self._call(name, "remove", lambda: self.fs.rm_file(self.full(name)))
        except FileNotFoundError:
            pass

    def remove_many(self, names: list[str], threads: int = 8) -> None:
        """Delete several files (concurrently)."""
        if not names:
            return
        with ThreadPoolExecutor(max_workers=min(threads, len(names))) as pool:
            list(pool.map(self.remove, names))

    def abort_uploads(self, skip: Callable[[str], bool] | None = None) -> int:
        """Abort the unfinished multipart uploads below the location (left by saves that
        died), except those whose name (relative to the location) ``skip`` accepts;
        returns how many (S3 only, 0 elsewhere)."""
        if not _is_s3(self.fs):
            return 0
        bucket, key, _ = self.fs.split_path(self.root)
        prefix = key.rstrip("/") + "/" if key else ""
        found = self.s3_call("", "list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
        found = [u for u in found if skip is None or not skip(u["Key"][len(prefix):])]
        for u in found:
            self.s3_call(u["Key"], "abort_multipart_upload", Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
        return len(found)

    def close(self) -> None:
        """Forget cached sizes (connections are the file system's, shared)."""
        self._sizes.clear()


class PrefixWrite:
    """A save's claim on an object-store prefix (the object-store counterpart of
    :class:`~unickpt.storage.transaction.DirectoryWrite`). There is no rename to swap a
    directory in, so the files are written in place and the manifest, written last, is
    the commit. ``begin`` uncommits an old checkpoint being overwritten (its manifest
    first) and removes the checkpoint files a dead save left; ``abort`` removes what the
    save wrote. One save per prefix at a time is the caller's to ensure (object stores
    have no lock; the manager writes each step to its own prefix)."""

    staging_from_target = "."

    def __init__(self, storage: FsspecStorage, owned: Callable[[str], bool]) -> None:
        self.storage, self._owned = storage, owned
        self._end = WriteEnd(storage.url)  # committed or aborted: a later abort leaves the prefix alone

    @classmethod
    def begin(cls, storage: FsspecStorage, manifest_name: str, overwrite: bool, owned: Callable[[str], bool]) -> PrefixWrite:
        """Claim ``storage``'s prefix for a save (see the class docstring)."""
        try:
            if storage.exists(manifest_name):
                if not overwrite:
                    raise CheckpointExistsError(storage.url)
                storage.remove(manifest_name)
            write = cls(storage, owned)
            write.clear()
        except StorageError as e:
            raise SaveError(f"cannot prepare {storage.url}: {e}") from None
        return write

    def clear(self) -> None:
        """Remove the checkpoint files under the prefix and its unfinished uploads."""
        self.storage.abort_uploads()
        self.storage.remove_many([n for n in self.storage.names() if self._owned(n)])

    def commit(self, documents: dict[str, bytes]) -> None:
        """Write ``documents`` in order, the manifest last: its PUT commits the checkpoint."""
        with self._end.commit():
            try:
                for name, data in documents.items():
                    self.storage.write_atomic(name, data)
            except StorageError as e:
                self.abort()
                raise SaveError(f"cannot commit {self.storage.url}: {e}") from None

    def abort(self) -> None:
        """Remove everything the save wrote (best effort: the store may be gone); nothing
        once the save committed (or was aborted already)."""
        with self._end.abort() as first:
            if not first:
                return
            try:
                self.clear()
            except UnickptError:
                pass
