"""Sharding schemes: pure constructors of the boxes a rank's local tensor holds.

A scheme answers, for one parameter, given the job's :class:`Coords`, the tensor's
global shape and this rank's local shape: which boxes of the local tensor are which
boxes of the global tensor (:class:`Target`), and whether this rank is the one that
stores them. Nothing here does I/O or talks to other ranks, so every scheme is
unit-tested on its own.

Replication over the tensor-parallel axis is expressed per box (``Target.owner``): one
tp rank owns each replicated box and only owners' boxes are written on save. That
keeps ownership right even when the same parameter is cut differently on different tp
ranks (ZeRO flat partitions of a tp-local buffer whose size depends on the tp rank).
Replication over the data- and expert-parallel axes (identical layouts) is left to the
save's replica machinery (``Sharded.replica_index``/``replicas``).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from ..errors import LayoutError
from ..plan.box import Box
from .coords import Coords, split_range


@dataclass(frozen=True)
class Target:
    """This box of the local tensor is that box of the global tensor.

    ``part`` numbers the sub-parameter (fused tensors; 0 otherwise). ``owner`` is False
    when another rank stores the same elements (a replica inside a tensor-parallel
    layout): the box is filled on load but not written on save.
    """

    part: int
    local_box: Box
    global_box: Box
    owner: bool = True


@dataclass(frozen=True)
class SchemeLayout:
    """What a scheme says about one rank's local tensor."""

    global_shape: tuple[int, ...]
    targets: list[Target]
    parts: list[tuple[int, int]] = field(default_factory=list)  # (start, size) on ``dim`` per sub-parameter
    dim: int = 0
    axis: str | None = None  # the axis the tensor is partitioned over ("tp", "ep"), or None
    reduce: str = "check"  # "check": replicas must agree; "mean": store the mean of the replicas
    covers_local: bool = True  # False when some local elements (padding) belong to no target


def _tp_owner(key: str, coords: Coords) -> bool:
    """Which tp rank stores a tensor replicated over tp: spread by name, computed locally."""
    return coords.tp_rank == zlib.crc32(key.encode()) % coords.tp


def _dim(dim: int, ndim: int, what: str) -> int:
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < ndim:
        raise LayoutError(f"{what}: dim {dim} out of range for a {ndim}-d tensor")
    return d


def _replace(shape: tuple[int, ...], dim: int, n: int) -> tuple[int, ...]:
    return tuple(n if d == dim else s for d, s in enumerate(shape))


def _box_along(shape: tuple[int, ...], dim: int, start: int, length: int) -> Box:
    return Box(tuple(start if d == dim else 0 for d in range(len(shape))), _replace(shape, dim, length))


def _unit_slice(total: int, unit: int, n: int, r: int, split: Any, key: str, what: str) -> tuple[int, int, bool]:
    """``(start, length, owner)`` of rank r of n along a dim of ``total`` elements cut in
    units of ``unit`` (attention heads). Fewer units than ranks (GQA key/value heads with
    kv_heads < tp) replicate each unit over ``n / units`` consecutive ranks."""
    if unit < 1 or total % unit:
        raise LayoutError(f"{what}: size {total} is not a multiple of the unit {unit}")
    units = total // unit
    if isinstance(split, str) and 0 < units < n:
        if n % units:
            raise LayoutError(f"{what}: {units} units (heads) cannot be replicated evenly over {n} ranks")
        rep = n // units
        return (r // rep) * unit, unit, r % rep == 0
    start, length = split_range(units, n, r, split)
    return start * unit, length * unit, True


class Scheme:
    """Base class of the sharding schemes. Subclasses define :meth:`layout`,
    :meth:`global_shape` and :meth:`to_json`."""

    kind = "scheme"
    axis: str | None = None

    def global_shape(self, local_shape: tuple[int, ...], coords: Coords) -> tuple[int, ...]:
        """The global shape implied by a local shape (the even case); give ``shapes`` to
        :func:`unickpt.rules.apply_rules` where it is ambiguous (uneven widths)."""
        return tuple(local_shape)

    def layout(self, key: str, global_shape: tuple[int, ...], local_shape: tuple[int, ...], coords: Coords) -> SchemeLayout:
        """The boxes this rank's local tensor holds. ``key`` (the tensor name) spreads
        replica ownership; a local shape that does not fit the scheme is a LayoutError."""
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        """The scheme as a plain JSON object (``{"scheme": kind, ...parameters}``)."""
        return {"scheme": self.kind}

    def describe(self) -> str:
        """Short text for the manifest's ``layout`` field."""
        args = ", ".join(f"{k}={v}" for k, v in self.to_json().items() if k != "scheme")
        return f"{self.kind}({args})"

    def __repr__(self) -> str:
        return self.describe()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Scheme) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(repr(self.to_json()))


