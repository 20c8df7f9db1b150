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

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from ..dist import broadcast_bytes, gather_bytes
from ..errors import CorruptionError, SnapshotError, UnickptError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..engine.restored import Restored
from ..storage.base import READ_RATE
from ..storage.local import memory_file_reader
from . import paths, wire
from .client import Snapshotter
from .degraded import DegradedReader, Peers, Source, diagnose
from .index_parts import IndexSource
from .parity import code_name, group_of, members, open_record

LoadFn = Callable[[str, Any], int]
MISSING = "missing"  # a node's copy of a step's manifest, when it holds rank files of the step


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


# -- what a node holds ------------------------------------------------------------------
def inventory(snap: Snapshotter) -> dict[str, Any]:
    """This node's snapshots: each step's copy of the manifest (checked), rank files and
    parity records (checked). Every byte of the shm root is untrusted: a copy or record
    that is unreadable, malformed or fails its digest is left out, and the reason kept
    (``bad``: the manifest copy's, ``notes``: the parity records')."""
    steps: dict[str, Any] = {}
    for step in paths.steps(snap.jdir):
        sdir = paths.step_dir(snap.root, snap.job, step)
        if not os.path.isdir(sdir) or os.path.islink(sdir):
            continue
        files = {n: os.path.getsize(os.path.join(sdir, n)) for n in paths.data_files(sdir)}
        manifest, bad = _manifest_copy(sdir, step, snap.job)
        if manifest is None and bad is None and files:
            bad = MISSING
        entry: dict[str, Any] = {"files": files, "manifest": manifest, "bad": bad, "parity": [], "notes": [],
                                 "index": paths.index_files(sdir)}
        for name in paths.parity_metas(sdir):
            try:
                entry["parity"].append(_parity_record(sdir, name, step))
            except (OSError, UnickptError) as e:
                entry["notes"].append(f"node {snap.node}'s parity record {name}: {e}")
        steps[str(step)] = entry
    return {"node": snap.node, "steps": steps}


def _manifest_copy(sdir: str, step: int, job: str) -> tuple[str | None, str | None]:
    """(text, None) of a node's valid copy of a step's manifest; (None, why) when it is
    unreadable, malformed, fails its digest or describes another snapshot; (None, None)
    when there is none."""
    path = os.path.join(sdir, MANIFEST_NAME)
    if not os.path.lexists(path):
        return None, None
    try:
        raw = paths.read_regular(path)
        doc = Manifest.from_json(raw).metadata.get("snapshot")
        why = _snapshot_problem(doc, step, job)
        return (None, why) if why else (raw.decode("utf-8"), None)
    except UnickptError as e:
        return None, str(e)
    except (OSError, ValueError) as e:
        return None, f"unreadable: {e}"


def _snapshot_problem(doc: Any, step: int, job: str) -> str | None:
    """Why a manifest's ``snapshot`` metadata does not describe step ``step`` of ``job``
    as recovery reads it, or None."""
    if not isinstance(doc, dict):
        return "it describes no snapshot"
    if doc.get("step") != step or doc.get("job") != job:
        return f"it describes step {doc.get('step')!r:.20} of job {doc.get('job')!r:.40}, not step {step} of {job!r}"
    nodes = doc.get("nodes")
    if not (isinstance(nodes, list) and nodes and all(isinstance(n, dict) for n in nodes)
            and all(type(doc.get(f, 1)) is int and 0 <= doc.get(f, 1) <= len(nodes) for f in ("parity", "k"))):
        return "its nodes, parity or k are malformed"
    return None


def _parity_record(sdir: str, name: str, step: int) -> dict[str, Any]:
    """A parity record of a step, checked (digest, fields, that it is the record of its
    file name and step) together with its block (a regular file of the recorded size)."""
    meta = open_record(paths.read_regular(os.path.join(sdir, name), 1 << 26))
    if name != paths.parity_name(meta["group"], meta["r"], "json") or meta["step"] != step:
        raise SnapshotError(f"it describes block {meta['r']} of group {meta['group']} of step {meta['step']}")
    block = os.path.join(sdir, paths.parity_name(meta["group"], meta["r"], "bin"))
    if not os.path.isfile(block) or os.path.islink(block) or os.path.getsize(block) != meta["nbytes"]:
        raise SnapshotError(f"its block is missing, or not of its {meta['nbytes']} bytes")
    return meta


