"""Turning flattened leaves into the tensors a rank stores or fills, with their pieces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import LayoutError
from ..plan.box import Box
from ..plan.piece import Piece, whole_piece
from .state import Sharded
from ..dist import Group, is_dtensor
from ..plan.placement import dtensor_pieces



@dataclass
class TensorItem:
    """A tensor as this rank sees it: its global identity, local data and layout."""

    name: str
    local: torch.Tensor
    global_shape: tuple[int, ...]
    pieces: list[Piece]
    replica_index: int
    replicas: int
    layout: str

    @property
    def shard_key(self) -> tuple[int, ...]:
        """Identifies the shard among all shards of the tensor (its first global offset)."""
        return self.pieces[0].global_box.offsets if self.pieces else ()


def _shard_order(dt: Any) -> list[tuple[int, tuple[int, ...]]] | None:
    spec = dt._spec
    order = getattr(spec, "shard_order", None)
    if not order or getattr(spec, "use_strided_shard_as_shard_order", False):
        return None
    return [(int(e.tensor_dim), tuple(int(m) for m in e.mesh_dims)) for e in order]


@dataclass
class Holders:
    """The ranks of the group that hold the same set of state names as this rank.

    Ranks exchange one hash of their sorted state names (8 bytes each, no plans), so each
    rank knows locally who else holds its tensors: in SPMD jobs that is every rank; with
    pipeline parallelism, the ranks of the same stage. Replicas of a shard are looked for
    among these ranks only.
    """

    group: Group
    members: list[int]
    _cache: dict = field(default_factory=dict)

    def plain(self) -> tuple[int, int]:
        """(index, count) of this rank among the holders of a plain replicated tensor."""
        return self.members.index(self.group.rank), len(self.members)

    def dtensor(self, name: str, mesh: Any, coord: tuple[int, ...], placements: tuple) -> tuple[int, int]:
        """(index, count) of this rank among the holders of the same DTensor shard."""
        key = (id(mesh), placements)
        if key not in self._cache:
            self._cache[key] = self._dtensor_replicas(name, mesh, coord, placements)
        replicas = self._cache[key]
        return replicas.index(self.group.rank), len(replicas)

    def _dtensor_replicas(self, name: str, mesh: Any, coord: tuple[int, ...], placements: tuple) -> list[int]:
        from torch.distributed.tensor import Replicate

        members = set(self.members)
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        names = mesh.mesh_dim_names or ()
        if root is not mesh and root.size() != mesh.size() and root.mesh_dim_names and names:
            where = dict(zip(names, zip(coord, placements)))
            index = tuple(
                slice(None) if n not in where or isinstance(where[n][1], Replicate) else where[n][0]
                for n in root.mesh_dim_names
            )
            candidates = root.mesh[index].flatten().tolist()
        else:
            index = tuple(slice(None) if isinstance(p, Replicate) else c for c, p in zip(coord, placements))
            candidates = mesh.mesh[index].flatten().tolist()
            outside = members - {self.group.group_rank_of(g) for g in mesh.mesh.flatten().tolist()}
            if outside:
                raise LayoutError(
                    f"{name}: DTensor on a mesh of {mesh.size()} ranks while ranks {sorted(outside)[:8]} outside it hold "
                    "the same state; build the mesh from a root mesh with named dims (init_device_mesh(..., "
                    "mesh_dim_names=...)[...]) so unickpt can tell replicas apart"
                )
        replicas = sorted(r for r in (self.group.group_rank_of(g) for g in candidates) if r in members)
        if self.group.rank not in replicas:
            replicas = sorted(replicas + [self.group.rank])
        return replicas


def describe_placements(placements: Any, mesh: Any) -> str:
    """Short text of a DTensor layout, e.g. ``(Shard(0), Replicate()) on mesh (2, 2)``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def one(p: Any) -> str:
        if isinstance(p, _StridedShard):
            return f"StridedShard({p.dim}, split_factor={p.split_factor})"
        if isinstance(p, Shard):
            return f"Shard({p.dim})"
        if isinstance(p, Replicate):
            return "Replicate()"
        return str(p)

    return f"({', '.join(one(p) for p in placements)}) on mesh {tuple(mesh.shape)}"


