"""Writing one rank's data file: the safetensors header, then tensor bytes in parts.

Used by ``save`` (all at once, from staged tensors) and ``async_save`` (batch by batch
from the staging buffer, when the shard is larger than the staging cap). Each part is cut
into chunks of ``WRITE_CHUNK_BYTES`` (aligned to checksum blocks) that several threads
checksum (CRC-32C, and xxh3-128 for the fragment's identity: block by block, one pass)
and ``pwrite`` in place; the storage layer starts writeback as each chunk lands,
and the file is fsynced once at the end.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import SaveError, os_error_text
from ..format.checksum import block_sums, identity
from ..format.dtypes import dtype_name
from ..format.manifest import Fragment
from ..format.safetensors_header import Entry, build_header
from ..logs import log
from ..plan.save_plan import write_chunks
from ..storage.local import LocalStorage
from .items import TensorItem

WRITE_CHUNK_BYTES = 16 << 20


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def data_file_layout(rank: int, items: list[TensorItem]) -> tuple[bytes, list[int], int]:
    """The layout of a rank's data file holding ``items`` (only their dtypes and shapes
    are used, so meta tensors do): its leading bytes (length + safetensors header), each
    item's absolute data offset, and the file's size. Pure: the writer and the scale
    simulation (``bench/scale.py``) both use it."""
    entries = [Entry(i.name, dtype_name(i.local.dtype), tuple(i.local.shape), i.local.numel() * i.local.element_size()) for i in items]
    prefix, offsets = build_header(entries, {"format": "unickpt", "rank": str(rank)})
    return prefix, offsets, len(prefix) + sum(e.nbytes for e in entries)


class DataFileWriter:
    """One rank's safetensors file, written in parts: the header at creation, then byte
    ranges of the tensors in any order, fsync once in :meth:`finish`. I/O errors become
    :class:`SaveError` naming the file."""

    def __init__(
        self, storage: LocalStorage, name: str, rank: int, items: list[TensorItem], block_bytes: int, threads: int
    ) -> None:
        self.items, self.name, self.rank = items, name, rank
        self.block_bytes, self.threads = block_bytes, max(1, threads)
        prefix, self.offsets, self.size = data_file_layout(rank, items)
        # for error messages: the staging directory's file, not "step_5/../.step_5.unickpt-.../"
        self.path = os.path.normpath(storage.path(name)) if hasattr(storage, "path") else name
        self._storage = storage
        self._crcs: list[dict[int, list[int]]] = [{} for _ in items]
        self._digests: list[dict[int, list[bytes]]] = [{} for _ in items]
        try:
            self._file = storage.open_writer(name, self.size)
        except OSError as e:
            raise SaveError(f"cannot write {self.path}: {os_error_text(e)}") from None
        try:
            self._guard(lambda: self._file.pwrite(0, prefix))
        except BaseException:
            self.abort()
            raise

    def _guard(self, fn):
        try:
            return fn()
        except OSError as e:
            raise SaveError(f"cannot write {self.path}: {os_error_text(e)}") from None

    def write(self, parts: list[tuple[int, int, memoryview]]) -> None:
        """Write ``(item index, byte offset in the item, bytes)`` parts. Offsets are
        multiples of ``block_bytes``; a part ends on a block boundary or at its item's end."""
        chunks = [
            (k, lo + a, data[a:b])
            for k, lo, data in parts
            for a, b in write_chunks(data.nbytes, WRITE_CHUNK_BYTES, self.block_bytes)
        ]

        def one(chunk: tuple[int, int, memoryview]) -> tuple[list[int], list[bytes]]:
            k, at, data = chunk
            sums = block_sums(data, self.block_bytes)
            if data.nbytes:
                self._file.pwrite(self.offsets[k] + at, data)
            return sums

        def run() -> list[tuple[list[int], list[bytes]]]:
            if len(chunks) <= 1 or self.threads == 1:
                return [one(c) for c in chunks]
            with ThreadPoolExecutor(max_workers=min(self.threads, len(chunks))) as pool:
                return list(pool.map(one, chunks))

        for (k, at, _), (crcs, digests) in zip(chunks, self._guard(run)):
            self._crcs[k][at] = crcs
            self._digests[k][at] = digests

    def finish(self) -> tuple[int, list[Fragment]]:
        """Make the file durable and close it; returns its size and the fragments it holds."""
        try:
            self._guard(lambda: self._file.close(durable=True))
        except BaseException:
            self.abort()
            raise
        fragments = []
        for k, (item, off) in enumerate(zip(self.items, self.offsets)):
            crcs = [c for _, part in sorted(self._crcs[k].items()) for c in part]
            digests = [d for _, part in sorted(self._digests[k].items()) for d in part]
            fragments.append(Fragment(self.name, off, tuple(item.local.shape), item.pieces, crcs, self.block_bytes, self.rank,
                                      identity(digests)))
        return self.size, fragments

    def abort(self) -> None:
        """Close without making anything durable and remove the file (after a failure:
        a partial file must not keep its space). Never raises: the caller's error (why
        the save failed) is the one to report; a cleanup that fails too (the store gone,
        a read-only directory) is logged as a warning and leaves the file behind."""
        for what, step in (("close", lambda: self._file.close(durable=False)),
                           ("remove", lambda: self._storage.remove(self.name))):
            try:
                step()
            except Exception as e:  # noqa: BLE001  (any error of the cleanup: never the one raised)
                log.warning(f"unickpt: the failed save could not {what} its partial file {self.path}: "
                            f"{type(e).__name__}: {e}")
