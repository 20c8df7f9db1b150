"""The save protocol, stated once: how the ranks of a group write one unickpt checkpoint.
Every writer follows it (``unickpt.save``, ``unickpt.async_save`` and its background
thread, the DCP plugin's ``StorageWriter``, the snapshot tier); they differ only in how a
rank gets its bytes to its file.

Call order, every rank of the group unless said::

    local = collect(state_dict, group)              # engine.collect: what this rank holds
    target = prepare_collective(group, path, ...)   # rank 0 claims the location (lock,
                                                    #   staging directory; or an object-store
                                                    #   prefix); every rank learns where to write
    report = write_rank(rank, local, write)         # this rank's data file, then its RankReport;
                                                    #   a failure becomes a failed report, never
                                                    #   an exception: rank 0 hears from every rank
    commit(group, report, target, metadata)         # rank 0 gathers the reports, checks them
                                                    #   (engine.assemble) and commits the manifest
                                                    #   last, or removes what the save wrote; the
                                                    #   same outcome (or the same error) on every rank

A process writing a checkpoint alone (convert, export, a tier copy) takes :func:`claim`
instead of ``prepare_collective``; the DCP plugin does too (DCP carries the reports to its
coordinator, which commits with the claim). :func:`check_not_committed` is the early
check of a save's arguments. A failed save raises :class:`~unickpt.SaveError`, whose
``failures`` maps each failed rank to its cause.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import errors
from ..dist import Group, broadcast_bytes, gather_bytes, scatter_bytes
from ..errors import SaveError, UnickptError
from ..format.dtypes import dtype_name
from ..format.index import INDEX_NAME, line_offsets, part_bounds, part_name
from ..format.manifest import MANIFEST_NAME, Fragment, fragment_to_json
from ..format.rank_message import FragmentRecord
from ..storage.base import Storage
from ..storage.open import is_remote, local_path, open_storage
from ..storage.transaction import DirectoryWrite
from .assemble import manifest_document
from .collect import LocalState
from .items import TensorItem
from .rank_report import RankReport, rank_message, read_message
from .unchanged import BaseIndex, holders_json
from .writer import DataFileWriter, as_bytes

__all__ = [
    "IndexParts", "RankReport", "Target", "Written", "check_not_committed", "checkpoint_file", "claim", "commit", "data_file_name",
    "describe", "prepare_collective", "rank_message", "rank_report", "rank_storage", "read_message", "write_data_file",
    "write_items", "write_rank",
]


def data_file_name(rank: int) -> str:
    """Name of the data file a group rank writes."""
    return f"rank_{rank:05d}.safetensors"


_DATA_FILE = re.compile(r"rank_\d{5,}\.safetensors")


def checkpoint_file(name: str) -> bool:
    """True for the names a unickpt checkpoint's files have in its directory."""
    return name in (MANIFEST_NAME, INDEX_NAME) or _DATA_FILE.fullmatch(name) is not None


def describe(e: Exception) -> str:
    """A rank's failure as its report tells it: a unickpt error's own message (it names
    the thing and the remedy), anything else with its class and traceback."""
    return str(e) if isinstance(e, UnickptError) else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


# ---------------------------------------------------------------- a rank's part


@dataclass(frozen=True)
class Written:
    """What a rank's write produced: each item with the fragment that holds it (written
    now, or referenced in an incremental save's base), the files written and their sizes,
    and the base referenced (None for a full save)."""

    fragments: list[tuple[TensorItem, Fragment]]
    files: dict[str, int]
    base: BaseIndex | None = None


def write_rank(rank: int, local: LocalState | None, write: Callable[[], Written], error: str | None = None) -> RankReport:
    """A rank's part of a save: ``write()`` writes its data file (each writer its own
    way) and says what it wrote; the result is the rank's :class:`RankReport`. A failure
    earlier (``error``: collecting or staging the state) or in ``write`` becomes a failed
    report, never an exception: every rank must reach :func:`commit`."""
    if error is not None or local is None:
        return RankReport.failed(rank, error if error is not None else "this rank's state was not collected")
    try:
        done = write()
        return rank_report(rank, local, done.fragments, done.files, done.base)
    except Exception as e:
        return RankReport.failed(rank, describe(e))


