"""Turning flattened leaves into the tensors a rank stores or fills, with their pieces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LayoutError
from ..plan.box import Box
from ..plan.piece import Piece, whole_piece
from .state import Sharded
from ..plan.placement import dtensor_pieces, replica_group

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]


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


def is_dtensor(t: Any) -> bool:
    """True for a DTensor."""
    return DTensor is not None and isinstance(t, DTensor)


def _shard_order(dt: Any) -> list[tuple[int, tuple[int, ...]]] | None:
    spec = dt._spec
    order = getattr(spec, "shard_order", None)
    if not order or getattr(spec, "use_strided_shard_as_shard_order", False):
        return None
    return [(int(e.tensor_dim), tuple(int(m) for m in e.mesh_dims)) for e in order]


def _implicit_replicas(mesh: Any, group_size: int) -> tuple[int, int]:
    """Replication outside the DTensor's mesh (e.g. a TP mesh inside a DDP job)."""
    if mesh.size() >= group_size:
        return 0, 1
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else None
    names = mesh.mesh_dim_names or ()
    if root is None or root.size() != group_size or not root.mesh_dim_names or not names:
        raise LayoutError(
            f"DTensor on a mesh of {mesh.size()} ranks in a group of {group_size}: "
            "cannot tell which ranks hold replicas; give the mesh dim names from a root mesh over the whole group"
        )
    coord = root.get_coordinate()
    index, size = 0, 1
    for d, n in enumerate(root.mesh_dim_names):
        if n not in names:
            index = index * root.size(d) + coord[d]
            size *= root.size(d)
    return index, size


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


def tensor_item(name: str, t: torch.Tensor, group_rank: int, group_size: int, replicated: bool) -> TensorItem | None:
    """The TensorItem of a leaf tensor; None when this rank holds no part of it.

    ``replicated`` says whether a plain tensor is held identically by every rank of the
    group (True) or belongs to this rank alone (a PerRank tensor, False).
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
        index, size = replica_group(tuple(mesh.shape), tuple(coord), placements)
        extra_index, extra_size = _implicit_replicas(mesh, group_size)
        return TensorItem(
            name, local, shape, pieces, index * extra_size + extra_index, size * extra_size,
            describe_placements(placements, mesh),
        )
    shape = tuple(t.shape)
    pieces = [whole_piece(shape)] if t.numel() else []
    if replicated:
        return TensorItem(name, t, shape, pieces, group_rank, group_size, "replicated")
    return TensorItem(name, t, shape, pieces, 0, 1, "per-rank")