class Replicated(Scheme):
    """Every rank holds the whole tensor (norms, biases of row-parallel layers, routers).

    On save the replicas are compared (CRC-32C of their bytes) and a mismatch is an
    :class:`~unickpt.InconsistentStateError` naming the tensor and ranks, not hidden.
    """

    kind = "replicated"
    reduce = "check"

    def layout(self, key: str, global_shape: tuple[int, ...], local_shape: tuple[int, ...], coords: Coords) -> SchemeLayout:
        """One target, the whole tensor, owned by one tp rank (chosen by name)."""
        if tuple(global_shape) != tuple(local_shape):
            raise LayoutError(f"{key}: replicated tensor of local shape {list(local_shape)} but global shape {list(global_shape)}")
        whole = Box.whole(tuple(global_shape))
        return SchemeLayout(tuple(global_shape), [Target(0, whole, whole, _tp_owner(key, coords))], reduce=self.reduce)


class Averaged(Replicated):
    """Every rank holds a copy that may drift (DeepSpeed's ``parameter_to_average_patterns``):
    the checkpoint stores the mean of the replicas (summed in float64 in rank order)."""

    kind = "averaged"
    reduce = "mean"


class Partitioned(Scheme):
    """Cut on dimension ``dim`` over ``axis`` ("tp": column-parallel is dim 0, row-parallel
    dim 1; "ep": experts stacked on a dimension).

    ``split`` says how widths are chosen: ``"chunk"`` (torch.chunk / DTensor), ``"balanced"``
    (numpy.array_split) or explicit per-rank widths in units. ``unit`` cuts in whole
    units (attention heads); fewer units than ranks replicates each unit (GQA kv heads
    when kv_heads < tp), and one replica stores it. ``size`` fixes the global size.
    """

    kind = "partitioned"

    def __init__(self, dim: int = 0, axis: str = "tp", split: str | list[int] = "chunk", unit: int = 1, size: int | None = None) -> None:
        if axis not in ("tp", "ep"):
            raise LayoutError(f"partitioned: axis must be 'tp' or 'ep', not {axis!r}")
        if not isinstance(split, list) and split not in ("chunk", "balanced"):
            raise LayoutError(f"partitioned: unknown split {split!r}: use 'chunk', 'balanced' or a list of widths")
        self.dim, self.axis, self.split, self.unit, self.size = dim, axis, split, unit, size

    def global_shape(self, local_shape: tuple[int, ...], coords: Coords) -> tuple[int, ...]:
        """Local size times the degree, unless ``size`` or explicit widths say otherwise."""
        d = _dim(self.dim, len(local_shape), self.describe())
        if self.size is not None:
            total = self.size
        elif isinstance(self.split, list):
            total = sum(self.split) * self.unit
        else:
            total = local_shape[d] * coords.degree(self.axis)
        return _replace(tuple(local_shape), d, total)

    def layout(self, key: str, global_shape: tuple[int, ...], local_shape: tuple[int, ...], coords: Coords) -> SchemeLayout:
        """One box: this rank's slice on ``dim``."""
        g = tuple(global_shape)
        d = _dim(self.dim, len(g), key)
        n, r = coords.degree(self.axis), coords.rank_on(self.axis)
        start, length, owner = _unit_slice(g[d], self.unit, n, r, self.split, key, key)
        expect = _replace(g, d, length)
        if tuple(local_shape) != expect:
            raise LayoutError(
                f"{key}: {self.describe()} of global shape {list(g)} on {self.axis} rank {r} of {n} "
                f"holds shape {list(expect)}, but the local tensor has shape {list(local_shape)}"
            )
        if self.axis != "tp":
            owner = owner and _tp_owner(key, coords)
        targets = [Target(0, Box.whole(expect), _box_along(g, d, start, length), owner)] if length else []
        return SchemeLayout(g, targets, [(0, g[d])], d, self.axis)

    def to_json(self) -> dict[str, Any]:
        """JSON parameters."""
        d: dict[str, Any] = {"scheme": self.kind, "dim": self.dim, "axis": self.axis}
        if self.split != "chunk":
            d["split"] = self.split
        if self.unit != 1:
            d["unit"] = self.unit
        if self.size is not None:
            d["size"] = self.size
        return d


