"""Replicas on save: check that they agree, or store their mean.

DeepSpeed keeps one TP slice of a "replicated" parameter and silently drops the others;
here every box held by several ranks is compared by CRC-32C, and a mismatch is an
:class:`~unickpt.InconsistentStateError` naming the tensor, the box and the ranks.
Tensors of the "averaged" scheme are replaced (in the state handed to save, never in
the user's tensors) by the mean of every replica, summed in float64 in rank order.

:func:`reconcile` does it for a real job (one gather to rank 0 and one broadcast over
the process group); :func:`reconcile_ranks` does the same for a list of per-rank states
in one process (simulated ranks, offline conversion of per-rank files).
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from math import prod
from typing import Any

import torch

from ..engine.state import flatten
from ..dist import broadcast_bytes, gather_bytes, resolve_group
from ..errors import InconsistentStateError, LayoutError
from ..format.checksum import crc32c
from ..format.dtypes import dtype_from_name, dtype_name
from ..plan.box import Box
from ..plan.piece import Piece
from .coords import Coords
from .ruled import RuledTensor


def piece_region(local: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The region of ``local`` a piece describes, as a view (``local`` must be contiguous
    when the piece is a flat one)."""
    view = local
    if piece.flat_offset != 0 or piece.view != tuple(local.shape):
        if not local.is_contiguous():
            raise LayoutError(f"a tensor with flat pieces must be contiguous (shape {list(local.shape)})")
        view = local.reshape(-1)[piece.flat_offset : piece.flat_offset + prod(piece.view)].view(piece.view)
    for d, (o, n) in enumerate(zip(piece.local_offsets, piece.global_box.lengths)):
        view = view.narrow(d, o, n)
    return view


def _ruled(state: dict[str, Any]) -> list[tuple[str, RuledTensor]]:
    return [(leaf.name, leaf.value) for leaf in flatten(state) if isinstance(leaf.value, RuledTensor)]


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _records(state: dict[str, Any]) -> list[list[Any]]:
    """``[name, offsets, lengths, crc]`` of every box of every checked tensor."""
    out = []
    for name, leaf in _ruled(state):
        if leaf.reduce != "check":
            continue
        for p in leaf.base_pieces:
            crc = crc32c(_bytes(piece_region(leaf.base_tensor(), p)))
            out.append([name, list(p.global_box.offsets), list(p.global_box.lengths), crc])
    return out


def _compare(per_rank: list[list[list[Any]]]) -> list[str]:
    seen: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for rank, records in enumerate(per_rank):
        for name, offsets, lengths, crc in records:
            seen[(name, tuple(offsets), tuple(lengths))].append((rank, crc))
    problems = []
    for (name, offsets, lengths), holders in seen.items():
        if len({c for _, c in holders}) > 1:
            ranks = ", ".join(f"rank {r}: crc32c={c:08x}" for r, c in holders)
            problems.append(f"{name!r} box at {list(offsets)} of size {list(lengths)} differs between replicas ({ranks})")
    return problems


def _mean_parts(state: dict[str, Any]) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """Every box of every averaged tensor: (description, contiguous data)."""
    out = []
    for name, leaf in _ruled(state):
        if leaf.reduce != "mean":
            continue
        for p in leaf.base_pieces:
            out.append((
                {"name": name, "shape": list(leaf.global_shape), "dtype": dtype_name(leaf.local.dtype),
                 "offsets": list(p.global_box.offsets), "lengths": list(p.global_box.lengths)},
                piece_region(leaf.base_tensor(), p).detach().cpu().contiguous(),
            ))
    return out


def _means(per_rank: list[list[tuple[dict[str, Any], torch.Tensor]]]) -> dict[str, torch.Tensor]:
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for parts in per_rank:
        for d, data in parts:
            name = d["name"]
            if name not in sums:
                sums[name] = torch.zeros(d["shape"], dtype=torch.float64)
                counts[name] = torch.zeros(d["shape"], dtype=torch.int64)
                dtypes[name] = dtype_from_name(d["dtype"])
            s, c = sums[name], counts[name]
            for dim, (o, n) in enumerate(zip(d["offsets"], d["lengths"])):
                s, c = s.narrow(dim, o, n), c.narrow(dim, o, n)
            s += data.to(torch.float64)
            c += 1
    return {n: (sums[n] / counts[n].clamp(min=1)).to(dtypes[n]) for n in sums}