# -- planning (rank 0) ------------------------------------------------------------------
def plan_candidates(nodes: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """Steps that can be recovered, newest first, each with where every file is (or how
    to rebuild it); and ``[step, why]`` for every newer step that cannot be, and for every
    copy of a manifest or parity record that was left out."""
    committed = {int(s) for n in nodes for s, e in n["steps"].items() if e["manifest"] or e["bad"] not in (None, MISSING)}
    all_steps = sorted(committed, reverse=True)  # a step no node holds a manifest of was never committed
    plans, reasons = [], []
    for step in all_steps:
        key = str(step)
        held = [(n["node"], n["steps"][key]) for n in nodes if key in n["steps"]]
        notes = [f"node {node}'s copy of its manifest: {e['bad']}" for node, e in held if e["bad"]]
        notes += [note for _, e in held for note in e["notes"]]
        try:
            plan, why = _plan_step(step, nodes)
        except (KeyError, IndexError, TypeError, ValueError) as e:  # records that disagree with the manifest
            plan, why = None, f"its parity records do not match its manifest ({type(e).__name__}: {e})"
        if plan is None:
            reasons.append([step, why])
        else:
            plans.append(plan)
        reasons += [[step, note] for note in notes]
    return plans, reasons


# -- the two rounds of the gather (rank 0 plans from O(N) bytes when no node is lost) ----
def summary(inv: dict[str, Any]) -> dict[str, Any]:
    """What a node sends rank 0 first: its inventory with each manifest copy replaced by
    its digest and each parity record by ``[group, block, holder]`` (O(its files) bytes;
    the records, which list every member of a group, stay on the node until asked for)."""
    steps = {}
    for key, e in inv["steps"].items():
        digest = hashlib.sha256(e["manifest"].encode()).hexdigest() if e["manifest"] else None
        steps[key] = dict(e, manifest=digest, parity=[[m["group"], m["r"], m["holder"]] for m in e["parity"]])
    return {"node": inv["node"], "steps": steps}


def manifest_sources(nodes: list[dict[str, Any]]) -> dict[str, int]:
    """Rank 0, after the first round: for each step some node holds a valid manifest copy
    of, the index (in ``nodes``) of the first such node: the copy the plan reads."""
    out: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for key, e in n["steps"].items():
            if e["manifest"] and key not in out:
                out[key] = i
    return out


def records_wanted(nodes: list[dict[str, Any]], records: dict[tuple[int, str, int], dict[str, Any]]
                   ) -> set[tuple[int, str, int]]:
    """Rank 0: the parity records (``(node index, step, position in its list)``) the plan
    needs and ``records`` (those fetched so far) lacks: none for a step whose files are
    all held; else those of every group of the old nodes that hold no record (the lost
    ones) and of the owners of the missing files by the records fetched, and every record
    of the step while a missing file has no owner in them. ``nodes`` carry the manifest
    text of :func:`manifest_sources`' node; what they say is untrusted: a step whose
    manifest or summaries are malformed asks for nothing (its plan says why)."""
    want: set[tuple[int, str, int]] = set()
    for key in {k for n in nodes for k in n["steps"]}:
        try:
            want |= _step_wanted(nodes, key, records)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, ZeroDivisionError):
            continue
    return want - set(records)


def _step_wanted(nodes: list[dict[str, Any]], key: str, records: dict[tuple[int, str, int], dict[str, Any]]
                 ) -> set[tuple[int, str, int]]:
    text = next((n["steps"][key]["manifest"] for n in nodes if key in n["steps"] and n["steps"][key]["manifest"]), None)
    if text is None:
        return set()
    doc = json.loads(text)
    files: dict[str, int] = doc["files"]
    snap = (doc.get("metadata") or {}).get("snapshot") or {}
    held = {name for n in nodes for name, size in n["steps"].get(key, {}).get("files", {}).items() if files.get(name) == size}
    missing = set(files) - held
    n_old, m = len(snap.get("nodes", [])), int(snap.get("parity", 0))
    k = int(snap.get("k", n_old - m))
    if not missing or m == 0:
        return set()
    mine = [(i, j, s) for i, n in enumerate(nodes) for j, s in enumerate(n["steps"].get(key, {}).get("parity") or [])]
    lost = set(range(n_old)) - {int(s[2]) for _, _, s in mine}
    info: dict[str, Any] = {}  # old node -> its blob's record, from the first record naming it (as the plan reads)
    for (_, k2, _), meta in records.items():
        if k2 == key:
            for x, rec in (meta.get("members") or {}).items():
                info.setdefault(x, rec)
    owners = {name: int(x) for x, rec in info.items() for name, _ in rec["files"]}
    if missing - set(owners) and (not lost or any((i, key, j) in records for i, j, _ in mine)):
        return {(i, key, j) for i, j, _ in mine}  # a missing file no fetched record describes: every record
    lost |= {owners[name] for name in missing if name in owners}
    groups = {group_of(x, s, n_old) for x in lost for s in range(k)}
    return {(i, key, j) for i, j, s in mine if int(s[0]) in groups}


