"""Rank 0's recovery plan: which snapshot step to resume and where every byte of it is.

Each node lists what its shm root holds (:func:`inventory`) and sends rank 0 a
:func:`summary` of it: O(its files) bytes, every parity record reduced to its group,
block, holder, length and crc32c. When every file of a step is held, the plan needs
nothing more. When files were lost with their node, the layout of the code (every
group's members and holders follow from ``(g, k, n)``: :mod:`.parity`) says which old
nodes' blobs the rebuild reads: those of the lost nodes' groups. Their descriptions
(blob length and files) are asked from a few parity records (:func:`records_wanted`:
each group's record lists its ``k`` members, so a record of group ``x + k`` describes
node ``x`` and the ``k - 1`` after it) and every old node is described **once** in the
plan. The plan thus grows with the nodes, not with their square: it lists each member's
files once and each group's parity blocks by holder, length and crc32c; the members'
stripe checksums stay in the records, read only to name a corrupt input
(:func:`.degraded.diagnose`).

Everything a node sends is untrusted on rank 0: a malformed summary or reply leaves its
step out with the reason, never raises.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from ..errors import SnapshotError, UnickptError
from ..format.manifest import MANIFEST_NAME, Manifest
from . import paths
from .client import Snapshotter
from .parity import code_name, group_of, members, open_record

MISSING = "missing"  # a node's copy of a step's manifest, when it holds rank files of the step
Record = tuple[int, str, int]  # (index of the node in the gathered list, step, position in its parity list)
MAX_ROUNDS = 8  # rounds of asking for records: one when a node is lost; more only when replies fail


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
    file name and step) together with its block (a regular file of the recorded size);
    ``size`` is added: the record's length in bytes (what a reader of it asks a keeper for)."""
    raw = paths.read_regular(os.path.join(sdir, name), 1 << 26)
    meta = open_record(raw)
    if name != paths.parity_name(meta["group"], meta["r"], "json") or meta["step"] != step:
        raise SnapshotError(f"it describes block {meta['r']} of group {meta['group']} of step {meta['step']}")
    block = os.path.join(sdir, paths.parity_name(meta["group"], meta["r"], "bin"))
    if not os.path.isfile(block) or os.path.islink(block) or os.path.getsize(block) != meta["nbytes"]:
        raise SnapshotError(f"its block is missing, or not of its {meta['nbytes']} bytes")
    return dict(meta, size=len(raw))


# -- the two rounds of the gather -------------------------------------------------------
def block_entry(meta: dict[str, Any]) -> list[int]:
    """A parity record as a summary lists it: ``[group, block, holder, nbytes, crc32c,
    the record's length]``."""
    return [int(meta[f]) for f in ("group", "r", "holder", "nbytes", "crc", "size")]


def summary(inv: dict[str, Any]) -> dict[str, Any]:
    """What a node sends rank 0 first: its inventory with each manifest copy replaced by
    its digest and each parity record by its :func:`block_entry` (O(its files) bytes; the
    records, which describe every member of a group, stay on the node until asked for)."""
    steps = {}
    for key, e in inv["steps"].items():
        digest = hashlib.sha256(e["manifest"].encode()).hexdigest() if e["manifest"] else None
        steps[key] = dict(e, manifest=digest, parity=[block_entry(m) for m in e["parity"]])
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


def records_wanted(nodes: list[dict[str, Any]], records: dict[Record, dict[str, Any]]) -> dict[Record, list[int]]:
    """Rank 0: the parity records to ask for next, each with the old nodes whose
    descriptions it should send (the members the plan still lacks): nothing for a step
    whose files are all held; else the description of every member of the lost nodes'
    groups (the lost ones: old nodes that hold no record, and the owners of missing files
    by the descriptions fetched), and of every old node while a missing file has no owner
    in them. A member is asked of a record not yet asked for it, so the rounds end.
    ``records`` are the replies so far (:func:`merge_reply`); ``nodes`` carry the manifest
    text of :func:`manifest_sources`' node. What they say is untrusted: a step whose
    manifest or summaries are malformed asks for nothing (its plan says why)."""
    want: dict[Record, list[int]] = {}
    for key in sorted({k for n in nodes for k in n["steps"]}):
        try:
            for rec, who in _step_wanted(nodes, key, records).items():
                want.setdefault(rec, []).extend(who)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, ZeroDivisionError):
            continue
    return want


