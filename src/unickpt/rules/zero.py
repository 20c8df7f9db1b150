"""ZeRO (and FSDP1) flat partitions: a rank's 1-D slice of flattened parameters.

Stages 1 and 2 (and FSDP1's FlatParameter): the tp-local parameters of a group are
flattened one after the other into one buffer (each starting at a multiple of ``align``
elements), the buffer is padded to a multiple of ``dp * pad_to`` elements and cut into
``dp`` equal partitions; rank r keeps partition r. Stage 3: every parameter is
flattened and cut alone into ``ceil(numel / dp)`` elements per rank, the tail padded.
Optimizer moments (any per-parameter state: Adam's moments, Muon's momentum, fp32
master weights) are partitioned exactly like the parameters.

A partition's elements map, parameter by parameter, through the parameter's own
tensor-parallel layout (its rule) onto boxes of the global tensors: a flat range of a
tp-local tensor decomposes into at most 2n-1 boxes, each clipped against the tp
layout's boxes. Loading builds the *target* rank's partition for any dp degree and
stage: every element it needs is read from wherever the source stored it.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from ..errors import LayoutError
from ..plan.box import Box, flat_range_to_boxes, intersect
from ..plan.piece import Piece
from .coords import Coords
from .language import Resolved, RuledTensor, Rules, check_mode, put_unique, layout_text, scalar_leaf
from .schemes import Target


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of parameter ``param``'s flattening, stored from
    element ``at`` of the partition on."""

    param: str
    start: int
    stop: int
    at: int


@dataclass(frozen=True)
class Partition:
    """One flat buffer of this rank: its size and the parameter ranges it holds."""

    numel: int
    segments: tuple[Segment, ...]


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a if a > 1 else n


def group_partition(names: list[str], numels: list[int], dp: int, dp_rank: int, align: int = 1, pad_to: int = 1) -> Partition:
    """Rank ``dp_rank``'s partition of a ZeRO-1/2 group: parameters flattened in order,
    each starting at a multiple of ``align``, the buffer padded to a multiple of
    ``dp * pad_to`` and cut into ``dp`` equal parts."""
    if align < 1 or pad_to < 1:
        raise LayoutError(f"zero: align and pad_to must be >= 1 (got {align}, {pad_to})")
    starts, end = [], 0
    for n in numels:
        s = _align_up(end, align)
        starts.append(s)
        end = s + n
    total = _align_up(end, dp * pad_to)
    size = total // dp
    lo, hi = dp_rank * size, (dp_rank + 1) * size
    segs = []
    for name, s, n in zip(names, starts, numels):
        a, b = max(lo, s), min(hi, s + n)
        if a < b:
            segs.append(Segment(name, a - s, b - s, a - lo))
    return Partition(size, tuple(segs))


