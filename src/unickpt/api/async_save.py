"""``async_save``: capture the state into host memory, write and commit in the background.

The machinery (staging buffers, channels, the background thread) is
:mod:`unickpt.engine.background_save`; this is its public entry point.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from ..engine.background_save import DEFAULT_CHANNEL, AsyncSaveHandle, start_save
from ..engine.save_options import SaveOptions
from ..format.manifest import DEFAULT_BLOCK_BYTES
from .incremental import open_base

__all__ = ["AsyncSaveHandle", "async_save"]


def async_save(
    state_dict: dict[str, Any],
    path: str,
    *,
    process_group: Any = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    threads: int = 4,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    max_staging_bytes: int | None = None,
    lazy: bool = False,
    storage_options: dict[str, Any] | None = None,
    base: str | os.PathLike | None = None,
    channel: str = DEFAULT_CHANNEL,
    options: SaveOptions | None = None,
) -> AsyncSaveHandle:
    """Save ``state_dict`` to ``path`` like :func:`unickpt.save`, returning once the state
    is captured; a background thread writes this rank's file and the commit follows.

    Collective: every rank of ``process_group`` calls it. If a save of the same
    ``channel`` is still in flight, it first waits for it (one save at a time per channel;
    its error stays with its own handle). A save on another channel (its own staging
    buffer, its own gloo group) neither waits for it nor is waited for: the snapshot tier
    uses channel ``"snapshot"`` so that a snapshot never waits for a durable save.
    The bytes to write are copied into one host buffer kept for the next saves (pinned
    when the tensors are on CUDA; device copies are ``non_blocking`` on a side stream
    with one synchronize), so host memory stays at one copy of this rank's shard.
    ``max_staging_bytes`` caps that buffer: a larger shard is staged and written in
    batches (stage a part, write it, stage the next), and the call returns when the last
    batch is staged. The background traffic uses a dedicated gloo group, so training
    collectives may run meanwhile.

    ``lazy=True`` returns at once and copies in the background while training goes on.
    Contract: the saved values are those the tensors hold at the call; the caller must
    not modify them in place until ``handle.wait_staged()`` returns. Forward and backward
    only read parameters and optimizer state, so call ``wait_staged()`` right before
    ``optimizer.step()`` (and before zeroing or editing anything that is saved).

    ``path`` may be a URL with ``storage_options``, as for :func:`unickpt.save`.
    ``base`` makes the save incremental, as for :func:`unickpt.save`. CPU tensors are
    hashed in the call (xxh3-128, faster than the copy it spares) and only those that
    changed are staged and written; CUDA tensors, and every tensor of a ``lazy`` save, are
    staged and then hashed in the background.

    Returns an :class:`AsyncSaveHandle`; ``handle.result()`` raises the save's failure.
    Errors in the arguments (bad ``block_bytes``, a committed checkpoint at ``path``
    without ``overwrite``) are raised here.

    Args:
        state_dict: What to save, as for :func:`unickpt.save`.
        path: The checkpoint's directory or URL.
        process_group: The group saving together, as for :func:`unickpt.save`.
        metadata: Plain values for the manifest.
        overwrite: Replace a committed checkpoint at ``path`` once this one commits.
        threads: Writer threads (or ``options``).
        block_bytes: The checksum block (or ``options``).
        max_staging_bytes: A cap on the host staging buffer (or ``options``).
        lazy: Return at once; copy in the background (see the contract above).
        storage_options: Options of a URL's file system (fsspec).
        base: An earlier checkpoint: save incrementally against it.
        channel: The saver to use (one save in flight per channel).
        options: The write options as one :class:`~unickpt.SaveOptions` (instead of
            ``threads``, ``block_bytes`` and ``max_staging_bytes``).

    Returns:
        An :class:`AsyncSaveHandle` (future-like: ``result()``, ``done()``, ``exception()``).

    Raises:
        SaveError: A bad option, or a committed checkpoint at ``path`` without
            ``overwrite`` (the save's own failures come from ``handle.result()``).
    """
    opts = SaveOptions.merged(options, {"threads": threads, "block_bytes": block_bytes,
                                        "max_staging_bytes": max_staging_bytes}).group
    opener = None if base is None else partial(open_base, os.fspath(base), str(path))
    return start_save(state_dict, path, opts, process_group=process_group, metadata=metadata, overwrite=overwrite,
                      lazy=lazy, storage_options=storage_options, base=opener, channel=channel)
