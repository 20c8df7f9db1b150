"""What a restore did, as a record, and the one line that says it (``CheckpointManager.
restore`` prints it on rank 0): ``resumed step S from memory (...)``, ``resumed step S
from disk (...)`` (``from disk + D logged steps``) or ``starting fresh (...)``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Restored"]


@dataclass(frozen=True)
class Restored:
    """The outcome of a restore: the step resumed (0 when fresh), from where, and why the
    newer sources were passed over; :meth:`line` renders it."""

    step: int
    source: str  # "memory", "disk" or "fresh"
    seconds: float
    detail: str = ""  # memory: how the step was read; disk: the checkpoint loaded
    skipped: str = ""  # memory: the newer steps passed over, and why
    memory: str | None = None  # disk, fresh: why memory was passed over (None: no snapshot tier)
    logged: int | None = None  # disk: steps of the delta log replayed on top of it
    nothing: str = "no checkpoint on disk"  # fresh: why the durable tiers gave nothing
    kept: tuple[str, ...] = ()  # per-rank entries left as they are (saved by another number of ranks)

    def line(self) -> str:
        """The restore line."""
        if self.source == "fresh":
            head, notes = "starting fresh", []
        else:
            logged = f" + {self.logged} logged steps" if self.source == "disk" and self.logged else ""
            head, notes = f"resumed step {self.step} from {self.source}{logged}", [self.detail]
        if self.skipped:
            notes.append(f"skipped: {self.skipped}")
        if self.memory is not None and self.source != "memory":
            notes.append(f"memory: {self.memory}")
        notes.append(self.nothing if self.source == "fresh" else f"{self.seconds:.2f} s")
        if self.kept:
            more = f" and {len(self.kept) - 3} more" if len(self.kept) > 3 else ""
            notes.append(f"per-rank state left as it is: saved by another number of ranks ({', '.join(self.kept[:3])}{more})")
        return f"{head} ({'; '.join(notes)})"
