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

import json
import os
import re
import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .. import store_client
from ..store_client import LIVE_STORE_ENV

STORE_ENV = "UNICKPT_SNAPSHOT_STORE"  # host:port of a TCPStore the keepers outlive no more than the job
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
    """A client connection to the TCPStore at ``host:port`` (the keepers' requests time out
    sooner than the trainers')."""
    return store_client.connect(address, timeout_s)


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
        from torch.distributed import DistStoreError  # torch is loaded: the client is a TCPStore

        name = self._k(f"w{self.next}")
        try:
            self.ops["wait"] += 1
            self.waiter.wait([name], timedelta(seconds=WAIT_S))
        except DistStoreError:  # the wait timed out (a lost store host is a DistNetworkError: raised)
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


class StoreFlush:
    """One durable flush of one step coordinated on the store (keys under ``P/f<step>/``),
    instead of the coordinator calling every keeper and each calling back: the coordinator
    ``set``s the staging directory, every keeper ``wait``s for it, copies its files and
    ``append``s its report (a JSON line) to one key; the report that completes the count,
    or says a keeper failed, sets ``done``; the coordinator ``wait``s for it and reads every
    report with one ``get``. O(N) requests for the whole flush, one connection per keeper
    for its life; the coordinator sends a constant number.

    What the store gives back is untrusted: a staging path or a report line that is
    malformed is refused with a reason (the flush then commits nothing)."""

    def __init__(self, address: str, prefix: str, step: int, connect_fn: Callable[[str], Any] = connect) -> None:
        self.base = f"{prefix}/f{step}"
        self.client = connect_fn(address)
        self.ops: Counter[str] = Counter()

    def _op(self, name: str, *args: Any) -> Any:
        self.ops[name] += 1
        return getattr(self.client, name)(*args)

    def publish(self, staging: str) -> None:
        """The coordinator: the staging directory every keeper copies its files into."""
        self._op("set", f"{self.base}/staging", staging)

    def staging(self, timeout_s: float) -> str:
        """A keeper: the staging directory, once the coordinator published it (a RuntimeError
        after ``timeout_s``)."""
        self._op("wait", [f"{self.base}/staging"], timedelta(seconds=timeout_s))
        return self._op("get", f"{self.base}/staging").decode("utf-8", "replace")

    def report(self, report: dict[str, Any], nodes: int) -> None:
        """Every keeper (the coordinator too): its report, and ``done`` when it is the last
        or a failure."""
        line = json.dumps({f: report.get(f) for f in ("node", "files", "error")}) + "\n"
        self._op("append", f"{self.base}/reports", line)
        if int(self._op("add", f"{self.base}/count", 1)) >= nodes or report.get("error"):
            self._op("set", f"{self.base}/done", "1")

    def reports(self, timeout_s: float) -> dict[int, dict[str, Any]]:
        """The coordinator: every report sent (node -> report) once ``done`` is set, or those
        sent by ``timeout_s``; a malformed line is a report with an error."""
        from torch.distributed import DistStoreError  # torch is loaded: the client is a TCPStore

        try:
            self._op("wait", [f"{self.base}/done"], timedelta(seconds=timeout_s))
        except DistStoreError:  # timed out: the reports sent by then
            pass
        if not self._op("check", [f"{self.base}/reports"]):
            return {}
        out: dict[int, dict[str, Any]] = {}
        for n, line in enumerate(self._op("get", f"{self.base}/reports").decode("utf-8", "replace").splitlines()):
            rep = _report(line)
            if isinstance(rep, str):
                out[-1 - n] = {"error": f"report line {n} in the store: {rep}"}
            else:
                out[rep["node"]] = rep
        return out

    def clear(self) -> None:
        """The coordinator, at the end: the flush's keys deleted."""
        for name in ("staging", "reports", "count", "done"):
            self._op("delete_key", f"{self.base}/{name}")


def _report(line: str) -> dict[str, Any] | str:
    """A keeper's flush report read back from the store, checked; or why it is refused."""
    try:
        rep = json.loads(line)
    except ValueError:
        return "not JSON"
    if not (isinstance(rep, dict) and type(rep.get("node")) is int and rep["node"] >= 0
            and isinstance(rep.get("files"), list)
            and all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and type(f[1]) is int for f in rep["files"])
            and (rep.get("error") is None or isinstance(rep["error"], str))):
        return "not a report {node, files, error}"
    return rep