def _step_wanted(nodes: list[dict[str, Any]], key: str, records: dict[Record, dict[str, Any]]) -> dict[Record, list[int]]:
    doc = _manifest_of(nodes, key)
    if doc is None:
        return {}
    files: dict[str, int] = doc["files"]
    snap = (doc.get("metadata") or {}).get("snapshot") or {}
    missing = set(files) - _held(nodes, key, files)
    n_old, k, m = _code(snap)
    if not missing or m == 0:
        return {}
    by_group: dict[int, list[Record]] = {}
    alive: set[int] = set()
    for i, n in enumerate(nodes):
        for j, e in enumerate(n["steps"].get(key, {}).get("parity") or []):
            by_group.setdefault(int(e[0]), []).append((i, key, j))
            alive.add(int(e[2]))
    mine = {r: meta for r, meta in records.items() if r[1] == key}
    info = described(mine.values())
    asked = {(r, int(x)) for r, meta in mine.items() for x in meta.get("asked", [])}
    owners = {name: x for x, rec in info.items() for name, _ in rec["files"]}
    lost = (set(range(n_old)) - alive) | {owners[name] for name in missing if name in owners}
    unowned = missing - set(owners)  # before any reply: the lost nodes' files; after: describe every old node
    need = set(range(n_old)) if unowned and (not lost or mine) else neighbours(lost, k, n_old)
    need -= set(info)
    want: dict[Record, list[int]] = {}
    covered: set[int] = set()
    for x in sorted(need):
        if x in covered:
            continue
        for s in reversed(range(k)):  # group x + k first: it describes x and the k - 1 nodes after it
            g = group_of(x, s, n_old)
            rec = next((r for r in by_group.get(g, []) if (r, x) not in asked), None)
            if rec is not None:
                got = [y for y, _ in members(g, k, n_old) if y in need and y not in covered]
                covered.update(got)
                want.setdefault(rec, []).extend(got)
                break
    return want


def neighbours(lost: set[int], k: int, n: int) -> set[int]:
    """The old nodes with a stripe in a group of a lost node (the lost ones included): the
    members of groups ``x + 1 .. x + k`` are nodes ``x - k + 1 .. x + k - 1``."""
    out: set[int] = set()
    for x in lost:
        out.update((x + d) % n for d in range(-min(k - 1, n), min(k, n)))
    return out


def records_reply(inv: dict[str, Any] | None, asked: list[list[Any]]) -> list[Any]:
    """A node's answer to rank 0's second round: each parity record asked for (``[step,
    position, members]``) with only the members asked, without the keeper table it
    carries (the plan reads it from the manifest)."""
    out = []
    for key, j, who in asked:
        recs = (inv or {}).get("steps", {}).get(key, {}).get("parity", [])
        if not (isinstance(j, int) and 0 <= j < len(recs)):
            out.append(None)
            continue
        meta = {f: v for f, v in recs[j].items() if f not in ("peers", "members")}
        meta["members"] = {str(x): recs[j]["members"][str(x)] for x in who if str(x) in recs[j]["members"]}
        out.append(meta)
    return out


def merge_reply(records: dict[Record, dict[str, Any]], rec: Record, who: list[int], reply: Any) -> str | None:
    """Rank 0: fold one node's reply for record ``rec`` (asked for members ``who``) into
    ``records``, keeping the members it describes well-formed; why it was refused, or None."""
    meta = records.setdefault(rec, {"members": {}, "asked": []})
    meta["asked"] = sorted(set(meta["asked"]) | set(who))
    if not isinstance(reply, dict) or not isinstance(reply.get("members"), dict):
        return "not sent back" if reply is None else "malformed"
    bad = 0
    for x, desc in reply["members"].items():
        if isinstance(x, str) and x.isdigit() and int(x) in who and _is_description(desc):
            meta["members"].setdefault(x, {"blob": desc["blob"], "files": desc["files"]})
        else:
            bad += 1
    return f"{bad} member descriptions malformed" if bad else None