def _apply_means(state: dict[str, Any], means: dict[str, torch.Tensor]) -> None:
    for name, leaf in _ruled(state):
        if leaf.reduce != "mean" or name not in means:
            continue
        new = leaf.base_tensor().detach().clone(memory_format=torch.contiguous_format)
        for p in leaf.base_pieces:
            src = means[name]
            for dim, (o, n) in enumerate(zip(p.global_box.offsets, p.global_box.lengths)):
                src = src.narrow(dim, o, n)
            piece_region(new, p).copy_(src)
        leaf.rebase(new)


def reconcile_ranks(states: list[dict[str, Any]]) -> None:
    """Check and average replicas across the per-rank states of one job held in one
    process (index = rank). Raises InconsistentStateError listing every mismatch."""
    problems = _compare([_records(s) for s in states])
    if problems:
        raise InconsistentStateError(_message(problems))
    means = _means([_mean_parts(s) for s in states])
    for s in states:
        _apply_means(s, means)


def _message(problems: list[str]) -> str:
    return ("replicated tensors differ between ranks (a replica is stored once, so the others would be lost): "
            + "; ".join(problems[:10]) + (f" and {len(problems) - 10} more" if len(problems) > 10 else ""))


def _pack(header: dict[str, Any], tensors: list[torch.Tensor]) -> bytes:
    chunks, at = [], 0
    header = dict(header)
    header["blobs"] = []
    for t in tensors:
        b = bytes(_bytes(t))
        header["blobs"].append([at, len(b), dtype_name(t.dtype), list(t.shape)])
        chunks.append(b)
        at += len(b)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def _unpack(data: bytes) -> tuple[dict[str, Any], list[torch.Tensor]]:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    tensors = []
    for at, size, dtype, shape in header.pop("blobs"):
        raw = bytearray(data[base + at : base + at + size])
        t = torch.frombuffer(raw, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        tensors.append(t.view(dtype_from_name(dtype)).reshape(shape))
    return header, tensors


def reconcile(state: dict[str, Any], coords: Coords, process_group: Any = None) -> None:
    """Collective over ``process_group`` (default: the default group): compare every
    replicated box (CRC-32C), replace averaged tensors by the replicas' mean. Raises the
    same InconsistentStateError on every rank on a mismatch. A no-op in a single process."""
    group = resolve_group(process_group)
    if not group.active:
        return
    if group.size != coords.world_size:
        raise LayoutError(
            f"the coordinates describe {coords.world_size} ranks ({coords.describe()}) but the process group "
            f"has {group.size}; pass the job's process group"
        )
    try:
        parts = _mean_parts(state)
        payload = _pack({"records": _records(state), "means": [d for d, _ in parts], "error": None}, [t for _, t in parts])
    except Exception as e:  # reported by rank 0 to every rank, so nobody hangs
        payload = _pack({"records": [], "means": [], "error": f"{type(e).__name__}: {e}"}, [])
    gathered = gather_bytes(group, payload, 0)
    result = b""
    if gathered is not None:
        per_rank = [_unpack(g) for g in gathered]
        errors = [f"rank {r}: {h['error']}" for r, (h, _) in enumerate(per_rank) if h["error"]]
        problems = errors or _compare([h["records"] for h, _ in per_rank])
        if problems:
            result = _pack({"error": _message(problems) if not errors else "; ".join(errors)}, [])
        else:
            means = _means([list(zip(h["means"], ts)) for h, ts in per_rank])
            names = sorted(means)
            result = _pack({"error": None, "names": names}, [means[n] for n in names])
    header, tensors = _unpack(broadcast_bytes(group, result, 0))
    if header["error"]:
        raise InconsistentStateError(header["error"])
    _apply_means(state, dict(zip(header["names"], tensors)))


def global_boxes(leaf: RuledTensor) -> list[Box]:
    """The global boxes a rule-described tensor holds on this rank (all of them)."""
    return [p.global_box for p in leaf.base_pieces]
