"""The options of :class:`unickpt.CheckpointManager`, grouped by what they configure, each
group a frozen dataclass that checks its own values when built (its ``check``), and the
two checks of values that belong to different groups (:func:`check_tiers`,
:func:`check_loop`). :class:`SnapshotOptions` lives with the snapshot tier that takes it
(:mod:`unickpt.snapshot.options`), :class:`SaveOptions` with the writers
(:mod:`unickpt.engine.save_options`); both are exported here too.

Two ways to write the same configuration, never both for one group::

    CheckpointManager("ckpt", save_every=50, async_save=True, snapshot_every=1, parity=1)
    CheckpointManager("ckpt", saves=SaveSchedule(every=50, mode="async"),
                      snapshot=SnapshotOptions(every=1, parity=1))

An error names what the user wrote: the flat keyword (``snapshot_every``) or the group's
field (``SnapshotOptions.every``), the value and what is allowed. The manager turns what it
was given into the groups once (:meth:`~unickpt.engine.save_options.Checked.merged`) and keeps
only the groups (:class:`ManagerOptions`); the flat keywords go no further.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..engine.save_options import Checked, Given, SaveOptions, Spelling, at_least_one, flag, whole
from ..snapshot.options import SnapshotOptions
from ..storage.open import is_remote

__all__ = ["CheckpointsOptions", "DeltaDtype", "DeltaLogOptions", "DurableOptions", "ManagerOptions", "SaveMode",
           "SaveOptions", "SaveSchedule", "SnapshotOptions", "check_loop", "check_tiers"]

SaveMode = Literal["sync", "async"]
"""How the manager's periodic checkpoints are written: in the loop, or in the background."""
DeltaDtype = Literal["exact", "bf16"]
"""How the delta log stores a step's changes: bitwise, or bf16 (half the bytes, a close replay)."""


@dataclass(frozen=True)
class SaveSchedule(Checked):
    """When and how the manager takes its durable checkpoints.

    Args:
        every: A checkpoint every ``every`` steps (0: only those forced).
            Flat keyword: ``save_every``.
        mode: ``"sync"`` writes in the loop; ``"async"`` stalls the loop only for the copy
            into host memory and writes in the background. Flat keyword: ``async_save``
            (True is ``"async"``).
        incremental: Each save after the first writes only what changed since the latest
            valid checkpoint (needs a local root and no durable tier).
        full_every: With ``incremental``, every ``full_every``-th save is a full one
            (None: only the first).

    Raises:
        UnickptError: A value out of range, or ``mode="async"`` without ``every``.
    """

    KEYWORDS: ClassVar[dict[str, str]] = {"every": "save_every", "mode": "async_save"}
    FLAT_VALUES: ClassVar[dict[str, dict[Any, Any]]] = {"mode": {"async": True, "sync": False}}

    every: int = 0
    mode: SaveMode = "sync"
    incremental: bool = False
    full_every: int | None = None

    @classmethod
    def check(cls, v: Any, said: Spelling) -> None:
        whole(v, said, "every")
        if v.mode not in ("sync", "async"):
            said.fail(f"{said.name('mode')} must be 'sync' or 'async', not {v.mode!r}")
        flag(v, said, "incremental")
        at_least_one(v, said, "full_every", optional=True)
        if v.mode == "async" and not v.every:
            said.fail(f"{said.said('mode', v.mode)} writes the checkpoints of {said.name('every')} in the background: "
                      f"set {said.name('every')} too (maybe_save(..., force=True) then saves in the background as well)")


@dataclass(frozen=True)
class DurableOptions(Checked):
    """The second, durable tier (an object store or another directory) that rank 0 copies
    checkpoints to in the background.

    Args:
        url: Where: a URL (``s3://bucket/run``) or a directory. Flat keyword: ``durable``.
        every: Copy every ``every``-th checkpoint (at least 1). Flat keyword: ``durable_every``.
        keep: Keep the newest ``keep`` there (None: all). Flat keyword: ``durable_keep``.
        storage_options: Options of its file system (fsspec). Flat keyword:
            ``durable_storage_options``.

    Raises:
        UnickptError: A value out of range.
    """

    KEYWORDS: ClassVar[dict[str, str]] = {"url": "durable", "every": "durable_every", "keep": "durable_keep",
                                          "storage_options": "durable_storage_options"}

    url: str | os.PathLike
    every: int = 1
    keep: int | None = None
    storage_options: dict[str, Any] | None = None

    @classmethod
    def check(cls, v: Any, said: Spelling) -> None:
        at_least_one(v, said, "every")
        at_least_one(v, said, "keep", optional=True)


