"""The keepers' per-step commit on the job's c10d store: O(N) messages a step, not all-to-all.

A step's manifest may name a *control plane* (``snapshot.control``: the store's
``host:port`` and a key prefix the job's trainers drew for this Snapshotter). Then each
keeper, once it holds its data and parity of step S, sends the store three requests:

* ``compare_set P/sS/nJ`` (its record: a keeper started again in its place never counts
  twice),
* ``add P/sS/count 1``: the keeper whose add returns N completed the step: it appends S to
  the job's sequence of whole steps (``add P/nwhole 1`` -> i, ``set P/wI S``);

and every keeper has one thread blocked in ``wait P/w<next>`` (a wake-up per whole step,
no polling), which marks the step it reads whole. After that each keeper deletes its own
records, node 0 the counters and the sequence entries older than ``WINDOW``: the store
holds a bounded number of keys over a month-long run. Without a control plane (runs not
under ``unickpt launch`` and without ``$UNICKPT_SNAPSHOT_STORE``) the keepers tell each
other directly (``have``, all-to-all: fine for tens of nodes). See docs/SNAPSHOT.md.

What is read from the store is untrusted: a sequence entry that is not a step number is
skipped with a reason. No torch at import: the keeper imports ``torch.distributed`` only
when a step names a store.
"""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

STORE_ENV = "UNICKPT_SNAPSHOT_STORE"  # host:port of a TCPStore the keepers outlive no more than the job
LIVE_STORE_ENV = "UNICKPT_LIVE_STORE"  # set by `unickpt launch` (live.control.STORE_ENV): its launcher's store
PREFIX = "unickpt/snap/"
WINDOW = 8  # sequence entries of whole steps kept in the store
WAIT_S = 30.0  # a waiter blocked this long looks for the newest entry again (a keeper stopped a while)
_ADDRESS = re.compile(r"^[A-Za-z0-9.\-\[\]:]{1,253}:[0-9]{1,5}$")
_PREFIX = re.compile(r"^unickpt/snap/[A-Za-z0-9_.\-]{1,128}/[0-9a-f]{16}$")


def store_address() -> str | None:
    """The store the keepers commit on, as the trainers see it: ``$UNICKPT_SNAPSHOT_STORE``
    (``none``: the direct round), else the store of ``unickpt launch`` (node 0's launcher),
    else None."""
    named = os.environ.get(STORE_ENV)
    if named:
        return None if named.lower() == "none" else named
    return os.environ.get(LIVE_STORE_ENV) or None


def control_doc(address: str, job: str, token: bytes) -> dict[str, str]:
    """The ``control`` entry of a step's snapshot metadata: store address and key prefix."""
    return {"store": address, "prefix": f"{PREFIX}{re.sub(r'[^A-Za-z0-9_.-]', '_', job)[:128]}/{token.hex()}"}


def check_control(doc: Any) -> tuple[str, str] | str:
    """(address, prefix) of a manifest's ``control`` entry, or why it is refused."""
    if not isinstance(doc, dict) or not isinstance(doc.get("store"), str) or not isinstance(doc.get("prefix"), str):
        return "its control entry is not {store, prefix}"
    if not _ADDRESS.match(doc["store"]):
        return f"its control store {doc['store'][:80]!r} is not host:port"
    if not _PREFIX.match(doc["prefix"]):
        return f"its control prefix {doc['prefix'][:80]!r} is not unickpt/snap/<job>/<16 hex digits>"
    return doc["store"], doc["prefix"]


def connect(address: str, timeout_s: float = 60.0) -> Any:
    """A client connection to the TCPStore at ``host:port``."""
    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    return TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False, use_libuv=True)


class StoreCommit:
    """One keeper's side of the per-step commit under one prefix of one store.

    ``ops`` counts the requests this keeper sent (by name), so a test can hold them
    against the figures of bench/scale_snapshot.py."""

    def __init__(self, address: str, prefix: str, node: int, token: str,
                 connect_fn: Callable[[str], Any] = connect) -> None:
        self.address, self.prefix, self.node, self.token = address, prefix, node, token
        self.client = connect_fn(address)  # announcements and deletes
        self.waiter = connect_fn(address)  # blocked in wait (a client serves one request at a time)
        self.ops: Counter[str] = Counter()
        self.mine: set[int] = set()  # steps this keeper announced, records not yet deleted
        self.lock = threading.Lock()
        # the sequence entry the waiter waits for: from before this keeper's first announcement
        self.next = int(self._op("add", self._k("nwhole"), 0)) + 1
        self.seen = -1  # the newest whole step read
        self.closed = False  # replaced by a newer prefix: its waiter ends

    def _k(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _op(self, name: str, *args: Any) -> Any:
        self.ops[name] += 1
        return getattr(self.client, name)(*args)

    def announce(self, step: int, nodes: int) -> bool:
        """Say this node holds its data and parity of ``step``; True when that made the step
        whole (this keeper appended it to the sequence), False otherwise (also when this
        node's record was there already)."""
        with self.lock:
            self.mine.add(step)
        if self._op("compare_set", self._k(f"s{step}", f"n{self.node}"), "", self.token) != self.token.encode():
            return False
        if int(self._op("add", self._k(f"s{step}", "count"), 1)) != nodes:
            return False
        i = int(self._op("add", self._k("nwhole"), 1))
        self._op("set", self._k(f"w{i}"), str(step))
        return True

    def next_whole(self, log: Callable[[str], None]) -> int | None:
        """Block until the next whole step is appended and return it (None: an entry that is
        not a step number, skipped with a reason in the log, or a long wait, after which the
        waiter goes on from the newest entry: a keeper stopped a while may have missed some,
        and their window may be gone)."""
        name = self._k(f"w{self.next}")
        try:
            self.ops["wait"] += 1
            self.waiter.wait([name], timedelta(seconds=WAIT_S))
        except RuntimeError as e:
            if "timeout" not in str(e).lower():
                raise
            self.ops["add"] += 1
            self.next = max(self.next, int(self.waiter.add(self._k("nwhole"), 0)))
            return None
        self.ops["get"] += 1
        raw = self.waiter.get(name)
        self.next += 1
        text = raw.decode("ascii", "replace")
        if not text.isdigit() or len(text) > 18:
            log(f"the store's whole-step entry {name} holds {text[:40]!r}, not a step number: skipped")
            return None
        step = int(text)
        self.seen = max(self.seen, step)
        return step

    def forget(self, keep: Callable[[int], bool], whole_index: int | None = None, counts: bool = False) -> None:
        """Delete this keeper's records of the announced steps ``keep(step)`` rejects (node 0,
        or every keeper with ``counts``: their counters too; node 0: the sequence entries
        ``WINDOW`` behind ``whole_index``)."""
        with self.lock:
            drop = sorted(s for s in self.mine if not keep(s))
            self.mine.difference_update(drop)
        for s in drop:
            self._op("delete_key", self._k(f"s{s}", f"n{self.node}"))
            if self.node == 0 or counts:
                self._op("delete_key", self._k(f"s{s}", "count"))
        if self.node == 0 and whole_index is not None and whole_index > WINDOW:
            self._op("delete_key", self._k(f"w{whole_index - WINDOW}"))
