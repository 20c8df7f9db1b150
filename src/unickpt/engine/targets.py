"""Where a save writes, and how its manifest is committed there: the targets of the save
protocol (:mod:`unickpt.engine.commit`).

A collective save hands :func:`~unickpt.engine.commit.prepare_collective` a
:class:`CommitTarget`, a small strategy that owns every step that differs with where the
checkpoint lies, as a DCP ``StorageWriter`` owns its ``finish``:

* :class:`SharedDirectory` (the default): one checkpoint directory every rank sees (or an
  object-store prefix). Rank 0 claims it, every rank writes into its staging directory,
  rank 0 commits the manifest by swapping the staging directory in.
* :class:`NodeCopies`: a directory of each rank's own machine (the in-memory snapshots'
  per-step directories in host memory). Every rank writes straight into its own; rank 0
  commits the manifest in its own and sends every other rank the root and the parts of
  the index (:class:`IndexParts`) that its node keeps.

A process writing a checkpoint alone (convert, export, a tier copy, the DCP plugin's
coordinator) takes :func:`claim` instead.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..dist import Group, all_gather_fixed, all_true, broadcast_bytes, gather_bytes, scatter_bytes
from ..errors import CheckpointExistsError, SaveError
from ..logs import log
from ..format.index import INDEX_NAME, line_offsets, part_bounds, part_name
from ..format.manifest import MANIFEST_NAME
from ..storage.base import Storage
from ..storage.open import is_remote, local_path, open_storage
from ..storage.transaction import DirectoryWrite
from .outcome import Outcome

__all__ = [
    "CommitTarget", "IndexParts", "NodeCopies", "SharedDirectory", "check_not_committed", "checkpoint_file", "claim",
    "data_file_name", "rank_storage",
]


def data_file_name(rank: int) -> str:
    """Name of the data file a group rank writes."""
    return f"rank_{rank:05d}.safetensors"


_DATA_FILE = re.compile(r"rank_\d{5,}\.safetensors")


def checkpoint_file(name: str) -> bool:
    """True for the names a unickpt checkpoint's files have in its directory."""
    return name in (MANIFEST_NAME, INDEX_NAME) or _DATA_FILE.fullmatch(name) is not None


def check_not_committed(path: str, overwrite: bool, storage_options: dict[str, Any] | None = None,
                        group: Group | None = None) -> None:
    """CheckpointExistsError when ``path`` (a directory or URL) already holds a committed
    checkpoint and not ``overwrite``; StorageError for a URL no backend knows.

    Collective over ``group`` when it has other ranks (one all-gather of two bytes): every
    rank raises CheckpointExistsError when any rank finds one (the same path on node-local
    disks can hold one on a single node; a save can commit between two ranks' checks), so
    that no rank leaves the save while the others wait in its collectives. A rank that
    cannot check raises its own error, the others a SaveError naming it."""
    if overwrite:
        return
    error: Exception | None = None
    try:
        found = open_storage(path, storage_options).exists(MANIFEST_NAME)
    except Exception as e:  # raised below, once the other ranks know
        found, error = False, e
    if group is not None and group.active:
        flags = all_gather_fixed(group, bytes([found, error is not None]))
        failed = {r: "could not check whether the location holds a committed checkpoint"
                  for r, f in enumerate(flags) if f[1]}
        if failed and error is None:
            raise SaveError(f"cannot save to {path}:\n" + "\n".join(f"rank {r}: {why}" for r, why in failed.items()), failed)
        found = any(f[0] for f in flags)
    if error is not None:
        raise error
    if found:
        raise CheckpointExistsError(path)


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


class CommitTarget:
    """Where one collective save writes and how its manifest is committed there. One
    object per save; the protocol calls, in order: :meth:`prepare` (every rank), then,
    once every rank's file is written, :meth:`publish` (rank 0, the documents checked) or
    :meth:`abort` (rank 0, the save failed), and :meth:`finish` (every rank, once the
    commit's outcome is known and is a success)."""

    storage: Storage  # where this rank writes its data file (set by prepare)
    indexed: bool | None = None  # the manifest's form: indexed (format 2.0), one document, None: by its size
    # True when prepare() returns on no rank before every rank has called it (then a save
    # needs no separate barrier before it writes)
    prepare_waits_for_all: bool = False

    def prepare(self, group: Group, path: str, overwrite: bool, storage_options: dict[str, Any] | None) -> None:
        """Collective: make the location ready and set :attr:`storage`; the same
        :class:`~unickpt.SaveError` on every rank when it cannot."""
        raise NotImplementedError

    def publish(self, documents: dict[str, bytes]) -> bytes | None:
        """Rank 0: commit ``documents`` (``manifest.json`` last); the manifest every
        other rank must receive, or None."""
        raise NotImplementedError

    def abort(self) -> None:
        """Rank 0, the save failed: remove what it wrote (a target that claims nothing
        leaves the files to the next save into its directories)."""

    def give_up(self) -> None:
        """:meth:`abort` after a failure anywhere between :meth:`prepare` and the commit (a
        check that failed, a peer's collective lost, live recovery's ``Interrupted``), never
        raising: the error that ended the save is the one to raise. Rank 0's claim (a
        directory's lock, its staging directory) is released, so that the same step saved
        again (the survivors redo it) is not refused as "another save in progress"; a
        target that committed is left as it is."""
        try:
            self.abort()
        except Exception as e:  # noqa: BLE001  (what the save wrote stays behind; the ranks still hear the outcome)
            log.warning(f"unickpt: the failed save could not remove what it wrote: {type(e).__name__}: {e}")

    @contextmanager
    def given_up_on_failure(self) -> Iterator[None]:
        """The block's failure (any exception, live recovery's ``Interrupted`` too) gives
        the target up (:meth:`give_up`) before it goes on: the steps between :meth:`prepare`
        and the commit run inside."""
        try:
            yield
        except BaseException:
            self.give_up()
            raise

    def finish(self, group: Group, manifest: bytes | None) -> None:
        """Every rank, the commit succeeded (``manifest``: what :meth:`publish` returned)."""


