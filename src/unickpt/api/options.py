"""The options of :class:`unickpt.CheckpointManager`, grouped by what they configure, each
group a frozen dataclass that checks its own values (``__post_init__``), and the two
checks of values that belong to different groups (:func:`check_tiers`, :func:`check_loop`).

Two ways to write the same configuration, never both for one group::

    CheckpointManager("ckpt", save_every=50, async_save=True, snapshot_every=1, parity=1)
    CheckpointManager("ckpt", saves=SaveSchedule(every=50, mode="async"),
                      snapshot=SnapshotOptions(every=1, parity=1))

An error names what the user wrote: the flat keyword (``snapshot_every``) or the group's
field (``SnapshotOptions.every``), the value and what is allowed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..engine.save_options import Checked, SaveOptions
from ..errors import SnapshotError, UnickptError
from ..storage.open import is_remote

__all__ = ["DeltaDtype", "DeltaLogOptions", "DurableOptions", "SaveMode", "SaveOptions", "SaveSchedule",
           "SnapshotOptions", "check_loop", "check_tiers"]

SaveMode = Literal["sync", "async"]
"""How the manager's periodic checkpoints are written: in the loop, or in the background."""
DeltaDtype = Literal["exact", "bf16"]
"""How the delta log stores a step's changes: bitwise, or bf16 (half the bytes, a close replay)."""


def _whole(group: Checked, field: str) -> None:
    value = getattr(group, field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        group.fail(f"{group.name(field)} must be a whole number >= 0 (0: never), not {value!r}")


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

    every: int = 0
    mode: SaveMode = "sync"
    incremental: bool = False
    full_every: int | None = None

    def __post_init__(self) -> None:
        _whole(self, "every")
        if self.mode not in ("sync", "async"):
            self.fail(f"{self.name('mode')} must be 'sync' or 'async', not {self.mode!r}")
        if self.full_every is not None and (not isinstance(self.full_every, int) or self.full_every < 1):
            self.fail(f"{self.name('full_every')} must be at least 1, not {self.full_every}")
        if self.mode == "async" and not self.every:
            said = "async_save=True" if getattr(self, "_flat", False) else f"{self.name('mode')}='async'"
            self.fail(f"{said} writes the checkpoints of {self.name('every')} in the background: set "
                      f"{self.name('every')} too (maybe_save(..., force=True) then saves in the background as well)")


@dataclass(frozen=True)
class SnapshotOptions(Checked):
    """The in-memory snapshots: host shared memory held by a keeper process per node.

    Args:
        every: A snapshot every ``every`` steps (0: none). Flat keyword: ``snapshot_every``.
        parity: Parity blocks per group across nodes (None: 1, XOR; 0: local only;
            2 or more: Reed-Solomon).
        replicas: Full copies of each node's snapshot, its own included, on neighbour
            nodes (instead of parity). Flat keyword: ``snapshot_replicas``.
        flush_every: The keepers write every ``flush_every``-th snapshot as an ordinary
            checkpoint under the root (0: never; needs a local root).
        max_bytes: A cap on the host memory per node (None: half the shm file system).
            Flat keyword: ``snapshot_max_bytes``.
        stripes: The most nodes whose data one parity block covers (the code's ``k``;
            default 8): parity takes ``parity/k`` of the memory, and rebuilding a lost
            byte reads ``k`` bytes from ``k`` nodes. Flat keyword: ``snapshot_stripes``.

    Raises:
        SnapshotError: A value out of range, a snapshot option without ``every``, or
            ``replicas`` beside ``parity``.
    """

    KEYWORDS: ClassVar[dict[str, str]] = {"every": "snapshot_every", "replicas": "snapshot_replicas",
                                          "max_bytes": "snapshot_max_bytes", "stripes": "snapshot_stripes"}
    ERROR: ClassVar[type[UnickptError]] = SnapshotError

    every: int = 1
    parity: int | None = None
    replicas: int = 1
    flush_every: int = 0
    max_bytes: int | None = None
    stripes: int = 8

    def __post_init__(self) -> None:
        _whole(self, "every")
        _whole(self, "flush_every")
        if not isinstance(self.stripes, int) or self.stripes < 1:
            self.fail(f"{self.name('stripes')} must be at least 1, not {self.stripes}")
        if self.replicas < 1:
            self.fail(f"{self.name('replicas')} must be at least 1, not {self.replicas}")
        if self.parity is not None and self.parity < 0:
            self.fail(f"{self.name('parity')} must be >= 0, not {self.parity}")
        if not self.every:
            for field, value in (("parity", self.parity), ("flush_every", self.flush_every or None),
                                 ("max_bytes", self.max_bytes), ("replicas", self.replicas if self.replicas > 1 else None)):
                if value is not None:
                    self.fail(f"{self.name(field)}={value} configures the memory snapshots: set {self.name('every')} too")
        if self.replicas > 1 and self.parity:
            self.fail(f"{self.name('replicas')}={self.replicas} and {self.name('parity')}={self.parity} exclude each "
                      "other: a node's snapshot is protected by copies on neighbours or by parity, not both")
        if self.max_bytes is not None and self.max_bytes < 1:
            self.fail(f"{self.name('max_bytes')} must be positive, not {self.max_bytes}")


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

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            self.fail(f"{self.name('every')} must be at least 1, not {self.every}")
        if self.keep is not None and self.keep < 1:
            self.fail(f"{self.name('keep')} must be at least 1, not {self.keep}")


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

    def __post_init__(self) -> None:
        if self.dtype not in ("exact", "bf16"):
            self.fail(f"{self.name('dtype')} must be 'exact' or 'bf16', not {self.dtype!r}")
        if self.dtype != "exact" and not self.enabled:
            self.fail(f"{self.name('dtype')}={self.dtype!r} is the delta log's: set {self.name('enabled')}=True too")


def check_tiers(root: str, saves: SaveSchedule, durable: DurableOptions | None) -> None:
    """Values of the durable checkpoints that exclude each other across groups.

    Args:
        root: The fast tier's root (a directory or a URL).
        saves: The save schedule (its ``incremental``).
        durable: The durable tier, if any.

    Raises:
        UnickptError: ``incremental`` on an object store or beside a durable tier.
    """
    if saves.incremental and (durable is not None or is_remote(root)):
        saves.fail(f"{saves.name('incremental')}=True needs a local root and no durable tier (incremental checkpoints "
                   "reference their bases by relative paths; an object store holds whole checkpoints)")


def check_loop(root: str, saves: SaveSchedule, snapshot: SnapshotOptions | None, deltas: DeltaLogOptions | None) -> None:
    """Values of the training loop's tiers that need each other across groups.

    Args:
        root: The fast tier's root (a directory or a URL).
        saves: The save schedule.
        snapshot: The memory snapshots, if any.
        deltas: The delta log, if any.

    Raises:
        UnickptError: A flush or a delta log on an object store, a delta log without
            periodic checkpoints.
    """
    if snapshot is not None and snapshot.flush_every and is_remote(root):
        snapshot.fail(f"{snapshot.name('flush_every')} needs a local root: the keepers write files "
                      "(use durable= for an object store)")
    if deltas is not None and deltas.enabled:
        if not saves.every:
            deltas.fail(f"{deltas.name('enabled')}=True needs {saves.name('every')}: the log replays onto the last "
                        "full checkpoint")
        if is_remote(root):
            deltas.fail(f"{deltas.name('enabled')}=True needs a local root (the log's entries are files beside the "
                        "checkpoints)")