@dataclass(frozen=True)
class DeltaLogOptions(Checked):
    """The per-step delta log: every step's applied changes, replayed after the last full
    checkpoint on a restore.

    Args:
        enabled: Log the steps. Flat keyword: ``log_deltas``.
        dtype: ``"exact"`` (a bitwise replay) or ``"bf16"`` (half the bytes, a close
            replay). Flat keyword: ``delta_dtype``.

    Raises:
        UnickptError: An unknown ``dtype``, or ``"bf16"`` with the log off.
    """

    KEYWORDS: ClassVar[dict[str, str]] = {"enabled": "log_deltas", "dtype": "delta_dtype"}

    enabled: bool = True
    dtype: DeltaDtype = "exact"

    @classmethod
    def check(cls, v: Any, said: Spelling) -> None:
        flag(v, said, "enabled")
        if v.dtype not in ("exact", "bf16"):
            said.fail(f"{said.name('dtype')} must be 'exact' or 'bf16', not {v.dtype!r}")
        if v.dtype != "exact" and not v.enabled:
            said.fail(f"{said.said('dtype', v.dtype)} is the delta log's: set {said.said('enabled', True)} too")


@dataclass(frozen=True)
class CheckpointsOptions:
    """What a :class:`~unickpt.Checkpoints` was configured with, grouped (each group
    checked when built): the save schedule (its ``incremental`` and ``full_every``) and the
    durable tier (None: none)."""

    saves: SaveSchedule
    durable: DurableOptions | None


@dataclass(frozen=True)
class ManagerOptions(CheckpointsOptions):
    """What a :class:`~unickpt.CheckpointManager` was configured with, grouped: besides the
    save schedule and the durable tier, the memory snapshots (None: off) and the delta log
    (None: off)."""

    snapshot: SnapshotOptions | None = None
    deltas: DeltaLogOptions | None = None


def check_tiers(root: str, saves: Given[SaveSchedule], durable: Given[DurableOptions] | None) -> None:
    """Values of the durable checkpoints that exclude each other across groups.

    Args:
        root: The fast tier's root (a directory or a URL).
        saves: The save schedule (its ``incremental``), as the user gave it.
        durable: The durable tier, if any.

    Raises:
        UnickptError: ``incremental`` on an object store or beside a durable tier.
    """
    if saves.group.incremental and (durable is not None or is_remote(root)):
        saves.fail(f"{saves.said('incremental', True)} needs a local root and no durable tier (incremental checkpoints "
                   "reference their bases by relative paths; an object store holds whole checkpoints)")


def check_loop(root: str, saves: Given[SaveSchedule], snapshot: Given[SnapshotOptions],
               deltas: Given[DeltaLogOptions]) -> None:
    """Values of the training loop's tiers that need each other across groups.

    Args:
        root: The fast tier's root (a directory or a URL).
        saves: The save schedule, as the user gave it.
        snapshot: The memory snapshots (``every`` 0: off).
        deltas: The delta log (``enabled`` False: off).

    Raises:
        UnickptError: A flush or a delta log on an object store, a delta log without
            periodic checkpoints.
    """
    if snapshot.group.flush_every and is_remote(root):
        snapshot.fail(f"{snapshot.name('flush_every')} needs a local root: the keepers write files "
                      "(use durable= for an object store)")
    if deltas.group.enabled:
        if not saves.group.every:
            deltas.fail(f"{deltas.said('enabled', True)} needs {saves.name('every')}: the log replays onto the last "
                        "full checkpoint")
        if is_remote(root):
            deltas.fail(f"{deltas.said('enabled', True)} needs a local root (the log's entries are files beside the "
                        "checkpoints)")