class VocabPadded(Scheme):
    """A vocabulary-parallel tensor padded past the real vocabulary (Megatron pads the
    vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``).

    The global tensor has the real ``size`` rows; rank r's local rows are
    ``[r*c, (r+1)*c)`` of the padded vocabulary (c = local rows). Rows past ``size`` are
    dropped on save and zero-filled on load, so any padding of the target works.
    """

    kind = "vocab"
    axis = "tp"

    def __init__(self, size: int, dim: int = 0) -> None:
        if size < 0:
            raise LayoutError(f"vocab: size must be >= 0, not {size}")
        self.size, self.dim = size, dim

    def global_shape(self, local_shape: tuple[int, ...], coords: Coords) -> tuple[int, ...]:
        """The local shape with the real vocabulary size on ``dim``."""
        return _replace(tuple(local_shape), _dim(self.dim, len(local_shape), self.describe()), self.size)

    def layout(self, key: str, global_shape: tuple[int, ...], local_shape: tuple[int, ...], coords: Coords) -> SchemeLayout:
        """The real-vocabulary rows of this rank's padded slice."""
        g, loc = tuple(global_shape), tuple(local_shape)
        d = _dim(self.dim, len(g), key)
        if g[d] != self.size or _replace(loc, d, self.size) != g:
            raise LayoutError(f"{key}: local shape {list(loc)} does not fit a vocabulary of {self.size} (global {list(g)})")
        c = loc[d]
        if c * coords.tp < self.size:
            raise LayoutError(f"{key}: {coords.tp} ranks of {c} rows hold fewer than the {self.size} vocabulary rows")
        lo = min(self.size, coords.tp_rank * c)
        hi = min(self.size, lo + c)
        targets = [Target(0, _box_along(loc, d, 0, hi - lo), _box_along(g, d, lo, hi - lo))] if hi > lo else []
        return SchemeLayout(g, targets, [(0, g[d])], d, "tp", covers_local=hi - lo == c)

    def to_json(self) -> dict[str, Any]:
        """JSON parameters."""
        return {"scheme": self.kind, "size": self.size, "dim": self.dim}