class SharedDirectory(CommitTarget):
    """One checkpoint directory every rank sees, claimed by rank 0 (an exclusive lock,
    the overwrite check, a staging directory swapped in at the commit), or an object-store
    prefix every rank writes into (the manifest, written last, commits:
    :class:`~unickpt.storage.fsspec_store.PrefixWrite`)."""

    def __init__(self) -> None:
        self.write: Any = None  # rank 0's claim: DirectoryWrite or PrefixWrite

    def prepare(self, group: Group, path: str, overwrite: bool, storage_options: dict[str, Any] | None) -> None:
        if is_remote(path):
            self._prepare_remote(group, path, overwrite, storage_options)
            return
        path = local_path(path)
        outcome = Outcome()
        if group.rank == 0:
            try:
                self.write = DirectoryWrite.begin(path, MANIFEST_NAME, overwrite, checkpoint_file)
                outcome = Outcome(payload=os.fsencode(self.write.staging_from_target))
            except Exception as e:  # sent to every rank (a SaveError naming anything not unickpt's own)
                outcome = Outcome.of(e)
        outcome = self._shared(outcome, group)
        if not outcome.payload:
            raise SaveError(f"rank 0 named no staging directory in {path}")
        self.storage = rank_storage(path, os.fsdecode(outcome.payload))

    def _prepare_remote(self, group: Group, path: str, overwrite: bool, storage_options: dict[str, Any] | None) -> None:
        from ..storage.fsspec_store import PrefixWrite

        storage, outcome, mine = None, Outcome(), None
        try:
            storage = open_storage(path, storage_options)
            if group.rank == 0:
                self.write = PrefixWrite.begin(storage, MANIFEST_NAME, overwrite, checkpoint_file)
        except Exception as e:  # fsspec's own errors too: every rank must reach the broadcast
            outcome = mine = Outcome.of(e)
        self._shared(outcome, group)
        if mine is not None:  # rank 0 could open it, this rank could not
            raise SaveError(f"cannot open {path}: {mine.message}")
        self.storage = storage

    def _shared(self, outcome: Outcome, group: Group) -> Outcome:
        """Rank 0's outcome of the claim, on every rank; when that collective fails (a peer
        lost, live recovery's ``Interrupted``) rank 0's claim is given up before the error
        goes on: the directory is not left locked for the same step saved again."""
        with self.given_up_on_failure():
            return outcome.shared(group)

    def publish(self, documents: dict[str, bytes]) -> bytes | None:
        self.write.commit(documents)
        return None

    def abort(self) -> None:
        if self.write is not None:
            self.write.abort()


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


class NodeCopies(CommitTarget):
    """A directory of each rank's own machine (``path`` names a different machine's
    directory on each rank, as the in-memory snapshots' per-step directories in host
    memory): every rank writes straight into its own, created if needed (no claim, no
    staging); the manifest is indexed, rank 0 commits it in its own directory, and each
    rank keeping index ``parts`` receives the root and those parts (every node needs the
    manifest to serve a recovery). ``committed``, when given, is called on each rank
    that wrote the manifest into its directory, right after (the snapshots wake their
    node's keeper with it)."""

    indexed = True
    prepare_waits_for_all = True  # its agreement is an all-reduce

    def __init__(self, parts: IndexParts, committed: Callable[[], None] | None = None) -> None:
        self.parts = parts
        self.committed = committed
        self.payloads: list[bytes] | None = None  # rank 0: what each rank receives

    def prepare(self, group: Group, path: str, overwrite: bool, storage_options: dict[str, Any] | None) -> None:
        storage, problem = None, b""
        try:
            storage = open_storage(path, storage_options)
            storage.prepare()
        except Exception as e:  # told to every rank below
            problem = f"rank {group.rank}: cannot prepare {path}: {e}".encode()
        if not all_true(group, not problem):  # one all-reduce when every rank is ready (every snapshot)
            problems = gather_bytes(group, problem, 0)
            status = broadcast_bytes(group, b"\n".join(p for p in problems if p) if problems is not None else b"", 0)
            raise SaveError(status.decode(errors="replace"))
        self.storage = storage

    def publish(self, documents: dict[str, bytes]) -> bytes | None:
        self.payloads = self.parts.payloads(documents[INDEX_NAME])
        for name in sorted(documents, key=lambda n: n == MANIFEST_NAME):  # the root last: it commits
            self.storage.write_atomic(name, documents[name])
        if self.committed is not None:
            self.committed()
        return documents[MANIFEST_NAME]

    def finish(self, group: Group, manifest: bytes | None) -> None:
        # the root manifest went to every rank in rank 0's outcome (one broadcast: rank 0
        # holds one copy); folding it into this scatter would pad every rank's chunk with
        # it, world size x the root on rank 0
        if group.rank == 0:
            scatter_bytes(group, self.payloads, 0)
            return
        mine = scatter_bytes(group, None, 0)
        if manifest is None or not self.parts.kept[group.rank]:
            return
        IndexParts.write(self.storage, mine)
        self.storage.write_atomic(MANIFEST_NAME, manifest)
        if self.committed is not None:
            self.committed()
