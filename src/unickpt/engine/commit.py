"""The save protocol, stated once: how the ranks of a group write one unickpt checkpoint.
Every writer follows it (``unickpt.save``, ``unickpt.async_save`` and its background
thread, the DCP plugin's ``StorageWriter``, the snapshot tier); they differ only in how a
rank gets its bytes to its file.

Call order, every rank of the group unless said::

    local = collect(state_dict, group)              # engine.collect: what this rank holds
    target = prepare_collective(group, path, ...)   # the target (engine.targets) gets ready: by
                                                    #   default rank 0 claims the location (lock,
                                                    #   staging directory; or an object-store
                                                    #   prefix); every rank learns where to write
    report = write_rank(rank, local, write)         # this rank's data file, then its RankReport;
                                                    #   a failure becomes a failed report, never
                                                    #   an exception: rank 0 hears from every rank
    commit(group, report, target, metadata)         # rank 0 gathers the reports, checks them
                                                    #   (engine.assemble) and publishes the manifest
                                                    #   through the target, or aborts it; the same
                                                    #   outcome (or the same error) on every rank,
                                                    #   then each rank's target.finish

Where the files go and how the manifest is committed there is the target's
(:class:`~unickpt.engine.targets.CommitTarget`: one shared directory, or a directory on
each machine). A process writing a checkpoint alone (convert, export, a tier copy) takes :func:`claim`
instead of ``prepare_collective``; the DCP plugin does too (DCP carries the reports to its
coordinator, which commits with the claim). :func:`check_not_committed` is the early
check of a save's arguments. A failed save raises :class:`~unickpt.SaveError`, whose
``failures`` maps each failed rank to its cause.
"""

from __future__ import annotations

import hashlib
import json
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..dist import Group, gather_bytes
from ..errors import UnickptError
from ..format.dtypes import dtype_name
from ..format.manifest import Fragment, fragment_to_json
from ..format.rank_message import FragmentRecord
from ..storage.base import Storage
from .assemble import manifest_document
from .collect import LocalState
from .gc_pause import gc_paused
from .items import TensorItem
from .outcome import Outcome
from .rank_report import RankReport, rank_message, read_message
from .targets import CommitTarget, SharedDirectory, check_not_committed, checkpoint_file, claim, data_file_name, rank_storage
from .unchanged import BaseIndex, holders_json
from .writer import DataFileWriter, as_bytes

__all__ = [
    "CommitTarget", "RankReport", "Written", "check_not_committed", "checkpoint_file", "claim", "commit", "data_file_name",
    "describe", "prepare_collective", "rank_message", "rank_report", "rank_storage", "read_message", "write_data_file",
    "write_items", "write_rank",
]


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
        with gc_paused():  # a record per fragment, nothing cyclic (a durable async save pauses only this
            # and rank 0's assembly: its writes may wait minutes on the disk with the collector on)
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


def prepare_collective(group: Group, path: str, overwrite: bool, target: CommitTarget | None = None,
                       storage_options: dict[str, Any] | None = None) -> CommitTarget:
    """Collective: make ``target`` (default: a :class:`~unickpt.engine.targets.SharedDirectory`,
    which rank 0 claims) ready at ``path``; every rank learns where to write
    (``target.storage``). Raises the same :class:`SaveError` on every rank when it cannot."""
    target = target if target is not None else SharedDirectory()
    target.prepare(group, path, overwrite, storage_options)
    return target


# ---------------------------------------------------------------- the commit


def commit(group: Group, report: RankReport, target: CommitTarget, metadata: dict[str, Any]) -> None:
    """Collective: gather every rank's report to rank 0, which checks them and publishes
    the manifest through ``target`` (the target's own way: swapping a staging directory
    in, or writing into each machine's directory), or, when any rank failed, aborts
    (removing what the save wrote); raises the same error on every rank if any rank
    failed, else every rank finishes its part of the target (``target.finish``)."""
    gathered = gather_bytes(group, report.message(), 0)
    outcome = Outcome()
    if gathered is not None:
        try:
            with gc_paused():  # every rank's fragments in rows: thousands of small objects, none cyclic
                docs = manifest_document(gathered, group.size, metadata, target.indexed)
            outcome = Outcome(payload=target.publish(docs))
        except Exception as e:
            outcome = Outcome.of(e)
            target.give_up()
    outcome = outcome.shared(group)
    target.finish(group, outcome.payload)
