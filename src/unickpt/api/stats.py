"""What a :class:`unickpt.CheckpointManager` did: one :class:`SaveRecord` per durable save,
and :class:`RunStats`, the one place the manager counts what it did and what failed (and
says so, once, on the ``unickpt`` logger)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..logs import log
from .options import SaveMode

__all__ = ["RunStats", "SaveRecord"]


@dataclass(frozen=True)
class SaveRecord:
    """One durable save of the manager, as this rank saw it.

    Attributes:
        step: The step saved.
        path: Where (the fast tier's checkpoint).
        mode: ``"sync"`` (written in the loop) or ``"async"`` (in the background).
        seconds: From the call to the commit (or the failure).
        stall_s: Of which the loop waited in the call (the whole save when sync).
        bytes: What this rank wrote (its data file; less for an incremental save); None
            when the save failed.
        error: Why the save failed, or None.
    """

    step: int
    path: str
    mode: SaveMode
    seconds: float
    stall_s: float
    bytes: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the save committed."""
        return self.error is None


@dataclass
class RunStats:
    """The manager's counters; each failure is counted and told here, and only here.

    Attributes:
        saves: Durable saves committed.
        saves_failed: Durable saves that failed (training went on).
        snapshots_failed: Snapshots the manager saw fail (the snapshot tier counts its own
            besides).
        delta_entries_failed: Delta log entries that could not be written.
        delta_steps_missed: Steps the delta log missed (``before_update`` not called).
        stall_s: Seconds the loop spent in ``before_update`` and ``maybe_save``.
        last_error: The last failure, as told.
        last_save: The last durable save's record.
    """

    saves: int = 0
    saves_failed: int = 0
    snapshots_failed: int = 0
    delta_entries_failed: int = 0
    delta_steps_missed: int = 0
    stall_s: float = 0.0
    last_error: str | None = None
    last_save: SaveRecord | None = None

    def saved(self, record: SaveRecord, speaks: bool) -> None:
        """Count a durable save (committed or failed) and tell it.

        Args:
            record: The save.
            speaks: True on the rank that tells (rank 0).
        """
        self.last_save = record
        if record.ok:
            self.saves += 1
            if speaks:
                log.info("unickpt: %s", record)
        else:
            self.failed("saves_failed", f"checkpoint of step {record.step} failed, training goes on: {record.error}",
                        speaks)

    def failed(self, counter: str | None, message: str, speaks: bool) -> None:
        """Count a failure (``counter``: the field counting it, None: counted elsewhere) and
        tell it: a warning on the ``unickpt`` logger from the rank that ``speaks``.

        Args:
            counter: The field to add one to, or None.
            message: What failed, one sentence; kept in :attr:`last_error`.
            speaks: True on the rank that tells (rank 0).
        """
        if counter is not None:
            setattr(self, counter, getattr(self, counter) + 1)
        self.last_error = message
        if speaks:
            log.warning("unickpt: %s", message)

    def as_dict(self) -> dict[str, Any]:
        """Returns:
            The counters as plain values (``last_save`` a dict or None)."""
        return asdict(self)