def _is_description(desc: Any) -> bool:
    """A member's description as a parity record keeps it: a blob length and its files."""
    return (isinstance(desc, dict) and type(desc.get("blob")) is int and desc["blob"] >= 0
            and isinstance(desc.get("files"), list)
            and all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and type(f[1]) is int and f[1] >= 0
                    for f in desc["files"])
            and sum(f[1] for f in desc["files"]) == desc["blob"])


def described(metas: Any) -> dict[int, dict[str, Any]]:
    """Old node -> its blob's description (``blob``, ``files``), from the first of the
    records ``metas`` describing it well-formed."""
    info: dict[int, dict[str, Any]] = {}
    for meta in metas:
        mem = meta.get("members") if isinstance(meta, dict) else None
        for x, desc in (mem.items() if isinstance(mem, dict) else ()):
            if isinstance(x, str) and x.isdigit() and int(x) not in info and _is_description(desc):
                info[int(x)] = {"blob": desc["blob"], "files": desc["files"]}
    return info


def with_records(nodes: list[dict[str, Any]], records: dict[Record, dict[str, Any]]) -> list[dict[str, Any]]:
    """The inventories :func:`plan_candidates` reads: each node's summary with, for each
    step, the member descriptions of the records fetched from it (``members``)."""
    out = []
    for i, n in enumerate(nodes):
        steps = {}
        for key, e in n["steps"].items():
            metas = [records[(i, key, j)] for j in range(len(e["parity"])) if (i, key, j) in records]
            steps[key] = dict(e, members={str(x): d for x, d in described(metas).items()})
        out.append({"node": n["node"], "steps": steps})
    return out