def write_items(storage: Storage, rank: int, items: list[TensorItem], block_bytes: int, threads: int) -> Written:
    """Write ``items`` (staged) as this rank's data file; nothing when there are none."""
    if not items:
        return Written([], {})
    name = data_file_name(rank)
    size, fragments = write_data_file(storage, name, rank, items, block_bytes, threads)
    return Written(list(zip(items, fragments)), {name: size})


def write_data_file(
    storage: Storage, name: str, rank: int, items: list[TensorItem], block_bytes: int, threads: int
) -> tuple[int, list[Fragment]]:
    """Write ``items`` (staged, contiguous CPU tensors) as one safetensors file, in chunks
    from ``threads`` threads, checksumming each chunk as it goes; fsync once at the end.
    Returns the file's size and the fragments it holds."""
    writer = DataFileWriter(storage, name, rank, items, block_bytes, threads)
    try:
        writer.write([(k, 0, as_bytes(i.local)) for k, i in enumerate(items)])
    except BaseException:
        writer.abort()
        raise
    return writer.finish()


def rank_report(
    rank: int, local: LocalState, written: list[tuple[TensorItem, Fragment]], files: dict[str, int],
    base: BaseIndex | None = None,
) -> RankReport:
    """The report of a rank whose file is durable (``base``: the base of an incremental
    save, whose checkpoints the written fragments may reference), so that rank 0 parses
    no fragment."""
    frags: list[FragmentRecord] = []
    rank_frags: dict[str, dict[str, Any]] = {}
    for item, frag in written:
        shape, dtype = list(item.global_shape), dtype_name(item.local.dtype)
        fjson = fragment_to_json(frag)
        if item.layout == "per-rank":
            rank_frags[item.name] = {"shape": shape, "dtype": dtype, "layout": item.layout, "fragment": fjson}
            continue
        boxes = [(p.global_box.offsets, p.global_box.lengths) for p in frag.pieces]
        lo = [min(o[d] for o, _ in boxes) for d in range(len(shape))] if boxes else [0] * len(shape)
        hi = [max(o[d] + n[d] for o, n in boxes) for d in range(len(shape))] if boxes else lo
        frags.append(FragmentRecord(
            item.name, shape, dtype, item.layout, json.dumps(fjson, separators=(",", ":")).encode(),
            sum(p.global_box.volume for p in frag.pieces), _short_hash(repr(boxes)), _short_hash(repr(frag.crc32c)),
            (lo, [h - o for h, o in zip(hi, lo)]),
        ))
    return RankReport(
        rank, None, files, frags, {k: [list(s), d, lay] for k, (s, d, lay) in local.declared.items()},
        local.replicated, local.digests, local.values if local.leader else {}, local.rank_values, rank_frags,
        local.group_values, holders_json(base), None if base is None else base.lineage(),
    )


