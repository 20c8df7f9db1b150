"""Recovery at start: the newest whole and verified state, from memory or from disk.

Collective over the trainers (every rank calls :func:`recover`). The first local rank of
each node lists what its node's shm root holds (committed steps, rank files, parity);
rank 0 plans, newest step first:

* every file of the step is held by a surviving node (a process crash; or a relaunch on
  any layout): load it as it is;
* the files of at most ``m`` lost nodes are missing (``m`` the parity: XOR, Reed-Solomon
  or copies on neighbours): the plan says, for each parity group holding a lost stripe,
  which surviving data stripes and parity blocks decode it and where they are now;
  nothing is rebuilt ahead: the ranks that need a lost file's bytes decode exactly those,
  as they read them (:mod:`.degraded`);
* otherwise the step is skipped, and the reason kept.

The chosen step is loaded by every rank through the ordinary read plan
(:func:`unickpt.load` resharding onto the new layout, every block checksum verified, the
decoded bytes too), reading its node's files straight from its shm root, other nodes'
files from their keepers and lost files through degraded reads. A rebuilt byte that
fails its check has its input blocks checked to name the corrupt one.
Any failure on any rank rejects the step for all; the next source is tried, ending with
the durable tier (the newest valid checkpoint on disk). The result is one line:
``resumed step S from memory (...)`` / ``resumed step S from disk (...)`` / ``starting fresh (...)``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from ..dist import broadcast_bytes, first_said, gather_bytes
from ..errors import CorruptionError, UnickptError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..engine.restored import Restored
from ..storage.base import READ_RATE
from ..storage.local import memory_file_reader
from . import paths, wire
from .client import Snapshotter
from .degraded import DegradedReader, Peers, Source, diagnose
from .index_parts import IndexSource
from .recovery_plan import (MAX_ROUNDS, Record, inventory, manifest_sources, merge_reply, plan_candidates,
                            records_reply, records_wanted, summary, with_records)

LoadFn = Callable[[str, Any], int]


@dataclass
class Outcome:
    """What recovery did: the step resumed (0 when fresh), its source, what the log line
    says of it (:attr:`restored`, :attr:`line`) and what it cost."""

    restored: Restored
    tried: bool = False  # a memory load was attempted (when it failed, the job's state is partly overwritten)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: plan, prepare, load (of the last step tried)
    fetched: int = 0  # bytes this rank received from other nodes' keepers while loading the resumed step

    @property
    def step(self) -> int:
        """The step resumed (0 when fresh)."""
        return self.restored.step

    @property
    def source(self) -> str:
        """``"memory"``, ``"disk"`` or ``"fresh"``."""
        return self.restored.source

    @property
    def line(self) -> str:
        """The log line."""
        return self.restored.line()


def _gather_plans(snap: Snapshotter) -> tuple[list[dict[str, Any]], list[list[Any]], int]:
    """Collective: rank 0 plans from every node's summary (first round), the manifest copy
    of each step from one node (broadcast), and, when files were lost, the descriptions of
    the lost nodes' group members from a few parity records (second round, repeated while
    the replies name more lost nodes or fail; :mod:`.recovery_plan`); (plans, reasons,
    bytes gathered by rank 0) on every rank."""
    inv = inventory(snap) if snap.local_rank == 0 else None
    gathered = gather_bytes(snap.group, json.dumps(summary(inv) if inv is not None else None).encode(), 0)
    nodes: list[dict[str, Any]] = []
    ranks: list[int] = []  # the group rank each node's summary came from
    size = 0
    if gathered is not None:
        size = sum(map(len, gathered))
        for r, g in enumerate(gathered):
            d = json.loads(g)
            if d is not None:
                nodes.append(d)
                ranks.append(r)
    sources = _share(snap, {key: ranks[i] for key, i in manifest_sources(nodes).items()} if gathered is not None else None)
    for key, src in sorted(sources.items()):
        mine = snap.group.rank == src and inv is not None
        text = broadcast_bytes(snap.group, inv["steps"][key]["manifest"].encode() if mine else None, src).decode()
        if gathered is not None:
            size += len(text)
            nodes[ranks.index(src)]["steps"][key]["manifest"] = text
    records: dict[Record, dict[str, Any]] = {}
    reasons: list[list[Any]] = []
    for _ in range(MAX_ROUNDS):
        ask: dict[str, list[list[Any]]] = {}
        if gathered is not None:
            for (i, key, j), who in sorted(records_wanted(nodes, records).items()):
                ask.setdefault(str(ranks[i]), []).append([key, j, who])
        ask = _share(snap, ask if gathered is not None else None)
        if not ask:
            break
        got = gather_bytes(snap.group, json.dumps(records_reply(inv, ask.get(str(snap.group.rank), []))).encode(), 0)
        if got is None:
            continue
        size += sum(map(len, got))
        for r, asked in ask.items():
            i = ranks.index(int(r))
            try:
                reply = json.loads(got[int(r)])
            except ValueError:
                reply = None
            for n, (key, j, who) in enumerate(asked):
                rec = reply[n] if isinstance(reply, list) and n < len(reply) else None
                why = merge_reply(records, (i, key, j), who, rec)
                if why:
                    reasons.append([int(key), f"node {nodes[i]['node']}'s parity record {j}: {why}"])
    plans: list[dict[str, Any]] = []
    if gathered is not None:
        plans, more = plan_candidates(with_records(nodes, records))
        reasons += more
    plans, reasons, size = _share(snap, [plans, reasons, size])
    return plans, reasons, size


# -- reading a snapshot spread over nodes ---------------------------------------------
class RemoteReader:
    """A file held by another node, read by ranges from its keeper (on the storage's
    pooled connections: the load's threads read in parallel)."""

    def __init__(self, peers: Peers, node: int, path: str, size: int) -> None:
        self.peers, self.node, self.rel, self.size = peers, node, path, size

    def pread_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``."""
        self.peers.read_views(self.node, {"op": "read", "path": self.rel, "offset": offset}, [out])

    def preadv_into(self, offset: int, views: list[memoryview]) -> None:
        """Fill the buffers one after the other from ``offset`` on (one request)."""
        self.peers.read_views(self.node, {"op": "read", "path": self.rel, "offset": offset}, views)

    def close(self) -> None:
        """Nothing to release (the connections belong to the storage)."""


class SnapshotStorage:
    """The files of one snapshot as ``load`` reads them: this node's from its shm root,
    the others' from their keepers, a lost node's decoded from its parity groups as they
    are read (:mod:`.degraded`)."""

    read_rate = READ_RATE["keeper"]  # most bytes come from other nodes' keepers (load's rule for sharing replicas)

    def __init__(self, snap: Snapshotter, plan: dict[str, Any], manifest: Manifest | None = None) -> None:
        self.snap, self.where = snap, plan["where"]
        self.peers = Peers(snap.table, snap.secret)
        if manifest is None:  # the root, parsed once for the load; its index lines read from the nodes keeping them
            manifest = Manifest.from_json(plan["manifest"], IndexSource(plan, snap.node, snap.jdir, self.peers))
        self.manifest = manifest
        self.sizes = {name: int(size) for name, size in manifest.files.items()}
        self.source = Source(self.peers, snap.node, snap.jdir, int(plan["step"]))
        self.rebuild = plan["rebuild"]
        rb = self.rebuild or {"lost": [], "info": {}}
        self.lost = {name: int(x) for x in rb["lost"] for name, _ in rb["info"][str(x)]["files"]}
        self._readers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def reader(self, name: str):
        """A positional reader of file ``name`` (shared by load's threads)."""
        with self._lock:
            return self._reader(name)

    def _reader(self, name: str):
        r = self._readers.get(name)
        if r is None:
            if name in self.where:
                node, rel = self.where[name]
                if node == self.snap.node:
                    r = memory_file_reader(Path(self.snap.jdir) / rel)
                else:
                    r = RemoteReader(self.peers, node, rel, self.sizes[name])
            elif name in self.lost:
                r = DegradedReader(self.source, self.rebuild, self.lost[name], name)
            else:
                raise CorruptionError(f"data file {name} of the snapshot is held by no surviving node")
            self._readers[name] = r
        return r

    def close(self) -> None:
        """Close every reader and connection."""
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self.peers.close()


# -- the collective procedure ---------------------------------------------------------
def _agree(snap: Snapshotter, error: str | None) -> str | None:
    """Collective: the first rank's error (the same on every rank), or None."""
    first = first_said(snap.group, error or "")
    return first[1] if first is not None else None


def _share(snap: Snapshotter, doc: Any) -> Any:
    """Collective: rank 0's JSON document on every rank."""
    return json.loads(broadcast_bytes(snap.group, json.dumps(doc).encode() if snap.group.rank == 0 else None, 0))


def _reset_keeper(snap: Snapshotter, keep_upto: int) -> None:
    """This node's keeper forgets and deletes every snapshot newer than ``keep_upto``."""
    if snap.local_rank != 0 or snap.keeper is None:
        return
    conn = wire.Connection(snap.keeper["host"], int(snap.keeper["port"]), snap.secret)
    try:
        conn.request({"op": "reset", "keep_upto": keep_upto})
    finally:
        conn.close()


def _try_step(snap: Snapshotter, plan: dict[str, Any], load: LoadFn,
              timings: dict[str, float]) -> tuple[int | None, str, int]:
    """Load one planned step (a lost node's bytes decoded as they are read); (step, how,
    bytes received from other nodes' keepers) or (None, why not, bytes)."""
    step = plan["step"]
    t0 = time.perf_counter()
    rdir = os.path.join(snap.jdir, f"recover_{step:08d}")
    error, storage, fetched = None, None, 0
    if snap.local_rank == 0:
        try:
            paths.clear(rdir)  # whatever a killed recovery (or anything else) left there
            os.makedirs(rdir)
            with open(os.path.join(rdir, MANIFEST_NAME), "w") as f:
                f.write(plan["manifest"])
        except OSError as e:
            error = f"cannot prepare {rdir}: {e}"
    error = _agree(snap, error)  # the manifest is in place on every node
    t1 = time.perf_counter()
    if error is None:
        try:
            storage = SnapshotStorage(snap, plan, None)
            got = load(rdir, storage)
            if got != step:
                error = f"the snapshot says step {got}, its directory step {step}"
        except UnickptError as e:  # the step names the snapshot: not the scratch directory it was read through
            error = str(e).removeprefix(f"{rdir}: ")
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            if storage is not None:
                fetched = storage.peers.received
                storage.close()
        error = _agree(snap, error)
    timings.update(prepare=t1 - t0, load=time.perf_counter() - t1)
    if error is not None and plan["rebuild"] is not None:
        error = _diagnosed(snap, plan) or error
    if snap.local_rank == 0:
        paths.clear(rdir)
    if error is not None:
        return None, error, fetched
    if plan["rebuild"] is None:
        return step, f"all {plan['files']} files held by the surviving nodes, checksums verified", fetched
    rb = plan["rebuild"]
    lost, held = rb["lost"], rb["nodes"] - len(rb["lost"])
    who = f"node {lost[0]}" if len(lost) == 1 else f"nodes {', '.join(map(str, lost))}"
    verb = "fetched from" if int(rb["k"]) == 1 else "decoded from"  # nothing is rebuilt ahead of the load
    return step, (f"{who} of {rb['nodes']} lost: {'its' if len(lost) == 1 else 'their'} files {verb} "
                  f"{rb['how']} during the load on {held} node{'s' if held != 1 else ''}, every chunk's crc32c verified"), fetched


def _diagnosed(snap: Snapshotter, plan: dict[str, Any]) -> str | None:
    """Collective, after a failed load of a rebuilt step: rank 0 names the corrupt input
    block (a parity block or data stripe failing its own crc32c), or None."""
    why = None
    if snap.group.rank == 0:
        peers = Peers(snap.table, snap.secret)
        try:
            why = diagnose(plan["rebuild"], Source(peers, snap.node, snap.jdir, int(plan["step"])))
        except UnickptError as e:
            why = str(e)
        finally:
            peers.close()
    return _share(snap, why)


def recover(snap: Snapshotter, load: LoadFn, disk: Callable[[], tuple[int, str] | None] | None = None,
            disk_step: int | None = None) -> Outcome:
    """Resume from the newest whole, verified state (collective); see the module docstring.

    ``load(path, storage)`` loads the checkpoint at ``path`` (its files through
    ``storage``, its manifest already parsed: ``storage.manifest``, to pass to
    :func:`unickpt.load`) into the job and returns the step it holds. ``disk()`` resumes from the
    durable tier and returns (step, path), or None when it holds nothing; ``disk_step``,
    the step of the durable tier's newest checkpoint, makes older snapshots lose to it."""
    t0 = time.perf_counter()
    plans, reasons, _ = _gather_plans(snap)  # reasons: [step, why] of every step not resumed and every copy left out
    timings: dict[str, float] = {"plan": time.perf_counter() - t0}
    step: int | None = None
    for plan in plans:
        if disk_step is not None and plan["step"] < disk_step:
            reasons.append([plan["step"], f"older than step {disk_step} on disk"])
            break
        step, how, fetched = _try_step(snap, plan, load, timings)
        if step is not None:
            _reset_keeper(snap, step)
            took = time.perf_counter() - t0
            skipped = _reasons(reasons, step)
            return Outcome(Restored(step, "memory", took, how, skipped), True, timings, fetched)
        reasons.append([plan["step"], how])
    why = _reasons(reasons, 0) or "no snapshot in memory"
    got = disk() if disk is not None else None
    if got is not None:
        step, path = got
        _reset_keeper(snap, step)
        took = time.perf_counter() - t0
        return Outcome(Restored(step, "disk", took, path, memory=why), bool(plans), timings)
    _reset_keeper(snap, 0)
    return Outcome(Restored(0, "fresh", time.perf_counter() - t0, memory=why), bool(plans), timings)


def _reasons(reasons: list[list[Any]], since: int) -> str:
    """The reasons about steps ``>= since``, newest step first, for the log line."""
    ordered = sorted((r for r in reasons if r[0] >= since), key=lambda r: -r[0])
    return "; ".join(f"step {s}: {why}" for s, why in ordered)
