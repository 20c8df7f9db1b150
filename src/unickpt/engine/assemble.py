"""The committing rank's work at the end of a save: every rank's message -> the checked
manifest documents. No I/O: ``save``'s commit and the scale simulation (``bench/scale.py``)
both call :func:`manifest_document`.

The messages (``format/rank_message.py``) carry each fragment as a fixed-width record and
its manifest JSON text, so the checks (errors, agreement of replicated values, duplicate
shards, tiling, replicated tensors some replica wrote) and the index run on arrays; the
Python work per rank is its message's small head.
"""

from __future__ import annotations

import datetime
import platform
from math import prod
from typing import Any

import numpy as np
import torch

from ..errors import InconsistentStateError, SaveError
from ..format.index import INDEX_FRAGMENTS, INDEX_NAME, INDEXED_VERSION, FragmentRows, manifest_documents, tensor_head
from ..format.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, seal
from ..format.rank_message import Batch, decode_all, entry
from ..format.values import decode_value
from ..format.values import encode_value
from ..version import __version__
from .rank_report import RankReport


def manifest_document(
    messages: list[bytes], world_size: int, metadata: dict[str, Any], indexed: bool | None = None
) -> dict[str, bytes]:
    """The committing rank's work (rank 0): every rank's message (``rank_message``, in
    rank order) -> the checked documents to commit: ``manifest.json`` last, with
    ``fragments.jsonl`` before it when the manifest is indexed (format 2.0; by default
    when more than ``INDEX_FRAGMENTS`` fragments). Raises :class:`SaveError` (or
    :class:`InconsistentStateError`) when a rank failed or the ranks' reports disagree."""
    return assemble(decode_all(messages), world_size, metadata, indexed)


def assemble(batch: Batch, world_size: int, metadata: dict[str, Any], indexed: bool | None = None) -> dict[str, bytes]:
    """:func:`manifest_document` from the decoded messages."""
    reports = [RankReport.from_head(h, k) for k, h in enumerate(batch.heads)]  # in rank order
    failed = [p for p in reports if p.error]
    if failed:
        raise SaveError("save failed, nothing was committed:\n" + "\n".join(f"rank {p.rank}: {p.error}" for p in failed),
                        {p.rank: p.error for p in failed})
    _check_agreement(reports)
    files: dict[str, int] = {}
    values: dict[str, Any] = {}
    for p in reports:
        values.update(p.values)
    values.update(_joined_groups(reports))
    for p in reports:
        files.update(p.files)
    tensors, tensor = _tensors(batch, reports)
    keep = _drop_duplicates(batch, reports, tensor, tensors)
    ids = {name: t for t, (name, _) in enumerate(tensors)}
    unwritten = [(n, p.rank) for p in reports for n in p.replicated if n not in ids]
    if unwritten:
        raise SaveError("no replica wrote " + ", ".join(f"{n!r} (held by rank {r} and its replicas)" for n, r in unwritten[:5])
                        + "; the replicas disagree on what they hold (docs/FORMAT.md, 'Who writes replicas')")
    _check_tiling(tensors, tensor[keep], batch.volume[keep])
    rank_values = {name: [p.rank_values.get(name) for p in reports]
                   for name in sorted({k for p in reports for k in p.rank_values})}
    rank_tensors = {}
    for name in sorted({k for p in reports for k in p.rank_tensors}):
        row: list[dict[str, Any] | None] = []
        for p in reports:
            d = p.rank_tensors.get(name)
            row.append(None if d is None else dict(tensor_head(d["shape"], d["dtype"], "per-rank"), fragments=[d["fragment"]]))
        rank_tensors[name] = row
    if indexed is None:
        indexed = int(keep.sum()) > INDEX_FRAGMENTS
    version = INDEXED_VERSION if indexed else FORMAT_VERSION
    head = {
        "format": FORMAT_NAME, "version": f"{version[0]}.{version[1]}", "world_size": world_size,
        "provenance": {
            "unickpt": __version__, "torch": torch.__version__, "python": platform.python_version(), "world_size": world_size,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "metadata": encode_value(metadata, "metadata"), "files": files,
    }
    bases: dict[str, dict[str, Any]] = {}
    for p in reports:  # the checkpoints holding bytes an incremental save references
        for holder, d in p.bases.items():
            bases.setdefault(holder, {"digest": d["digest"], "files": {}})["files"].update(d["files"])
    if bases:
        head["bases"] = bases
    if reports and reports[0].incremental is not None:
        head["incremental"] = reports[0].incremental
    tail = {"values": values, "rank_values": rank_values, "rank_tensors": rank_tensors}
    texts = [batch.texts[k] for k in np.nonzero(keep)[0].tolist()] if not keep.all() else batch.texts
    rows = FragmentRows(tensor[keep], texts, batch.text_len[keep], batch.lo[keep], batch.length[keep])
    text, index = manifest_documents(head, tensors, rows, tail, indexed)
    doc = seal(text).encode()
    return {MANIFEST_NAME: doc} if index is None else {INDEX_NAME: index, MANIFEST_NAME: doc}


def _tensors(batch: Batch, reports: list[RankReport]) -> tuple[list[tuple[str, dict[str, Any]]], np.ndarray]:
    """Every tensor the ranks reported (name and ``tensor_head``, in order of first
    appearance: the tensors of the fragments, then the empty ones ranks declared) and
    the tensor of each fragment (an index into that list). Each distinct entry line is
    parsed once; when ranks describe one tensor differently the first description wins."""
    lines = dict.fromkeys(batch.entries)  # distinct lines, in order of first appearance
    tensors: list[tuple[str, dict[str, Any]]] = []
    ids: dict[str, int] = {}
    of_line, ndim = [], []
    for k, line in enumerate(lines):
        try:
            name, shape, dtype, layout = entry(None, line)
        except SaveError:  # again, naming the rank that sent it
            entry(reports[batch.rank_of(batch.entries.index(line))].rank, line)
            raise
        if name not in ids:
            ids[name] = len(tensors)
            tensors.append((name, tensor_head(shape, dtype, layout)))
        lines[line] = k
        of_line.append(ids[name])
        ndim.append(len(shape))
    line = np.fromiter(map(lines.__getitem__, batch.entries), dtype=np.int64, count=len(batch.entries))
    wrong = np.nonzero(np.array(ndim, dtype=np.int64)[line] != batch.ndim)[0] if len(line) else ()
    if len(wrong):
        k = int(wrong[0])
        raise SaveError(f"rank {reports[batch.rank_of(k)].rank} sent a malformed commit message: "
                        f"the box of a fragment of {batch.entries[k]!r:.80} "
                        f"has {int(batch.ndim[k])} dimensions, not its tensor's")
    tensor = np.array(of_line, dtype=np.int64)[line] if len(line) else np.zeros(0, dtype=np.int64)
    for p in reports:
        for name, (shape, dtype, layout) in p.declared.items():
            if name not in ids:
                ids[name] = len(tensors)
                tensors.append((name, tensor_head(shape, dtype, layout)))
    return tensors, tensor


def _check_agreement(reports: list[RankReport]) -> None:
    """Every key held by several ranks (plain values, plain tensors) must be equal on all."""
    seen: dict[str, dict[str, list[int]]] = {}
    for p in reports:
        for key, digest in p.digests.items():
            seen.setdefault(key, {}).setdefault(digest, []).append(p.rank)
    problems = []
    for key in sorted(seen):
        if len(seen[key]) > 1:
            variants = sorted(seen[key].items(), key=lambda kv: kv[1][0])
            problems.append(f"{key!r} (" + "; ".join(f"ranks {_ranks(r)}: {d}" for d, r in variants[:3]) + ")")
    if problems:
        raise InconsistentStateError(
            "these entries differ between ranks; make them equal, or wrap per-rank state in unickpt.PerRank: "
            + "; ".join(problems[:10]) + (f" and {len(problems) - 10} more" if len(problems) > 10 else "")
        )


def _joined_groups(reports: list[RankReport]) -> dict[str, Any]:
    """Each optimizer's ``param_groups`` joined over the ranks: the hyperparameters of a
    group must agree; its parameter names are every rank's, in rank order (a pipeline
    stage holds a part of each group, data-parallel replicas the same names)."""
    out: dict[str, Any] = {}
    names = sorted({k for p in reports for k in p.group_values})
    problems = []
    for name in names:
        parts = [(p.rank, decode_value(p.group_values[name])) for p in reports if name in p.group_values]
        first_rank, first = parts[0]
        joined = [dict(g) for g in first]
        seen = [list(g.get("params", [])) for g in first]
        for rank, groups in parts[1:]:
            if len(groups) != len(joined) or any({k: v for k, v in a.items() if k != "params"}
                                                 != {k: v for k, v in b.items() if k != "params"}
                                                 for a, b in zip(groups, joined)):
                problems.append(f"{name!r} (ranks {first_rank} and {rank} have other groups or hyperparameters)")
                break
            for held, g in zip(seen, groups):
                held.extend(n for n in g.get("params", []) if n not in held)
        for g, held in zip(joined, seen):
            g["params"] = held
        out[name] = encode_value(joined, name)
    if problems:
        raise InconsistentStateError("an optimizer's parameter groups differ between ranks: " + "; ".join(problems[:5]))
    return out


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:6])) + (",..." if len(ranks) > 6 else "")


