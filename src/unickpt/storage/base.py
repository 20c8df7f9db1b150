"""The storage interface every layer above uses: one checkpoint location (a directory or a
URL prefix) holding named files.

What the engine needs of a backend, and no more: ranged reads into caller buffers
(``reader(name).pread_into/preadv_into``), positional or streamed writes of a data file
(``open_writer``), atomic commit of a small document (``write_atomic``: the manifest, the
commit point), ``exists``/``size``/``list_files``/``remove``. Backends: local files
(:class:`~unickpt.storage.local.LocalStorage`); others plug in through
:func:`~unickpt.storage.open.open_storage`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class RangeReader(Protocol):
    """Positional reads of one file."""

    size: int

    def pread_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; CorruptionError when the file is short."""

    def preadv_into(self, offset: int, views: list[memoryview]) -> None:
        """Fill ``views`` in order with the consecutive bytes starting at ``offset``."""


@runtime_checkable
class DataWriter(Protocol):
    """Writes of one data file, made durable (or abandoned) by ``close``."""

    def pwrite(self, offset: int, data: memoryview | bytes) -> None:
        """Write ``data`` at ``offset``."""

    def close(self, durable: bool = True) -> None:
        """Finish the file; with ``durable`` its bytes are on stable storage when this returns."""

# bytes/s one rank reads when every rank reads at once, by where the bytes are: files of
# this machine (page cache, local NVMe: 2.4 GB/s, docs/PERFORMANCE.md "Object stores"),
# another node's snapshot keeper over a socket (0.45 GB/s a rank, "In-memory snapshots"),
# an object store (50-100 MiB/s a connection, a few connections a rank); a storage says
# which by its ``read_rate`` (a local file's when it has none). load's rule for sharing
# replicated reads compares them with the broadcast's rate (``engine.replicated.sharing_pays``;
# docs/SCALE.md "Replicated state: the rule", bench/scale_recovery.py).
READ_RATE = {"local": 2.0e9, "keeper": 0.45e9, "object": 0.2e9}


@runtime_checkable
class Storage(Protocol):
    """One checkpoint location: named files under a root."""

    def prepare(self) -> None:
        """Create the location if needed."""

    def exists(self, name: str) -> bool:
        """True when the file exists."""

    def size(self, name: str) -> int:
        """Size of a file in bytes; CorruptionError when it is missing."""

    def read_small(self, name: str) -> bytes:
        """The whole content of a small file (the manifest); NotACheckpointError when missing."""

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write a small document so that it exists whole or not at all (the commit point)."""

    def open_writer(self, name: str, size: int) -> DataWriter:
        """Create (or replace) a data file of ``size`` bytes."""

    def reader(self, name: str) -> RangeReader:
        """A shared positional reader of a file."""

    def list_files(self, under: str = "") -> list[str]:
        """Relative ``/``-separated names of the files below ``under``, sorted."""

    def remove(self, name: str) -> None:
        """Delete a file if present."""

    def close(self) -> None:
        """Release open readers and connections."""
