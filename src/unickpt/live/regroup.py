"""Tearing a generation down: the one place that knows every process-global thing a
generation leaves behind, so that the next one starts clean.

What a generation leaves, and who resets it:
- the sockets of every group made in it, whoever made it (torch's
  ``_new_process_group_helper`` is wrapped, see :func:`unickpt.dist.track_group_sockets`):
  shut down by :func:`cut`, so that a collective blocked on any of them fails at once;
- the caches of groups unickpt made (async-save and snapshot channels, replica groups,
  a DeviceMesh's flattened items): every one is a :func:`unickpt.dist.group_cache`,
  emptied by ``release_groups``;
- anything else a module keeps per generation registers its reset with
  :func:`unickpt.dist.on_teardown` and is reset here: the savers still in flight on the
  old groups are abandoned (no collective starts on their groups any more) before the
  cut, and their threads waited for after it (their collectives fail on the cut sockets),
  before any group is destroyed: a gloo collective queued on a group that is shut down
  waits forever, and the process would never exit;
- DTensor's sharding-propagation caches (:func:`forget_meshes`);
- torch's registry of groups: destroyed (gloo), or forgotten with the communicators
  aborted in the background (NCCL, :mod:`.nccl_abort`).

tests/test_live_regroup.py fails when a tear-down leaves any process group of the old
generation alive (a cache someone adds later included).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import store_client
from ..dist import (connected_to, links, open_sockets, opened_since, release_groups, run_teardown_hooks, shut_down,
                    shut_group_sockets)
from ..store_client import LIVE_PG_TIMEOUT_ENV
from .control import key
from .nccl_abort import abort_in_background

__all__ = ["Rendezvous", "cut", "forget_meshes", "form", "teardown"]

DEFAULT_PG_TIMEOUT_S = 600.0  # a generation's collectives, where $UNICKPT_LIVE_PG_TIMEOUT is not set


class Rendezvous:
    """A generation's own connection to the job's store (at ``address``): its default group
    rendezvouses on it and keeps it, so the groups ``fn`` makes (a DeviceMesh's, NCCL's
    unique ids) rendezvous on it too. Another thread ends it: :meth:`abandon` while the
    group forms (a member was lost meanwhile: gloo's rendezvous would wait for that
    member's address until the generation's timeout), :meth:`cut` once it has formed (a
    store request of ``fn`` blocked on a lost peer's key). Either fails the blocked
    request at once (``DistNetworkError``)."""

    def __init__(self, address: str) -> None:
        self.before = open_sockets()
        self.store = store_client.connect(address)
        # (the watcher's and the beats' connections are made before: only this one is new)
        self.own = connected_to(opened_since(self.before), store_client.split_address(address)[1])
        self.abandoned = False

    def cut(self) -> None:
        """Shut this connection down (a request blocked on it fails, here only)."""
        shut_down(self.own, kept_too=True)

    def abandon(self) -> None:
        """While the group forms: shut this connection down, and every connection to a
        peer the group has made so far (its peers' rendezvous fail too)."""
        self.abandoned = True
        self.cut()
        shut_down(opened_since(self.before))


def form(store: Any, number: int, rank: int, size: int, backend: str | None = None) -> dict[int, str]:
    """Initialise generation ``number``'s default group on the job's ``store``, under the
    generation's own prefix (``g<N>/pg/``, never reused: no key of an earlier generation
    can mislead it); its collectives wait up to $UNICKPT_LIVE_PG_TIMEOUT seconds. Returns
    the group's connections to its peers (gloo's; none with NCCL), whose loss
    :func:`unickpt.dist.links_lost` tells."""
    prefixed = dist.PrefixStore(key("g", number, "pg") + "/", store)
    timeout = timedelta(seconds=float(os.environ.get(LIVE_PG_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT_S)))
    before = open_sockets()
    hook = sys.excepthook
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=size, timeout=timeout)
    # torch's hook prefixes a traceback's lines with "[rank<R>]: " of this generation, chained
    # to the last generation's: the launcher prefixes every line already (with the rank the
    # worker started as), so a traceback read "[rank2]: [rank1]: [rank1]: ..." after two re-formings
    sys.excepthook = hook
    return links(opened_since(before))


def cut() -> int:
    """Shut the generation's gloo sockets down: every group's, whoever made it (the
    default group, a DeviceMesh's, FSDP2's, unickpt's, the user's), so that a collective
    blocked on any of them fails at once here and in every peer, whoever still holds the
    group. Returns how many sockets were shut down."""
    return shut_group_sockets()


def teardown(crashed: bool, mark: Callable[[str], Any] | None = None) -> None:
    """Drop every process group of the generation and everything that holds one.
    ``crashed``: the generation ended by a failure or a re-forming (its collectives in
    flight are cut, its saves in flight abandoned, NCCL's communicators aborted, never
    destroyed); False when ``fn`` returned (everything finished: a plain destroy).
    ``mark("destroyed")`` is called once the groups are gone, before the collection
    (bench.mttr's phases)."""
    if crashed:
        run_teardown_hooks()  # the saves in flight abandoned: no collective starts on their groups
        cut()
        run_teardown_hooks(after_cut=True)  # their threads ended (their collectives fail on the cut sockets)
    release_groups(collect=False)
    forget_meshes()
    if dist.is_initialized():
        nccl = "nccl" in str(dist.get_backend())
        if nccl and crashed and not abort_in_background():
            _abort_now()  # this torch's registry is not the one abort_in_background knows
        if dist.is_initialized():
            dist.destroy_process_group()
    if mark is not None:
        mark("destroyed")
    gc.collect()  # FSDP2 states and meshes hold their groups through reference cycles (cheap: see freeze_heap)
    gc.freeze()  # what survived is alive: the next collection skips it (the modules fn imported, say)


def import_before_forming() -> None:
    """Import what a training ``fn`` imports lazily (FSDP2, DTensor) before the first
    generation's group forms: imported while a default group exists, torch 2.13's
    ``torch.distributed.fsdp`` keeps that group alive for the life of the process (found
    by tests/test_live_regroup.py: the group outlived its tear-down, held from no Python
    container the collector sees)."""
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401


def freeze_heap() -> None:
    """Move every object alive now into the cyclic collector's permanent generation
    (``gc.freeze``), before ``fn`` runs: the tear-down's ``gc.collect()``, which frees the
    reference cycles FSDP2 and DeviceMesh hold the old groups in, then scans only what
    ``fn`` made since (its model, its state, the modules it imported lazily), not the
    interpreter's whole heap (torch's modules alone: ~0.1 s, ~0.3-0.5 s with DTensor's
    imports, once per survivor and hop of the wake-up chain). The tear-down freezes
    what its collection left (all of it alive) too. The modules an FSDP2 or DTensor
    ``fn`` imports lazily (~75,000 objects) are imported first, so that they are frozen
    before the first failure, not scanned by its tear-down."""
    import_before_forming()  # (imported once)
    gc.collect()
    gc.freeze()  # (gc.get_freeze_count() walks the frozen heap: ~70 ms)


def _abort_now() -> None:
    """NCCL, where :func:`.nccl_abort.abort_in_background` cannot (another torch's
    registry): abort every communicator of the generation at once, here (a serial abort
    per group can deadlock); never destroy after a peer crash. Measured on an H200 by
    bench.gpu's 1-rank re-forming (about 1.2 s, nearly all of it this abort)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort()  # also forgets every group: no destroy follows
        except (RuntimeError, ValueError):
            pass


def forget_meshes() -> None:
    """Empty DTensor's caches that hold a device mesh: they key on meshes that compare
    equal by shape alone, so a process that sits elsewhere in an equal mesh of a re-formed
    world would get back a spec holding an old mesh, with its old coordinate (its shard
    read and written as another rank's); and a mesh holds its process groups
    (``_pg_registry``), so a cached one keeps the old generation's groups, their gloo
    threads and buffers, alive. torch 2.13 keeps such meshes in the sharding propagator's
    caches, the redistribute planners' (an optimizer step on FSDP2's DTensors fills it),
    the transform infos' and the mesh topologies': every ``functools`` cache of
    ``torch.distributed.tensor``'s modules and of their classes is emptied, so that a
    cache a later torch adds there is emptied too (tests/test_live_regroup.py)."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    propagator = module.DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        _clear(getattr(propagator, name, None))
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    planners = getattr(redistribute, "clear_redistribute_planner_cache", None)
    if planners is not None:
        planners()
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("torch.distributed.tensor"):
            continue
        for value in list(vars(mod).values()):
            _clear(value)
            if isinstance(value, type) and value.__module__ == name:
                for member in list(vars(value).values()):
                    _clear(getattr(member, "__func__", member))


def _clear(value: Any) -> None:
    """``value.cache_clear()`` where ``value`` is a ``functools`` cache (or torch's
    per-thread wrapper of one), not a class that defines such a method."""
    if isinstance(value, type):
        return
    cache_clear = getattr(value, "cache_clear", None)
    if callable(cache_clear) and hasattr(value, "cache_info"):
        cache_clear()