def _short_hash(text: str) -> int:
    """A 64-bit key of ``text`` (the first 8 bytes of its BLAKE2b, as a big-endian integer)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


# ---------------------------------------------------------------- where the ranks write


def check_not_committed(path: str, overwrite: bool, storage_options: dict[str, Any] | None = None) -> None:
    """SaveError when ``path`` (a directory or URL) already holds a committed checkpoint
    and not ``overwrite``; StorageError for a URL no backend knows."""
    if not overwrite and open_storage(path, storage_options).exists(MANIFEST_NAME):
        raise SaveError(f"{path} already holds a committed checkpoint; pass overwrite=True to replace it")



@dataclass
class Target:
    """Where a save writes: the staging directory every rank writes its file to, and
    (on rank 0) the claim on the checkpoint directory that commits or discards it."""

    storage: Storage
    write: Any  # DirectoryWrite, PrefixWrite (object stores) or None


def prepare_collective(group: Group, path: str, overwrite: bool, manifest_copy: Any = None,
                       storage_options: dict[str, Any] | None = None) -> Target:
    """Collective: rank 0 claims the checkpoint directory (an exclusive lock, then the
    overwrite check) and makes the staging directory every rank writes to. Raises the same
    :class:`SaveError` on every rank when it cannot.

    With ``manifest_copy`` not None (each rank's ``path`` a directory of its own machine,
    as the in-memory snapshots' fresh per-step directories in host memory) every rank
    writes straight into its own ``path``, created if needed: no claim, no staging.

    On an object store (a URL other than ``file://``) there is no staging: every rank
    writes into the prefix itself and the manifest, written last, commits
    (:class:`~unickpt.storage.fsspec_store.PrefixWrite`)."""
    if is_remote(path):
        return _prepare_remote(group, path, overwrite, storage_options)
    path = local_path(path)
    if manifest_copy is not None:
        storage, problem = open_storage(path), b""
        try:
            storage.prepare()
        except (OSError, UnickptError) as e:
            problem = f"rank {group.rank}: cannot prepare {path}: {e}".encode()
        problems = gather_bytes(group, problem, 0)
        status = broadcast_bytes(group, b"\n".join(p for p in problems if p) if problems is not None else b"", 0)
        if status:
            raise SaveError(status.decode(errors="replace"))
        return Target(storage, None)
    write, status = None, b""
    if group.rank == 0:
        try:
            write = DirectoryWrite.begin(path, MANIFEST_NAME, overwrite, checkpoint_file)
            status = b"ok\n" + os.fsencode(write.staging_from_target)
        except UnickptError as e:
            status = str(e).encode()
    status = broadcast_bytes(group, status, 0)
    kind, _, where = status.partition(b"\n")
    if kind != b"ok" or not where:
        raise SaveError(status.decode(errors="replace"))
    return Target(rank_storage(path, os.fsdecode(where)), write)


def rank_storage(path: str, where: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage a rank writes its data file to: the staging directory ``where``
    (relative to the checkpoint directory ``path``, as the claim names it), or on an
    object store (``where`` empty) the prefix itself."""
    if is_remote(path):
        return open_storage(path, storage_options)
    return open_storage(os.path.join(local_path(path), where))


def claim(path: str, overwrite: bool, storage_options: dict[str, Any] | None = None) -> tuple[Any, Storage]:
    """One process's claim on a checkpoint location it writes alone (convert, export, a
    tier copy) and the storage its files go to: a locked directory and its staging
    directory, or an object-store prefix (written in place, the manifest commits).
    The claim's ``commit(documents)`` commits, ``abort()`` removes what was written."""
    if is_remote(path):
        from ..storage.fsspec_store import PrefixWrite

        storage = open_storage(path, storage_options)
        return PrefixWrite.begin(storage, MANIFEST_NAME, overwrite, checkpoint_file), storage
    write = DirectoryWrite.begin(local_path(path), MANIFEST_NAME, overwrite, checkpoint_file)
    return write, open_storage(write.staging)


def _prepare_remote(group: Group, path: str, overwrite: bool, storage_options: dict[str, Any] | None) -> Target:
    from ..storage.fsspec_store import PrefixWrite

    storage, write, status = None, None, b"ok"
    try:
        storage = open_storage(path, storage_options)
        if group.rank == 0:
            write = PrefixWrite.begin(storage, MANIFEST_NAME, overwrite, checkpoint_file)
    except UnickptError as e:
        status = str(e).encode()
    status = broadcast_bytes(group, status if group.rank == 0 else b"", 0)
    if status != b"ok" or storage is None:
        raise SaveError(status.decode(errors="replace") if status != b"ok" else f"cannot open {path}")
    return Target(storage, write)




# ---------------------------------------------------------------- the commit


# the errors a commit's outcome may carry to every rank: unickpt's own, by name
_ERRORS: dict[str, type[UnickptError]] = {
    name: cls for name, cls in vars(errors).items() if isinstance(cls, type) and issubclass(cls, UnickptError)
}


@dataclass(frozen=True)
class Outcome:
    """What rank 0 tells every rank at the end of a commit: the manifest committed (sent
    only when the ranks keep copies of it), or the error every rank raises (its class
    among unickpt's errors, its message, and for a :class:`~unickpt.SaveError` the map of
    failed ranks)."""

    manifest: bytes | None = None
    error: str | None = None  # the name of a class of unickpt.errors
    message: str = ""
    failures: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, e: Exception) -> Outcome:
        """The outcome of a commit that failed on rank 0 with ``e``."""
        if isinstance(e, UnickptError):
            return cls(error=type(e).__name__, message=str(e), failures=getattr(e, "failures", {}))
        return cls(error="SaveError", message=f"{type(e).__name__}: {e}", failures={0: f"{type(e).__name__}: {e}"})

    def encode(self) -> bytes:
        """The bytes rank 0 broadcasts."""
        if self.error is None:
            return b"ok" if self.manifest is None else b"ok\n" + self.manifest
        failures = {str(r): text for r, text in self.failures.items()}
        return b"error\n" + json.dumps({"error": self.error, "message": self.message, "failures": failures}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Outcome:
        """The outcome rank 0 broadcast."""
        if data == b"ok":
            return cls()
        kind, _, rest = data.partition(b"\n")
        if kind == b"ok":
            return cls(manifest=rest)
        doc = json.loads(rest)
        return cls(None, doc["error"], doc["message"], {int(r): t for r, t in doc["failures"].items()})

    def raise_error(self) -> None:
        """Raise the error this outcome carries, if any."""
        if self.error is None:
            return
        cls = _ERRORS.get(self.error, SaveError)
        if issubclass(cls, SaveError):
            raise cls(self.message, self.failures)
        raise cls(self.message)


@dataclass(frozen=True)
class IndexParts:
    """A manifest committed into directories local to each machine (the in-memory
    snapshots), in the index form (format 2.0): the index cut into ``count`` parts at line
    starts (:func:`~unickpt.format.index.part_bounds`); group rank ``r`` writes the parts
    ``kept[r]`` and then the root into its own directory (nothing when ``kept[r]`` is
    empty). Rank 0 writes the whole index and the root."""

    count: int
    kept: tuple[tuple[int, ...], ...]

    def payloads(self, index: bytes) -> list[bytes]:
        """What rank 0 sends each rank: a JSON line ``[[part, length], ...]``, then the parts' bytes."""
        bounds = part_bounds(line_offsets(index), len(index), self.count)
        out = []
        for r, kept in enumerate(self.kept):
            if r == 0 or not kept:
                out.append(b"")
                continue
            head = json.dumps([[j, bounds[j + 1] - bounds[j]] for j in kept]).encode()
            out.append(head + b"\n" + b"".join(index[bounds[j] : bounds[j + 1]] for j in kept))
        return out

    @staticmethod
    def write(storage: Storage, payload: bytes) -> None:
        """Write the parts of a payload of :meth:`payloads` into ``storage``."""
        head, _, rest = payload.partition(b"\n")
        at = 0
        for j, n in json.loads(head):
            storage.write_atomic(part_name(j), rest[at : at + n])
            at += n


def commit(
    group: Group, report: RankReport, target: Target, metadata: dict[str, Any],
    manifest_copy: bool | IndexParts | None = None,
) -> None:
    """Collective: gather every rank's report to rank 0, which checks them and commits the
    manifest (swapping the staging directory in), or, when any rank failed, removes
    everything the save wrote; raises the same error on every rank if any rank failed.

    ``manifest_copy`` (the same None-ness on every rank): when not None, the ranks wrote
    straight into their own directories (``prepare_collective``), rank 0 sends the
    committed manifest to every rank, and each rank passing True also writes it into its
    own directory (ranks writing to different machines' directories, as the in-memory
    snapshots do: every node needs the manifest). As :class:`IndexParts` the manifest is
    indexed: the root goes to every rank, each rank gets only the index parts it keeps."""
    parts = manifest_copy if isinstance(manifest_copy, IndexParts) else None
    gathered = gather_bytes(group, report.message(), 0)
    outcome, payloads = Outcome(), None
    if gathered is not None:
        try:
            # a manifest sent to every rank is one document, or indexed with its index in parts
            indexed = None if manifest_copy is None else parts is not None
            docs = manifest_document(gathered, group.size, metadata, indexed)
            doc = docs[MANIFEST_NAME]
            if parts is not None:
                payloads = parts.payloads(docs[INDEX_NAME])
            if target.write is not None:
                target.write.commit(docs)
            else:
                for name in sorted(docs, key=lambda n: n == MANIFEST_NAME):  # the root last: it commits
                    target.storage.write_atomic(name, docs[name])
            if manifest_copy is not None:
                outcome = Outcome(manifest=doc)
        except Exception as e:
            outcome = Outcome.of(e)
        finally:
            if outcome.error is not None and target.write is not None:
                target.write.abort()
    outcome = Outcome.decode(broadcast_bytes(group, outcome.encode(), 0))
    outcome.raise_error()
    if group.rank == 0 or outcome.manifest is None:
        if parts is not None:
            scatter_bytes(group, payloads, 0)
        return
    if parts is not None:
        mine = scatter_bytes(group, None, 0)
        if not parts.kept[group.rank]:
            return
        IndexParts.write(target.storage, mine)
    elif not manifest_copy:
        return
    target.storage.write_atomic(MANIFEST_NAME, outcome.manifest)
