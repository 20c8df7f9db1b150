"""Recovery at start: the newest whole and verified state, from memory or from disk.

Collective over the trainers (every rank calls :func:`recover`). The first local rank of
each node lists what its node's shm root holds (committed steps, rank files, parity);
rank 0 plans, newest step first:

* every file of the step is held by a surviving node (a process crash; or a relaunch on
  any layout): load it as it is;
* the files of at most ``m`` lost nodes are missing (``m`` the parity: XOR, Reed-Solomon
  or copies on neighbours): rank 0 rebuilds them from the survivors' parity blocks and
  data stripes, read from its own shm root or fetched from their keepers over TCP; every
  rebuilt stripe is checked against its crc32c (a failure names the corrupt input block);
* otherwise the step is skipped, and the reason kept.

The chosen step is loaded by every rank through the ordinary read plan
(:func:`unickpt.load` resharding onto the new layout, every block checksum verified),
reading its node's files from its shm root and other nodes' files from their keepers.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c as _crc
import numpy as np

from ..dist import broadcast_bytes, gather_bytes
from ..errors import CorruptionError, UnickptError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..storage.local import FileReader
from . import paths, wire
from .client import Snapshotter
from .parity import code_name, decode, group_of, members, read_blob, stripe_range

LoadFn = Callable[[str, Any], int]


@dataclass
class Outcome:
    """What recovery did: the step resumed (0 when fresh), its source and the log line."""

    step: int
    source: str  # "memory", "disk" or "fresh"
    line: str
    seconds: float
    tried: bool = False  # a memory load was attempted (when it failed, the job's state is partly overwritten)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: plan, rebuild, load (of the last step tried)


# -- what a node holds ------------------------------------------------------------------
def inventory(snap: Snapshotter) -> dict[str, Any]:
    """This node's committed snapshots: manifest, rank files and parity of each step."""
    steps: dict[str, Any] = {}
    for step in paths.steps(snap.jdir):
        sdir = paths.step_dir(snap.root, snap.job, step)
        entry: dict[str, Any] = {"files": {n: os.path.getsize(os.path.join(sdir, n)) for n in paths.data_files(sdir)}}
        try:
            with open(os.path.join(sdir, MANIFEST_NAME)) as f:
                entry["manifest"] = f.read()
        except FileNotFoundError:
            entry["manifest"] = None
        entry["parity"] = []
        for name in paths.parity_metas(sdir):
            try:
                with open(os.path.join(sdir, name)) as f:
                    entry["parity"].append(json.load(f))
            except (FileNotFoundError, json.JSONDecodeError):
                pass
        steps[str(step)] = entry
    return {"node": snap.node, "steps": steps}