class Fused(Scheme):
    """A local tensor concatenating, on ``dim``, this rank's shards of several logical
    sub-parameters, each partitioned over tp on its own: QKV ``[q_r; k_r; v_r]`` (GQA:
    unequal sizes, kv heads replicated when kv_heads < tp), SwiGLU ``[gate_r; up_r]``.

    ``sizes`` are the sub-parameters' global sizes on ``dim``; ``units`` their cut unit
    (head_dim for q/k/v); ``split`` one split per sub-parameter (``"chunk"``,
    ``"balanced"`` or explicit per-rank widths in units: DeepSpeed's
    ``sub_param_shard_widths``). The global tensor is the fused ``[q; k; v]``: each
    sub-parameter shard is its own box of it. With ``names`` (templates expanded with
    the rule's match, e.g. ``r"\\1.wq.weight"``), each sub-parameter is instead its own
    global tensor.
    """

    kind = "fused"
    axis = "tp"

    def __init__(
        self,
        sizes: list[int],
        dim: int = 0,
        units: int | list[int] = 1,
        split: str | list[Any] = "chunk",
        names: list[str] | None = None,
    ) -> None:
        self.sizes = [int(s) for s in sizes]
        if not self.sizes:
            raise LayoutError("fused: needs at least one sub-parameter size")
        self.dim = dim
        self.units = [int(units)] * len(self.sizes) if isinstance(units, int) else [int(u) for u in units]
        self.split = split
        self.splits = [split] * len(self.sizes) if isinstance(split, str) else list(split)
        if len(self.units) != len(self.sizes) or len(self.splits) != len(self.sizes):
            raise LayoutError(f"fused: {len(self.sizes)} sub-parameters need as many units and splits")
        if names is not None and len(names) != len(self.sizes):
            raise LayoutError(f"fused: {len(self.sizes)} sub-parameters need {len(self.sizes)} names")
        self.names = list(names) if names is not None else None

    def global_shape(self, local_shape: tuple[int, ...], coords: Coords) -> tuple[int, ...]:
        """The local shape with the sum of the sub-parameter sizes on ``dim``."""
        return _replace(tuple(local_shape), _dim(self.dim, len(local_shape), self.describe()), sum(self.sizes))

    def layout(self, key: str, global_shape: tuple[int, ...], local_shape: tuple[int, ...], coords: Coords) -> SchemeLayout:
        """One box per sub-parameter shard (kv replicas owned by one rank)."""
        g, loc = tuple(global_shape), tuple(local_shape)
        d = _dim(self.dim, len(g), key)
        if g[d] != sum(self.sizes) or _replace(loc, d, g[d]) != g:
            raise LayoutError(f"{key}: fused sizes {self.sizes} on dim {d} do not fit global shape {list(g)}")
        targets, parts = [], []
        at_local, at_global = 0, 0
        for i, (size, unit, split) in enumerate(zip(self.sizes, self.units, self.splits)):
            start, length, owner = _unit_slice(size, unit, coords.tp, coords.tp_rank, split, key, f"{key} sub-parameter {i}")
            if length:
                targets.append(Target(i, _box_along(loc, d, at_local, length), _box_along(g, d, at_global + start, length), owner))
            parts.append((at_global, size))
            at_local += length
            at_global += size
        if loc[d] != at_local:
            raise LayoutError(
                f"{key}: fused sub-parameters {self.sizes} on tp rank {coords.tp_rank} of {coords.tp} hold "
                f"{at_local} on dim {d}, but the local tensor has shape {list(loc)}"
            )
        return SchemeLayout(g, targets, parts, d, "tp")

    def to_json(self) -> dict[str, Any]:
        """JSON parameters."""
        d: dict[str, Any] = {"scheme": self.kind, "sizes": self.sizes, "dim": self.dim}
        if any(u != 1 for u in self.units):
            d["units"] = self.units
        if self.split != "chunk":
            d["split"] = self.split
        if self.names is not None:
            d["names"] = self.names
        return d


# ---------------------------------------------------------------- short constructors


def replicated() -> Replicated:
    """Whole tensor on every rank; replicas checked on save."""
    return Replicated()


def averaged() -> Averaged:
    """Whole tensor on every rank; the checkpoint stores the replicas' mean."""
    return Averaged()


def partitioned(dim: int, axis: str = "tp", split: str | list[int] = "chunk", unit: int = 1, size: int | None = None) -> Partitioned:
    """Cut on ``dim`` over ``axis`` (see :class:`Partitioned`)."""
    return Partitioned(dim, axis, split, unit, size)


def column(split: str | list[int] = "chunk", unit: int = 1, size: int | None = None) -> Partitioned:
    """Column-parallel weight (output features, dim 0, cut over tp) or its bias."""
    return Partitioned(0, "tp", split, unit, size)


def row(split: str | list[int] = "chunk", unit: int = 1, size: int | None = None) -> Partitioned:
    """Row-parallel weight (input features, dim 1, cut over tp)."""
    return Partitioned(1, "tp", split, unit, size)


def vocab(size: int, dim: int = 0) -> VocabPadded:
    """Vocabulary-parallel, padded past ``size`` rows (see :class:`VocabPadded`)."""
    return VocabPadded(size, dim)


def fused(sizes: list[int], dim: int = 0, units: int | list[int] = 1, split: str | list[Any] = "chunk", names: list[str] | None = None) -> Fused:
    """Fused sub-parameters (see :class:`Fused`)."""
    return Fused(sizes, dim, units, split, names)


def experts(dim: int = 0, split: str | list[int] = "chunk") -> Partitioned:
    """Expert-parallel: experts stacked on ``dim``, cut over the ep axis."""
    return Partitioned(dim, "ep", split)


_KINDS: dict[str, type[Scheme]] = {c.kind: c for c in (Replicated, Averaged, Partitioned, VocabPadded, Fused)}


def scheme_from_json(d: dict[str, Any]) -> Scheme:
    """Rebuild a scheme from :meth:`Scheme.to_json`."""
    d = dict(d)
    kind = d.pop("scheme", None)
    cls = _KINDS.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise LayoutError(f"unknown scheme {kind!r}")
    return cls(**d)
