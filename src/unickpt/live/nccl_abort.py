"""Aborting a dead generation's NCCL communicators off the re-forming's critical path.

torch's ``_abort_process_group()`` aborts every communicator of the process (within one
``ncclGroupStart``/``ncclGroupEnd``, so that the aborts cannot deadlock each other) and
only then forgets the groups. On an H200 that abort is nearly the whole re-forming
(1.17-1.23 s: NCCL's proxy threads join on a 500 ms tick). The survivors need none of it
to go on: the next generation forms a fresh communicator under its own store prefix. So
the groups are forgotten here at once (torch's registry emptied as its abort empties it)
and the communicators are aborted in a background thread while the new group forms.

The aborting threads are joined before the process exits (:func:`join_aborts`): a
communicator half aborted when the interpreter finalizes can hang the exit.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..logs import log

__all__ = ["abort_in_background", "join_aborts", "pending_aborts"]

_THREADS: list[threading.Thread] = []
_REGISTRY = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg", "pg_coalesce_state")


def _forget_groups() -> list[Any] | None:
    """Empty torch's registry of process groups (the default one included), as its own
    ``_abort_process_group()`` does after aborting; return the groups, newest first (the
    order torch aborts them in). None when this torch lacks one of the pieces: the caller
    aborts synchronously instead."""
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    update = getattr(c10d, "_update_default_pg", None)
    unregister = getattr(c10d, "_unregister_all_process_groups", None)
    if world is None or update is None or unregister is None or not all(hasattr(world, n) for n in _REGISTRY):
        return None
    groups = sorted(world.pg_names, key=lambda pg: world.pg_names[pg], reverse=True)
    update(None)
    for name in _REGISTRY:
        getattr(world, name).clear()
    unregister()
    world.group_count = 0  # the next generation's groups get the same names in every process
    return groups


def _abort(groups: list[Any], grouped: Any) -> None:
    """Abort ``groups`` in one NCCL group call (``grouped``: the default group's NCCL
    backend, or None); a failure is logged, never raised (the groups are dead already)."""
    try:
        if grouped is not None:
            grouped._group_start()
        for pg in groups:
            try:
                pg.abort()
            except RuntimeError as e:
                log.debug(f"unickpt: aborting an old process group: {e}")
        if grouped is not None:
            grouped._group_end()
    except RuntimeError as e:
        log.debug(f"unickpt: aborting the old communicators: {e}")


def abort_in_background() -> bool:
    """Forget every process group of this process now and abort their communicators in a
    background thread; returns False (nothing done) when torch's registry does not have
    the expected shape, or no default group exists: the caller then aborts synchronously
    (``dist.distributed_c10d._abort_process_group()``)."""
    if not dist.is_initialized():
        return False
    default = dist.group.WORLD
    try:
        backend = default._get_backend(torch.device("cuda"))
    except RuntimeError:
        backend = None
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    grouped = backend if nccl is not None and isinstance(backend, nccl) else None
    groups = _forget_groups()
    if groups is None:
        return False
    thread = threading.Thread(target=_abort, args=(groups, grouped), name="unickpt-abort-old-groups", daemon=True)
    thread.start()
    _THREADS.append(thread)
    return True


def pending_aborts() -> int:
    """How many background aborts are still running."""
    _THREADS[:] = [t for t in _THREADS if t.is_alive()]
    return len(_THREADS)


def join_aborts(timeout: float = 10.0) -> int:
    """Wait (up to ``timeout`` s in all) for the background aborts; returns how many are
    still running (logged: the process may hang at exit on them)."""
    deadline = time.monotonic() + timeout
    for thread in list(_THREADS):
        thread.join(max(0.0, deadline - time.monotonic()))
    left = pending_aborts()
    if left:
        log.warning(f"unickpt: {left} abort(s) of old NCCL communicators still running after {timeout:.0f} s")
    return left