def records_reply(inv: dict[str, Any] | None, asked: list[list[Any]]) -> list[Any]:
    """A node's answer to rank 0's second round: the parity records asked for (``[step,
    position]``), without the keeper table they carry (the plan reads it from the manifest)."""
    out = []
    for key, j in asked:
        recs = (inv or {}).get("steps", {}).get(key, {}).get("parity", [])
        out.append({f: v for f, v in recs[j].items() if f != "peers"} if 0 <= j < len(recs) else None)
    return out


def with_records(nodes: list[dict[str, Any]], records: dict[tuple[int, str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """The inventories :func:`plan_candidates` reads: each node's summary with the records
    fetched in place of their ``[group, block, holder]`` (in the node's order), the others
    left out."""
    out = []
    for i, n in enumerate(nodes):
        steps = {key: dict(e, parity=[records[(i, key, j)] for j in range(len(e["parity"])) if (i, key, j) in records])
                 for key, e in n["steps"].items()}
        out.append({"node": n["node"], "steps": steps})
    return out


def _gather_plans(snap: Snapshotter) -> tuple[list[dict[str, Any]], list[list[Any]], int]:
    """Collective: rank 0 plans from every node's summary (first round), the manifest copy
    of each step from one node (broadcast), and the parity records of the lost nodes'
    groups only (second round, repeated while the records fetched name more lost nodes);
    (plans, reasons, bytes gathered by rank 0) on every rank."""
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
    records: dict[tuple[int, str, int], dict[str, Any]] = {}
    reasons: list[list[Any]] = []
    while True:
        ask: dict[str, list[list[Any]]] = {}
        if gathered is not None:
            for i, key, j in sorted(records_wanted(nodes, records)):
                ask.setdefault(str(ranks[i]), []).append([key, j])
        ask = _share(snap, ask if gathered is not None else None)
        if not ask:
            break
        got = gather_bytes(snap.group, json.dumps(records_reply(inv, ask.get(str(snap.group.rank), []))).encode(), 0)
        if got is None:
            continue
        size += sum(map(len, got))
        for r, asked in ask.items():
            i = ranks.index(int(r))
            reply = json.loads(got[int(r)])
            for n, (key, j) in enumerate(asked):
                rec = reply[n] if isinstance(reply, list) and n < len(reply) else None
                records[(i, key, j)] = rec if isinstance(rec, dict) else {}
                if not isinstance(rec, dict):  # an empty record: the plan finds it malformed and says so
                    reasons.append([int(key), f"node {nodes[i]['node']}'s parity record {j}: not sent back"])
    plans: list[dict[str, Any]] = []
    if gathered is not None:
        plans, more = plan_candidates(with_records(nodes, records))
        reasons += more
    plans, reasons, size = _share(snap, [plans, reasons, size])
    return plans, reasons, size


def _protection(snap: dict[str, Any]) -> str:
    """How a snapshot is protected, for the log line: ``XOR parity``, ``Reed-Solomon parity
    (k+m)`` or ``copies on neighbour nodes``."""
    m, n = int(snap.get("parity", 0)), len(snap.get("nodes", []))
    k = int(snap.get("k", n - m))
    return {"copy": "copies on neighbour nodes", "xor": "XOR parity"}.get(code_name(k, m), f"Reed-Solomon parity ({k}+{m})")


def _can_rebuild(snap: dict[str, Any]) -> str:
    m, n = int(snap.get("parity", 0)), len(snap.get("nodes", []))
    k = int(snap.get("k", n - m))
    what = f"parity {m}" if code_name(k, m) != "copy" else f"{m} cop{'y' if m == 1 else 'ies'} per node"
    return f"{what} rebuilds {'one node' if m == 1 else f'{m} nodes'}"


def _plan_step(step: int, nodes: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    key = str(step)
    text = next((n["steps"][key]["manifest"] for n in nodes if key in n["steps"] and n["steps"][key]["manifest"]), None)
    if text is None:
        return None, "no node holds a valid copy of its manifest"
    doc = json.loads(text)
    files: dict[str, int] = doc["files"]
    snap = (doc.get("metadata") or {}).get("snapshot") or {}
    where: dict[str, list[Any]] = {}
    for n in nodes:
        held = n["steps"].get(key, {}).get("files", {})
        for name, size in held.items():
            if files.get(name) == size and name not in where:
                where[name] = [n["node"], f"{paths.step_name(step)}/{name}"]
    missing = sorted(set(files) - set(where))
    index: dict[str, list[Any]] = {}  # a part of the index (or the whole) -> every node holding it
    for n in nodes:
        for name in n["steps"].get(key, {}).get("index", []):
            index.setdefault(name, []).append([n["node"], f"{paths.step_name(step)}/{name}"])
    plan = {"step": step, "manifest": text, "where": where, "rebuild": None, "files": len(files), "index": index}
    if not missing:
        return plan, ""
    n_old, m = len(snap.get("nodes", [])), int(snap.get("parity", 0))
    k = int(snap.get("k", n_old - m))
    if m == 0:
        return None, f"{len(missing)} of {len(files)} files were lost with their node and the snapshot has no parity"
    blocks: dict[tuple[int, int], tuple[int, dict[str, Any]]] = {}  # (group, r) -> (node now, record)
    for n in nodes:
        for meta in n["steps"].get(key, {}).get("parity") or []:
            blocks.setdefault((int(meta["group"]), int(meta["r"])), (n["node"], meta))
    info: dict[int, dict[str, Any]] = {}  # old node -> its blob's record (stripes, files)
    for _, meta in blocks.values():
        for i, rec in meta["members"].items():
            info.setdefault(int(i), rec)
    owners = {name: i for i, rec in info.items() for name, _ in rec["files"]}
    lost = sorted({owners.get(name, -1) for name in missing})
    if -1 in lost:
        return None, f"no surviving parity describes {len([x for x in missing if x not in owners])} of the missing files"
    if len(lost) > m:
        return None, f"nodes {', '.join(map(str, lost))} of {n_old} were lost; {_can_rebuild(snap)}"
    located = {i: where[rec["files"][0][0]][0] for i, rec in info.items() if i not in lost and rec["files"]}
    groups: dict[str, Any] = {}
    for g in sorted({group_of(x, s, n_old) for x in lost for s in range(k)}):
        recs = [blocks[(g, r)] for r in range(m) if (g, r) in blocks]
        if not recs:
            return None, f"node(s) {', '.join(map(str, lost))} lost and every parity of group {g} is gone"
        members_of = recs[0][1]["members"]
        data = [[i, s, located[i], members_of[str(i)]] for i, s in members(g, k, n_old) if i not in lost]
        need = k - len(data)
        if len(recs) < need:
            return None, (f"node(s) {', '.join(map(str, lost))} lost and group {g} keeps {len(data) + len(recs)} "
                          f"of the {k} blocks a rebuild needs")
        want = [[i, s, members_of[str(i)]] for i, s in members(g, k, n_old) if i in lost]
        groups[str(g)] = {"data": data, "parity": [[node, meta] for node, meta in recs[:need]], "want": want}
    plan["rebuild"] = {"lost": lost, "nodes": n_old, "k": k, "m": m, "groups": groups,
                       "info": {str(x): info[x] for x in lost}, "how": _protection(snap)}
    return plan, ""


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
        self.lost = {name: int(x) for x, rec in (self.rebuild or {}).get("info", {}).items() for name, _ in rec["files"]}
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
    gathered = gather_bytes(snap.group, (error or "").encode(), 0)
    first = b""
    if gathered is not None:
        first = next((g for g in gathered if g), b"")
    return broadcast_bytes(snap.group, first, 0).decode() or None


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
            reasons.append([plan["step"], f"older than the durable checkpoint of step {disk_step}"])
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