# -- planning (rank 0) ------------------------------------------------------------------
def plan_candidates(nodes: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """Steps that can be recovered, newest first, each with where every file is (or how
    to rebuild it); and ``[step, why]`` for every newer step that cannot be, and for every
    copy of a manifest or parity record that was left out. ``nodes`` are summaries with
    the descriptions fetched (:func:`with_records`), or whole inventories (one round)."""
    nodes = [_as_summary(n) for n in nodes]
    committed = {int(s) for n in nodes for s, e in n["steps"].items() if e["manifest"] or e["bad"] not in (None, MISSING)}
    plans, reasons = [], []
    for step in sorted(committed, reverse=True):  # a step no node holds a manifest of was never committed
        key = str(step)
        held = [(n["node"], n["steps"][key]) for n in nodes if key in n["steps"]]
        notes = [f"node {node}'s copy of its manifest: {e['bad']}" for node, e in held if e["bad"]]
        notes += [note for _, e in held for note in e["notes"]]
        try:
            plan, why = _plan_step(step, nodes)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:  # summaries that disagree with the manifest
            plan, why = None, f"its parity records do not match its manifest ({type(e).__name__}: {e})"
        if plan is None:
            reasons.append([step, why])
        else:
            plans.append(plan)
        reasons += [[step, note] for note in notes]
    return plans, reasons


def _as_summary(n: dict[str, Any]) -> dict[str, Any]:
    """A whole inventory's steps as :func:`with_records` gives them: block entries, and
    every member its records describe."""
    steps = {}
    for key, e in n["steps"].items():
        recs = e.get("parity") if isinstance(e, dict) else None
        if isinstance(recs, list) and recs and isinstance(recs[0], dict):
            e = dict(e, parity=[block_entry(m) for m in recs],
                     members={str(x): d for x, d in described(recs).items()})
        steps[key] = e
    return dict(n, steps=steps)


def _manifest_text(nodes: list[dict[str, Any]], key: str) -> str | None:
    """The first manifest text the summaries of step ``key`` carry (None: none)."""
    return next((n["steps"][key]["manifest"] for n in nodes if key in n["steps"] and n["steps"][key]["manifest"]), None)


def _manifest_of(nodes: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """:func:`_manifest_text`, parsed (None: none)."""
    text = _manifest_text(nodes, key)
    return None if text is None else json.loads(text)


def _held(nodes: list[dict[str, Any]], key: str, files: dict[str, int]) -> set[str]:
    return {name for n in nodes for name, size in n["steps"].get(key, {}).get("files", {}).items() if files.get(name) == size}


def _code(snap: dict[str, Any]) -> tuple[int, int, int]:
    """(nodes, k, m) of a snapshot's ``snapshot`` metadata (``k`` defaults to ``nodes - m``,
    the layout of snapshots that did not record it)."""
    n, m = len(snap.get("nodes", [])), int(snap.get("parity", 0))
    return n, int(snap.get("k", n - m)), m


def _protection(snap: dict[str, Any]) -> str:
    """How a snapshot is protected, for the log line: ``XOR parity``, ``Reed-Solomon parity
    (k+m)`` or ``copies on neighbour nodes``."""
    _, k, m = _code(snap)
    return {"copy": "copies on neighbour nodes", "xor": "XOR parity"}.get(code_name(k, m), f"Reed-Solomon parity ({k}+{m})")


def _can_rebuild(snap: dict[str, Any]) -> str:
    _, k, m = _code(snap)
    what = f"parity {m}" if code_name(k, m) != "copy" else f"{m} cop{'y' if m == 1 else 'ies'} per node"
    return f"{what} rebuilds {'one node' if m == 1 else f'{m} nodes'}"


def _plan_step(step: int, nodes: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    key = str(step)
    text = _manifest_text(nodes, key)
    if text is None:
        return None, "no node holds a valid copy of its manifest"
    doc = json.loads(text)
    files = doc["files"]
    snap = (doc.get("metadata") or {}).get("snapshot") or {}
    where: dict[str, list[Any]] = {}
    for n in nodes:
        for name, size in n["steps"].get(key, {}).get("files", {}).items():
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
    n_old, k, m = _code(snap)
    if m == 0:
        return None, f"{len(missing)} of {len(files)} files were lost with their node and the snapshot has no parity"
    blocks: dict[tuple[int, int], list[int]] = {}  # (group, r) -> [node now, r, nbytes, crc32c, record length]
    info: dict[int, dict[str, Any]] = {}  # old node -> its blob's description
    for n in nodes:
        e = n["steps"].get(key, {})
        for g, r, _, nbytes, crc, size in e.get("parity") or []:
            blocks.setdefault((int(g), int(r)), [n["node"], int(r), int(nbytes), int(crc), int(size)])
        for x, desc in (e.get("members") or {}).items():
            info.setdefault(int(x), desc)
    owners = {name: i for i, desc in info.items() for name, _ in desc["files"]}
    lost = sorted({owners.get(name, -1) for name in missing})
    if -1 in lost:
        return None, f"no surviving parity describes {len([x for x in missing if x not in owners])} of the missing files"
    if len(lost) > m:
        return None, f"nodes {', '.join(map(str, lost))} of {n_old} were lost; {_can_rebuild(snap)}"
    lost_in: dict[int, int] = {}  # group -> its data members lost
    for x in lost:
        for s in range(k):
            lost_in[group_of(x, s, n_old)] = lost_in.get(group_of(x, s, n_old), 0) + 1
    described_nodes: dict[str, Any] = {}
    for i in sorted(neighbours(set(lost), k, n_old)):
        desc = info.get(i)
        if desc is None:
            return None, f"no surviving parity record describes node {i}'s blob, which the rebuild reads"
        at = None if i in lost or not desc["files"] else where[desc["files"][0][0]][0]
        described_nodes[str(i)] = {"blob": desc["blob"], "files": desc["files"], "at": at}
    groups: dict[str, Any] = {}
    for g in sorted(lost_in):
        recs = [blocks[(g, r)] for r in range(m) if (g, r) in blocks]
        if not recs:
            return None, f"node(s) {', '.join(map(str, lost))} lost and every parity of group {g} is gone"
        if len(recs) < lost_in[g]:
            return None, (f"node(s) {', '.join(map(str, lost))} lost and group {g} keeps {k - lost_in[g] + len(recs)} "
                          f"of the {k} blocks a rebuild needs")
        groups[str(g)] = recs[: lost_in[g]]
    plan["rebuild"] = {"lost": lost, "nodes": n_old, "k": k, "m": m, "groups": groups,
                       "info": described_nodes, "how": _protection(snap)}
    return plan, ""