# -- planning (rank 0) ------------------------------------------------------------------
def plan_candidates(nodes: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Steps that can be recovered, newest first, each with where every file is (or how
    to rebuild it); and the reasons the newer steps cannot."""
    all_steps = sorted({int(s) for n in nodes for s, e in n["steps"].items() if e["manifest"]}, reverse=True)
    plans, reasons = [], []
    for step in all_steps:
        plan, why = _plan_step(step, nodes)
        if plan is None:
            reasons.append(f"step {step}: {why}")
        else:
            plans.append(plan)
    return plans, reasons


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
    text = next(n["steps"][key]["manifest"] for n in nodes if key in n["steps"] and n["steps"][key]["manifest"])
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
    plan = {"step": step, "manifest": text, "where": where, "rebuild": None, "files": len(files)}
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


# -- rebuilding lost nodes (rank 0) -----------------------------------------------------
class Peers:
    """Connections to the keepers of the current job's nodes, by node index."""

    def __init__(self, table: list[dict[str, Any]]) -> None:
        self.table = table
        self.conns: dict[int, wire.Connection] = {}

    def get(self, node: int) -> wire.Connection:
        """The connection to node ``node``'s keeper (opened on first use)."""
        conn = self.conns.get(node)
        if conn is None:
            peer = self.table[node]
            conn = self.conns[node] = wire.Connection(peer["host"], int(peer["port"]))
        return conn

    def close(self) -> None:
        """Close every connection."""
        for c in self.conns.values():
            c.close()
        self.conns.clear()


def _fetch(peers: Peers, me: int, jdir: str, node: int, header: dict[str, Any], out: np.ndarray) -> None:
    """Fill ``out`` with a ``read`` (file range) or ``blob`` (range of a node's blob) from
    node ``node``: from this node's own shm root directly, else from that node's keeper."""
    if node != me:
        peers.get(node).read_views(header, [memoryview(out)])
        return
    if header["op"] == "read":
        reader = FileReader(Path(jdir) / header["path"])
        try:
            reader.pread_into(int(header["offset"]), memoryview(out))
        finally:
            reader.close()
        return
    sdir = os.path.join(jdir, paths.step_name(int(header["step"])))
    read_blob(sdir, [(n, os.path.getsize(os.path.join(sdir, n))) for n in paths.data_files(sdir)],
              int(header["offset"]), memoryview(out))


def _rebuild_group(step: int, g: int, spec: dict[str, Any], k: int, m: int, snap: Snapshotter) -> list[tuple[int, int, np.ndarray]]:
    """The lost stripes of group ``g``: its surviving data stripes and as many parity
    blocks as needed, fetched (from this node's memory or the holders' keepers) and
    decoded; each rebuilt stripe is checked against the crc32c its node recorded. A
    mismatch is then traced to its cause: every input block is checked against its own
    crc32c (a corrupt parity or data block is named). Returns (lost node, stripe, bytes)."""
    peers = Peers(snap.table)
    got: dict[int, np.ndarray] = {}
    crcs: dict[int, tuple[int, str]] = {}
    try:
        for node, meta in spec["parity"]:
            b = k + int(meta["r"])
            got[b] = np.empty(int(meta["nbytes"]), np.uint8)
            rel = f"{paths.step_name(step)}/{paths.parity_name(g, int(meta['r']), 'bin')}"
            _fetch(peers, snap.node, snap.jdir, node, {"op": "read", "path": rel, "offset": 0}, got[b])
            crcs[b] = (int(meta["crc"]), f"the parity of step {step} held by node {meta['holder']} "
                                         f"(group {g}, block {meta['r']}) fails its crc32c")
        for i, s, node, rec in spec["data"]:
            lo, hi = stripe_range(int(rec["blob"]), s, k)
            got[s] = np.empty(hi - lo, np.uint8)
            _fetch(peers, snap.node, snap.jdir, node, {"op": "blob", "step": step, "offset": lo}, got[s])
            crcs[s] = (int(rec["crc"]), f"data stripe {s} of node {i} (step {step}) fails its crc32c")
    finally:
        peers.close()
    before = {k: _crc.crc32c(got[k])} if m == 1 and k > 1 else {}  # XOR decodes into the parity's buffer
    want = spec["want"]
    out = decode(got, k, m, [s for _, s, _ in want])
    result = []
    for x, s, rec in want:
        stripe = out[s][: int(rec["len"])]
        if _crc.crc32c(stripe) != int(rec["crc"]) or int(rec["stripe"]) != s:
            for b, (crc, why) in sorted(crcs.items()):
                if (before[b] if b in before else _crc.crc32c(got[b])) != crc:
                    raise CorruptionError(why)
            raise CorruptionError(f"stripe {s} of node {x} rebuilt in group {g} fails its crc32c")
        result.append((x, s, stripe))
    return result


def rebuild(plan: dict[str, Any], snap: Snapshotter) -> dict[str, list[Any]]:
    """Rebuild the lost nodes' files of ``plan`` into this node's shm root (the groups in
    parallel, one thread each, every rebuilt stripe written straight into its files);
    returns where each rebuilt file now is. Raises CorruptionError when a rebuilt stripe
    does not match its crc32c (naming the parity or data block at fault)."""
    step, rb = plan["step"], plan["rebuild"]
    k, m = int(rb["k"]), int(rb["m"])
    info = {int(x): rec for x, rec in rb["info"].items()}
    rname = f"rebuilt_{step:08d}"
    rdir = os.path.join(snap.jdir, rname)
    paths.remove_tree(rdir)
    os.makedirs(rdir)
    fds: dict[str, int] = {}
    try:
        for rec in info.values():
            for name, size in rec["files"]:
                fds[name] = os.open(os.path.join(rdir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fds[name], int(size))

        def one(g: int, spec: dict[str, Any]) -> None:
            for x, s, data in _rebuild_group(step, g, spec, k, m, snap):
                lo, _ = stripe_range(int(info[x]["blob"]), s, k)
                at, view = 0, memoryview(data)
                for name, size in info[x]["files"]:  # the stripe's bytes land in the files they belong to
                    a, b = max(lo, at), min(lo + view.nbytes, at + int(size))
                    if a < b:
                        part = view[a - lo : b - lo]
                        while part.nbytes:
                            part = part[os.pwrite(fds[name], part, a - at) :]
                            a = b - part.nbytes
                    at += int(size)

        with ThreadPoolExecutor(max(1, len(rb["groups"]))) as pool:
            for f in [pool.submit(one, int(g), spec) for g, spec in rb["groups"].items()]:
                f.result()
    finally:
        for fd in fds.values():
            os.close(fd)
    return {name: [snap.node, f"{rname}/{name}"] for rec in info.values() for name, _ in rec["files"]}


# -- reading a snapshot spread over nodes ---------------------------------------------
class RemoteReader:
    """A file held by another node, read by ranges from its keeper."""

    def __init__(self, conn: wire.Connection, path: str, size: int) -> None:
        self.conn, self.rel, self.size = conn, path, size

    def pread_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``."""
        self.conn.read(self.rel, offset, out)

    def preadv_into(self, offset: int, views: list[memoryview]) -> None:
        """Fill the buffers one after the other from ``offset`` on (one request)."""
        self.conn.read_views({"op": "read", "path": self.rel, "offset": offset}, views)

    def close(self) -> None:
        """Nothing to release (the connection belongs to the storage)."""


class SnapshotStorage:
    """The files of one snapshot as ``load`` reads them: this node's from its shm root,
    the others' from their keepers."""

    def __init__(self, snap: Snapshotter, where: dict[str, list[Any]], manifest: Manifest) -> None:
        self.snap, self.where, self.manifest = snap, where, manifest  # the manifest, parsed once for the load
        self.sizes = {name: int(size) for name, size in manifest.files.items()}
        self.peers = Peers(snap.table)
        self._readers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def reader(self, name: str):
        """A positional reader of file ``name`` (shared by load's threads)."""
        with self._lock:
            return self._reader(name)

    def _reader(self, name: str):
        r = self._readers.get(name)
        if r is None:
            if name not in self.where:
                raise CorruptionError(f"data file {name} of the snapshot is held by no surviving node")
            node, rel = self.where[name]
            if node == self.snap.node:
                r = FileReader(Path(self.snap.jdir) / rel)
            else:
                r = RemoteReader(self.peers.get(node), rel, self.sizes[name])
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
    conn = wire.Connection(snap.keeper["host"], int(snap.keeper["port"]))
    try:
        conn.request({"op": "reset", "keep_upto": keep_upto})
    finally:
        conn.close()


def _try_step(snap: Snapshotter, plan: dict[str, Any], load: LoadFn, timings: dict[str, float]) -> tuple[int | None, str]:
    """Rebuild (if needed) and load one planned step; (step, how) or (None, why not)."""
    step = plan["step"]
    where = dict(plan["where"])
    error = None
    t0 = time.perf_counter()
    if plan["rebuild"] is not None and snap.group.rank == 0:
        try:
            where.update(rebuild(plan, snap))
        except UnickptError as e:
            error = str(e)
    if plan["rebuild"] is not None:
        error = _agree(snap, error)
        if error is not None:
            return None, f"step {step}: {error}"
        where = _share(snap, where)
    rdir = os.path.join(snap.jdir, f"recover_{step:08d}")
    if snap.local_rank == 0:
        os.makedirs(rdir, exist_ok=True)
        with open(os.path.join(rdir, MANIFEST_NAME), "w") as f:
            f.write(plan["manifest"])
    _agree(snap, None)  # the manifest is in place on every node
    t1 = time.perf_counter()
    error, storage = None, None
    try:
        storage = SnapshotStorage(snap, where, Manifest.from_json(plan["manifest"]))
        got = load(rdir, storage)
        if got != step:
            error = f"the snapshot says step {got}, its directory step {step}"
    except UnickptError as e:
        error = str(e)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        if storage is not None:
            storage.close()
    error = _agree(snap, error)
    timings.update(rebuild=t1 - t0, load=time.perf_counter() - t1)
    if snap.local_rank == 0:
        paths.remove_tree(rdir)
    if snap.group.rank == 0:
        paths.remove_tree(os.path.join(snap.jdir, f"rebuilt_{step:08d}"))
    if error is not None:
        return None, f"step {step}: {error}"
    if plan["rebuild"] is None:
        return step, f"all {plan['files']} files held by the surviving nodes, checksums verified"
    rb = plan["rebuild"]
    lost, held = rb["lost"], rb["nodes"] - len(rb["lost"])
    who = f"node {lost[0]}" if len(lost) == 1 else f"nodes {', '.join(map(str, lost))}"
    return step, (f"{who} of {rb['nodes']} lost: {'its' if len(lost) == 1 else 'their'} files rebuilt from "
                  f"{rb['how']} on {held} node{'s' if held != 1 else ''}, every chunk's crc32c verified")


def recover(snap: Snapshotter, load: LoadFn, disk: Callable[[], tuple[int, str] | None] | None = None,
            disk_step: int | None = None) -> Outcome:
    """Resume from the newest whole, verified state (collective); see the module docstring.

    ``load(path, storage)`` loads the checkpoint at ``path`` (its files through
    ``storage``, its manifest already parsed: ``storage.manifest``, to pass to
    :func:`unickpt.load`) into the job and returns the step it holds. ``disk()`` resumes from the
    durable tier and returns (step, path), or None when it holds nothing; ``disk_step``,
    the step of the durable tier's newest checkpoint, makes older snapshots lose to it."""
    t0 = time.perf_counter()
    mine = json.dumps(inventory(snap) if snap.local_rank == 0 else None).encode()
    gathered = gather_bytes(snap.group, mine, 0)
    plans: list[dict[str, Any]] = []
    reasons: list[str] = []
    if gathered is not None:
        nodes = [d for d in (json.loads(g) for g in gathered) if d is not None]
        plans, reasons = plan_candidates(nodes)
    plans, reasons = _share(snap, [plans, reasons])
    timings: dict[str, float] = {"plan": time.perf_counter() - t0}
    step: int | None = None
    for plan in plans:
        if disk_step is not None and plan["step"] < disk_step:
            reasons.append(f"step {plan['step']}: older than the durable checkpoint of step {disk_step}")
            break
        step, how = _try_step(snap, plan, load, timings)
        if step is not None:
            _reset_keeper(snap, step)
            took = time.perf_counter() - t0
            return Outcome(step, "memory", f"resumed step {step} from memory ({how}; {took:.2f} s)", took, True, timings)
        reasons.append(how)
    why = "; ".join(reasons) if reasons else "no snapshot in memory"
    got = disk() if disk is not None else None
    if got is not None:
        step, path = got
        _reset_keeper(snap, step)
        took = time.perf_counter() - t0
        return Outcome(step, "disk", f"resumed step {step} from disk ({path}; memory: {why}; {took:.2f} s)", took,
                       bool(plans), timings)
    _reset_keeper(snap, 0)
    return Outcome(0, "fresh", f"starting fresh (memory: {why}; no checkpoint on disk)", time.perf_counter() - t0,
                   bool(plans), timings)
