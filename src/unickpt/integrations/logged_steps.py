"""Each step given once to a trainer's loggers and reporters, across re-formings.

Live recovery re-forms a job in the same processes: the fit resumes from the newest
snapshot and re-does the steps after it, which a logger or reporter built once per process
(Lightning's loggers, the reporters a Hugging Face Trainer's ``report_to`` builds over the
same folder or run) was already given. Per checkpoint root, this module records the newest
step this process's loggers were given; after a restore the integrations pass on no step up
to the newest one any rank recorded (the new rank 0 may be a process that logged nothing),
so the first values of a re-done step stand.
"""

from __future__ import annotations

import struct

import torch.distributed as dist

from ..dist import all_gather_fixed, resolve_group

# per checkpoint root: the newest step this process's loggers were given
_LOGGED: dict[str, int] = {}


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