def sharded_item(name: str, s: Sharded) -> TensorItem:
    """The TensorItem of an explicitly laid out tensor, after checking its pieces fit."""
    whole = Box.whole(tuple(s.global_shape))
    for p in s.pieces:
        if p.global_box.ndim != whole.ndim or not whole.contains(p.global_box):
            raise LayoutError(f"{name}: piece {p.global_box} lies outside global shape {tuple(s.global_shape)}")
        if p.flat_extent[1] > s.local.numel():
            raise LayoutError(f"{name}: piece {p} reaches past the local tensor of shape {tuple(s.local.shape)}")
    if not 0 <= s.replica_index < s.replicas:
        raise LayoutError(f"{name}: replica index {s.replica_index} not in 0..{s.replicas - 1}")
    return TensorItem(name, s.local, tuple(s.global_shape), list(s.pieces), s.replica_index, s.replicas, s.layout)


def tensor_item(name: str, t: torch.Tensor, holders: Holders | None) -> TensorItem | None:
    """The TensorItem of a leaf tensor; None when this rank holds no part of it.

    ``holders`` gives the ranks holding the same state (for replica ownership); None
    means the tensor belongs to this rank alone (a PerRank tensor, or a load target).
    """
    if is_dtensor(t):
        mesh = t.device_mesh
        coord = mesh.get_coordinate()
        if coord is None:
            return None
        placements = tuple(t.placements)
        shape = tuple(t.shape)
        local = t.to_local()
        pieces = dtensor_pieces(shape, tuple(mesh.shape), tuple(coord), placements, _shard_order(t))
        if pieces:
            vol = sum(p.global_box.volume for p in pieces)
            if vol != local.numel() or pieces[0].view != tuple(local.shape):
                raise LayoutError(
                    f"{name}: local shard of shape {tuple(local.shape)} does not match its placements "
                    f"{describe_placements(placements, mesh)} for global shape {shape}"
                )
        index, size = holders.dtensor(name, mesh, tuple(coord), placements) if holders else (0, 1)
        return TensorItem(name, local, shape, pieces, index, size, describe_placements(placements, mesh))
    shape = tuple(t.shape)
    pieces = [whole_piece(shape)] if t.numel() else []
    if holders is not None:
        index, size = holders.plain()
        return TensorItem(name, t, shape, pieces, index, size, "replicated")
    return TensorItem(name, t, shape, pieces, 0, 1, "per-rank")


def mesh_replicas(t: Any) -> int:
    """How many ranks of a DTensor's mesh hold the same local shard as this one: the
    product of the sizes of the mesh dimensions it is ``Replicate`` over (1 for a plain
    tensor)."""
    if not is_dtensor(t):
        return 1
    from torch.distributed.tensor import Replicate

    n = 1
    for size, p in zip(t.device_mesh.shape, t.placements, strict=True):
        if isinstance(p, Replicate):
            n *= int(size)
    return n


def cut_rows(item: TensorItem) -> int:
    """Rows along which ``item`` may be cut into separately stored parts (its first
    dimension), or 1 when it must be stored whole (0-d, or pieces that are flat runs)."""
    shape = tuple(item.local.shape)
    if not shape or any(p.flat_offset or p.view != shape for p in item.pieces):
        return 1
    return shape[0]


def row_slice(item: TensorItem, first: int, end: int) -> TensorItem:
    """The part of ``item`` holding rows ``[first, end)`` of its local tensor, with its
    pieces clipped to those rows (``item`` must be cut along rows: :func:`cut_rows`)."""
    shape = tuple(item.local.shape)
    if (first, end) == (0, shape[0] if shape else 1):
        return item
    view = (end - first,) + shape[1:]
    pieces = []
    for p in item.pieces:
        a, b = max(first, p.local_offsets[0]), min(end, p.local_offsets[0] + p.global_box.lengths[0])
        if a >= b:
            continue
        g = p.global_box
        glob = Box((g.offsets[0] + a - p.local_offsets[0],) + g.offsets[1:], (b - a,) + g.lengths[1:])
        pieces.append(Piece(glob, (a - first,) + p.local_offsets[1:], view, 0))
    return TensorItem(item.name, item.local.narrow(0, first, end - first), item.global_shape, pieces,
                      item.replica_index, item.replicas, item.layout)