def _drop_duplicates(batch: Batch, reports: list[RankReport], tensor: np.ndarray,
                     tensors: list[tuple[str, dict[str, Any]]]) -> np.ndarray:
    """Which fragments to keep: of several with the same tensor and boxes (replicas
    that wrote the same shard), the first in rank order, once every copy is checked to
    hold the same data (same checksums key)."""
    n = len(tensor)
    keep = np.ones(n, dtype=bool)
    if n < 2:
        return keep
    order = np.lexsort((np.arange(n), batch.boxes, tensor))
    t, b = tensor[order], batch.boxes[order]
    again = np.zeros(n, dtype=bool)
    again[1:] = (t[1:] == t[:-1]) & (b[1:] == b[:-1])
    if not again.any():
        return keep
    first = np.maximum.accumulate(np.where(again, 0, np.arange(n)))  # the first copy of each row's shard
    crcs = batch.crcs[order]
    differ = np.nonzero(again & (crcs != crcs[first]))[0]
    if len(differ):
        rank = np.repeat(np.array([p.rank for p in reports]), batch.counts)
        k = differ[0]
        raise InconsistentStateError(f"{tensors[int(t[k])][0]!r}: replicas on ranks {rank[order[first[k]]]} and "
                                     f"{rank[order[k]]} hold different data for the same shard")
    keep[order[again]] = False
    return keep


def _check_tiling(tensors: list[tuple[str, dict[str, Any]]], tensor: np.ndarray, volume: np.ndarray) -> None:
    """The fragments of every tensor hold each of its elements once (their volumes add up)."""
    held = np.zeros(len(tensors), dtype=np.int64)
    np.add.at(held, tensor, volume)
    for (name, th), got in zip(tensors, held.tolist()):
        total = prod(th["shape"])
        if got != total:
            raise SaveError(f"{name!r}: the saved shards hold {got} elements of {total}; the layout overlaps or leaves gaps")