def param_partition(name: str, numel: int, dp: int, dp_rank: int) -> Partition:
    """Rank ``dp_rank``'s ZeRO-3 partition of one parameter: ``ceil(numel/dp)`` elements,
    the last ranks' tails padded."""
    size = -(-numel // dp)
    a, b = min(numel, dp_rank * size), min(numel, (dp_rank + 1) * size)
    return Partition(size, (Segment(name, a, b, 0),) if a < b else ())


def compose_flat(targets: list[Target], local_shape: tuple[int, ...], start: int, stop: int, at: int) -> list[tuple[Target, Piece]]:
    """Pieces for elements ``[start, stop)`` of the row-major flattening of a local tensor
    whose boxes are ``targets`` (box-in-box, local -> global), stored contiguously from
    element ``at`` of a flat buffer. Elements no target covers (padding) get no piece."""
    out = []
    pos = at
    for b in flat_range_to_boxes(Box.whole(tuple(local_shape)), start, stop):
        for t in targets:
            common = intersect(b, t.local_box) if b.ndim else b
            if common is None:
                continue
            delta = tuple(g - lo for g, lo in zip(t.global_box.offsets, t.local_box.offsets))
            glob = common.shift(delta)
            out.append((t, Piece(glob, tuple(c - o for c, o in zip(common.offsets, b.offsets)), b.lengths, pos)))
        pos += b.volume
    return out


class ZeroPlan:
    """This rank's ZeRO flat partitions, given its parameters and their rules.

    ``params``: the stage-local parameters in model order (``{name: tensor or shape}``,
    tp-local shapes). ``groups``: parameter names per optimizer group, in flattening
    order (default: one group of all ``params``). ``stage``: 1, 2 or 3. ``align``/``pad_to``
    (stages 1-2): each parameter's start alignment, and the buffer's padding to a
    multiple of ``dp * pad_to`` elements.
    """

    def __init__(
        self,
        rules: Rules,
        coords: Coords,
        params: dict[str, Any],
        stage: int,
        *,
        groups: list[list[str]] | None = None,
        align: int = 1,
        pad_to: int = 1,
        shapes: dict[str, Any] | None = None,
        strict: bool = True,
    ) -> None:
        if stage not in (1, 2, 3):
            raise LayoutError(f"zero stage must be 1, 2 or 3, not {stage}")
        self.rules, self.coords, self.stage, self.align, self.pad_to = rules, coords, stage, align, pad_to
        local_shapes = {n: tuple(p.shape) if isinstance(p, torch.Tensor) else tuple(int(x) for x in p) for n, p in params.items()}
        self.groups = [list(g) for g in groups] if groups is not None else [list(local_shapes)]
        listed = [n for g in self.groups for n in g]
        missing = [n for n in listed if n not in local_shapes]
        if missing or len(set(listed)) != len(listed):
            raise LayoutError(f"zero groups name unknown or repeated parameters: {missing or listed}")
        self.resolved: dict[str, Resolved] = {}
        matched: set[int] = set()
        unmatched: list[str] = []
        for n in listed:
            res = rules.resolve(n, local_shapes[n], coords, shapes)
            if res is None:
                unmatched.append(rules.global_name(n, coords))
                continue
            matched.add(res.rule_index)
            self.resolved[n] = res
        if strict:
            rules.check_coverage(matched, unmatched, coords, "parameters")
        if unmatched:
            raise LayoutError(f"zero: parameters {unmatched[:10]} match no rule; their place in the flat buffer cannot be described")
        dp, r = coords.dp, coords.dp_rank
        if stage == 3:
            self.partitions = [param_partition(n, prod(local_shapes[n]), dp, r) for n in listed]
        else:
            self.partitions = [
                group_partition(g, [prod(local_shapes[n]) for n in g], dp, r, align, pad_to) for g in self.groups
            ]

    @property
    def numels(self) -> list[int]:
        """Size of each flat buffer of this rank (one per group; one per parameter at stage 3)."""
        return [p.numel for p in self.partitions]

    def describe(self) -> dict[str, Any]:
        """JSON description (stage, alignment, groups in global names) for the metadata."""
        return {
            "stage": self.stage, "align": self.align, "pad_to": self.pad_to,
            "groups": [[self.rules.global_name(n, self.coords) for n in g] for g in self.groups],
        }

    def empty(self, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """Fresh zeroed flat buffers of this rank's partition sizes."""
        return [torch.zeros(n, dtype=dtype) for n in self.numels]

    def state(
        self,
        tensors: dict[str, list[torch.Tensor]],
        mode: str,
        *,
        scalars: dict[str, dict[str, Any]] | None = None,
        check_replicas: bool = True,
        process_group: Any = None,
    ) -> dict[str, dict[str, Any]]:
        """``{key: [flat buffer per partition]}`` (e.g. ``{"fp32": [...], "exp_avg": [...],
        "exp_avg_sq": [...]}``) -> ``{global name: {key: RuledTensor}}``, views of the
        buffers, for ``unickpt.save`` / ``unickpt.load`` (put it under ``{"optim": {"state": ...}}``).

        ``mode="load"`` zero-fills the buffers' padding in place. ``scalars``:
        optional per-parameter 0-d state ``{stage-local name: {key: tensor}}``.
        """
        check_mode(mode)
        out: dict[str, dict[str, Any]] = {}
        zero_text = f", zero-{self.stage} over dp={self.coords.dp}"
        for key, buffers in tensors.items():
            if len(buffers) != len(self.partitions):
                raise LayoutError(f"zero state {key!r}: {len(buffers)} buffers for {len(self.partitions)} partitions")
            for part, buf in zip(self.partitions, buffers):
                if buf.ndim != 1 or buf.numel() != part.numel or not buf.is_contiguous():
                    raise LayoutError(
                        f"zero state {key!r}: a flat buffer of shape {list(buf.shape)}, but this rank's partition "
                        f"holds {part.numel} elements (1-D, contiguous)"
                    )
                covered: list[tuple[int, int]] = []
                for seg in part.segments:
                    res = self.resolved[seg.param]
                    index, count = res.replicas(self.coords, dp_partitioned=True)
                    text = layout_text(res, self.coords, zero_text)
                    by_name: dict[str, list[tuple[Target, Piece]]] = {}
                    for t, p in compose_flat(res.layout.targets, res.local_shape, seg.start, seg.stop, seg.at):
                        by_name.setdefault(res.part_names[t.part], []).append((t, p))
                    for name, items in by_name.items():
                        every = [_rebase(res, t, p) for t, p in items]  # flat offsets within buf
                        kept = [(t, p) for t, p in every if t.owner or mode == "load"]
                        lo = min((p.flat_offset for _, p in kept), default=0)
                        hi = max((p.flat_extent[1] for _, p in kept), default=0)
                        covered += [p.flat_extent for _, p in every if p.global_box.lengths == p.view]
                        pieces = [Piece(p.global_box, p.local_offsets, p.view, p.flat_offset - lo) for _, p in kept]
                        leaf = RuledTensor(buf[lo:hi], res.part_shapes[items[0][0].part], pieces, index, count, text,
                                           res.layout.reduce, buf, [p for _, p in every], ((lo, hi - lo),))
                        put_unique(out.setdefault(name, {}), key, leaf, f"{name}.{key}")
                if mode == "load":
                    _zero_gaps(buf, covered)
        for local_name, entries in (scalars or {}).items():
            res = self.resolved.get(local_name)
            if res is None:
                raise LayoutError(f"zero scalars: {local_name!r} is not a parameter of this plan")
            for key, v in entries.items():
                for name in dict.fromkeys(res.part_names):
                    put_unique(out.setdefault(name, {}), key, scalar_leaf(v, self.coords, res.rule, res.renumbered), f"{name}.{key}")
        if mode == "save" and check_replicas:
            from .replicas import reconcile

            reconcile(out, self.coords, process_group)
        return out


def _rebase(res: Resolved, t: Target, p: Piece) -> tuple[Target, Piece]:
    """A piece with its global box in the stored tensor's coordinates (split fused
    sub-parameters) and its view cut to the rows it covers, so that padding rows (past
    the vocabulary) and rows stored by another rank lie outside it."""
    box = res.stored_box(Target(t.part, t.local_box, p.global_box, t.owner))
    view, local, flat = p.view, p.local_offsets, p.flat_offset
    if view and not any(local[1:]) and p.global_box.lengths[1:] == view[1:]:
        flat += local[0] * prod(view[1:])
        view, local = (p.global_box.lengths[0],) + tuple(view[1:]), tuple(0 for _ in local)
    return t, Piece(box, local, view, flat)


def _zero_gaps(buf: torch.Tensor, covered: list[tuple[int, int]]) -> None:
    """Zero the elements of a flat buffer no piece spans (alignment and tail padding)."""
    at = 0
    for a, b in sorted(covered):
        if a > at:
            buf[at:a].zero_()
        at = max(at, b)
    if at < buf.numel():
        buf[at:].zero_()
