"""Each step given once to a trainer's loggers and reporters, across re-formings.

Live recovery re-forms a job in the same processes: the fit resumes from the newest
snapshot and re-does the steps after it, which a logger or reporter built once per process
(Lightning's loggers, the reporters a Hugging Face Trainer's ``report_to`` builds over the
same folder or run) was already given. Per checkpoint root, this module records the newest
step this process's loggers were given; after a restore the integrations pass on no step up
to the newest one any rank recorded (the new rank 0 may be a process that logged nothing),
so the first values of a re-done step stand.

A trainer that snapshots a step before its loggers get it (Lightning saves in
``on_train_batch_end``, then logs) holds the step's log entry here until the next step
replaces it: after a re-forming that restores that very step, an entry no rank's logger
was given is given then (the step is not re-done, so nothing else would give it).
"""

from __future__ import annotations

import struct
from typing import Any

import torch.distributed as dist

from ..dist import all_gather_fixed, resolve_group

# per checkpoint root: the newest step this process's loggers were given
_LOGGED: dict[str, int] = {}
# per checkpoint root: (training step, its log entry) of the newest step snapshotted before it was logged
_HELD: dict[str, tuple[int, Any]] = {}


def agreed_floor(root: str, restored: bool) -> int:
    """The newest step a logger of any rank's process was given for ``root`` before this
    restore (-1 when nothing was restored, or nothing given). Collective when a process
    group exists: every rank calls it at the same point (after the restore)."""
    given = _LOGGED.get(root, -1) if restored else -1
    if dist.is_initialized():
        given = max(struct.unpack("<q", b)[0] for b in all_gather_fixed(resolve_group(), struct.pack("<q", given)))
    return given


def passes(root: str, floor: int, step: int | None) -> bool:
    """Whether a logger is given ``step`` (one above ``floor``, or no step at all), recorded
    as given for ``root`` when it is."""
    if step is None:
        return True
    if step <= floor:
        return False
    _LOGGED[root] = max(_LOGGED.get(root, -1), step)
    return True


def hold(root: str, step: int, entry: Any) -> None:
    """Keep ``entry`` (what the loggers are to be given for training step ``step``; None:
    nothing) for ``root``, replacing the previous step's, before ``step`` is snapshotted."""
    _HELD[root] = (step, entry)


def take(root: str, step: int) -> Any:
    """The entry held for ``root`` if it is training step ``step``'s (then no longer held),
    else None."""
    held = _HELD.get(root)
    if held is None or held[0] != step:
        return None
    del _HELD[root]
    return held[1]
