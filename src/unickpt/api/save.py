"""``save``: every rank writes the fragments it owns, rank 0 commits the manifest last.

The protocol every writer follows lives in :mod:`unickpt.engine.commit`; this module is
its synchronous entry point: :func:`stage` (capture the state) then
:func:`write_and_commit`.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from ..dist import Group, resolve_group
from ..engine.collect import collect
from ..engine.commit import (Written, check_not_committed, commit, describe, prepare_collective, write_items,
                             write_rank)
from ..engine.commit import checkpoint_file  # noqa: F401  (api.checkpoints names it from here)
from ..engine.gc_pause import gc_paused
from ..engine.save_options import SaveOptions
from ..engine.staged_save import StagedSave
from ..engine.unchanged import split_unchanged
from ..format.manifest import DEFAULT_BLOCK_BYTES
from ..storage.base import Storage
from .incremental import open_base

__all__ = ["save"]


def stage(state_dict: dict[str, Any], staged: StagedSave) -> StagedSave:
    """Phase 1 of a save (collective): check the location and capture this rank's state
    into ``staged``. Nothing is written yet.

    After it returns, the caller may change the state freely. A failure on this rank is
    recorded and reported to every rank by :func:`write_and_commit`.
    """
    check_not_committed(staged.path, staged.overwrite, staged.storage_options, staged.group)
    try:
        staged.local, staged.error = collect(state_dict, staged.group), None
    except Exception as e:  # reported to rank 0, which fails the whole save
        staged.local, staged.error = None, describe(e)
    return staged


def _write(staged: StagedSave, storage: Storage) -> Written:
    """This rank's data file: what changed since the base (an incremental save), or all."""
    rank, local = staged.group.rank, staged.local
    assert local is not None
    to_write = local.to_write + local.rank_tensors
    opts = staged.options
    base = staged.base() if staged.base is not None else None
    refs: list = []
    if base is not None:
        changed, found = split_unchanged(base, to_write, rank, opts.block_bytes, opts.threads)
        refs = [(to_write[k], f) for k, f in found]
        to_write = [to_write[k] for k in changed]
    done = write_items(storage, rank, to_write, opts.block_bytes, opts.threads)
    return Written(refs + done.fragments, done.files, base)


def write_and_commit(staged: StagedSave, group: Group | None = None) -> int:
    """Phase 2 of a save (collective): claim the directory, write this rank's file, then
    rank 0 checks every rank's report and commits the manifest. Raises the same error on
    every rank if any rank failed. ``group`` overrides the group used to talk (async saves
    use their own). Returns the bytes this rank wrote."""
    group = group or staged.group
    target = prepare_collective(group, staged.path, staged.overwrite, storage_options=staged.storage_options)
    with target.given_up_on_failure():
        report = write_rank(staged.group.rank, staged.local, lambda: _write(staged, target.storage), staged.error)
        commit(group, report, target, staged.metadata)
    return sum(report.files.values())


@gc_paused()
def save(
    state_dict: dict[str, Any],
    path: str,
    *,
    process_group: Any = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    threads: int = 4,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    storage_options: dict[str, Any] | None = None,
    base: str | os.PathLike | None = None,
    options: SaveOptions | None = None,
) -> int:
    """Save ``state_dict`` to the checkpoint directory ``path``.

    Collective over ``process_group`` (default: the default group if initialised, else a
    single process): every rank calls it with its own shards. Each rank writes the
    fragments it owns to ``rank_XXXXX.safetensors``; rank 0 writes ``manifest.json``
    last, after every file is durable, and commits the whole directory at once (a
    checkpoint already at ``path`` is replaced only then, with ``overwrite=True``).
    Raises :class:`SaveError` on every rank if any rank failed; then nothing is
    committed, what the save wrote is removed, and an old checkpoint stays as it was.
    A second save to the same ``path`` while one runs fails at once.

    ``path`` may be a URL (``s3://bucket/run/step_5``, any fsspec file system) with
    ``storage_options`` for its file system: each rank uploads its file (multipart on S3)
    and the manifest, uploaded last, commits (docs/FORMAT.md); there an overwrite
    uncommits the old checkpoint first, and concurrent saves to one URL are not detected.
    ``base`` (an earlier checkpoint) makes the save incremental: a fragment whose bytes
    equal the base's (same xxh3-128 identity) is not written but referenced where its bytes
    lie, in the base or in a checkpoint the base references (docs/FORMAT.md, "Incremental
    checkpoints"). The result loads on its own, as long as those checkpoints are kept.

    Args:
        state_dict: What to save: tensors, DTensors, Stateful objects (modules,
            optimizers, schedulers, :class:`~unickpt.RNGState`), plain values,
            :class:`~unickpt.PerRank` and :class:`~unickpt.Sharded` entries, nested.
        path: The checkpoint's directory or URL.
        process_group: The group saving together (default: the default group if
            initialised, else a single process); every rank calls with its own shards.
        metadata: Plain values stored in the manifest.
        overwrite: Replace a committed checkpoint at ``path`` (only once the new one commits).
        threads: Threads writing this rank's file (or ``options``).
        block_bytes: The checksum block, a positive multiple of 8 (or ``options``).
        storage_options: Options of a URL's file system (fsspec).
        base: An earlier checkpoint: save incrementally against it.
        options: The write options as one :class:`~unickpt.SaveOptions` (instead of
            ``threads`` and ``block_bytes``).

    Returns:
        The bytes this rank wrote (its data file; less for an incremental save).

    Raises:
        SaveError: On every rank, when any rank failed (naming each rank and why), or a
            bad option, or a committed checkpoint at ``path`` without ``overwrite``.
    """
    opts = SaveOptions.merged(options, {"threads": threads, "block_bytes": block_bytes}).group
    opener = None if base is None else partial(open_base, os.fspath(base), str(path))
    staged = StagedSave(resolve_group(process_group), str(path), opts, overwrite, dict(metadata or {}), storage_options,
                        opener)
    stage(state_dict, staged)
    return write_and_commit(staged)
