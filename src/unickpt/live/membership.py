"""Membership: a worker's side of the generations on the job's store, as functions of a
store, so that the protocol runs (and is tested) on any store — the job's TCPStore, an
in-memory ``HashStore`` with ranks as threads (tests/test_live_membership.py), a pool of
connections simulating thousands of ranks (bench/scale_snapshot.py).

A generation's members gather before its process group forms (whose rendezvous would
wait for a member lost meanwhile): each says it arrived (``add``), the last one opens the
generation's ``go`` key, and every member waits for it (one wake-up). The coordinator
closes the key of a generation it replaces (:func:`.control.publish`): its members still
gathering go on to the newer one.
"""

from __future__ import annotations

from typing import Any

from ..store_client import wait_key
from . import control
from .control import Cause, Generation, key

__all__ = ["all_arrived", "arrive", "end_if_over", "newer", "say_arrived"]

GATHER_WAIT_S = 3600.0  # one wait for the go key: a wake-up, no polling (a newer generation closes it)


def say_arrived(store: Any, gen: Generation, multiple_of: int = 1) -> None:
    """Count this member of ``gen`` in; the last of its active members opens the ``go`` key."""
    if int(store.add(key("g", gen.number, "arrived"), 1)) == len(gen.active(multiple_of)):
        store.compare_set(key("g", gen.number, "go"), "", control.GO_ALL)


def all_arrived(store: Any, gen: Generation) -> bool:
    """Wait for ``gen``'s ``go`` key: every member arrived (True), or the coordinator
    published a newer generation first (False)."""
    go = key("g", gen.number, "go")
    while not wait_key(store, go, GATHER_WAIT_S):
        pass
    return store.get(go) == control.GO_ALL.encode()


def arrive(store: Any, gen: Generation, multiple_of: int = 1) -> bool:
    """A barrier of ``gen``'s members on the store; False when a newer generation was
    published while they gathered. Three requests a member (``add``, ``wait``, ``get``),
    one wake-up: O(members) for the store, however long the gathering takes."""
    say_arrived(store, gen, multiple_of)
    return all_arrived(store, gen)


def end_if_over(gen: Generation) -> None:
    """SystemExit with the job's code when ``gen`` says the job ended."""
    if gen.cause == Cause.END:
        from ..logs import log

        # information: every launcher prints the job's verdict as its last line (a warning
        # here said it a second time on the console, from each worker still waiting)
        log.info(f"unickpt: the job ended: {gen.reason}")
        raise SystemExit(gen.code if gen.code >= 0 else 1)


def newer(store: Any, worker: str) -> Generation:
    """The newest generation (``worker`` must be in it: SystemExit otherwise, or when the
    job ended)."""
    n = control.newest(store)
    gen = control.read(store, n)
    end_if_over(gen)
    if worker not in gen.members:
        raise SystemExit(f"unickpt: this worker ({worker}) was left out of generation {n}")
    return gen
