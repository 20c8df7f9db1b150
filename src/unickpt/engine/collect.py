"""What one rank contributes to a save (collective): its state, classified (fragments it
owns, values to check and commit, per-rank state) by :func:`collect`, as a
:class:`LocalState`. The first step of every writer of a unickpt checkpoint
(:mod:`unickpt.engine.commit` states the whole protocol)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dist import Group, all_gather_fixed, group_cache
from ..format.checksum import crc32c
from ..format.dtypes import dtype_name
from ..format.values import encode_value
from ..plan.box import Box
from ..plan.save_plan import replica_shares
from .items import Holders, TensorItem, cut_rows, is_dtensor, row_slice, sharded_item, tensor_item
from .optim_state import NamedOptimizer
from .state import Leaf, PerRank, Sharded, flatten
from .writer import as_bytes

__all__ = ["LocalState", "collect", "holders_of", "replica_parts", "tensor_digest"]

@dataclass
class LocalState:
    """What one rank contributes to a checkpoint, split by kind."""

    to_write: list[TensorItem] = field(default_factory=list)
    declared: dict[str, tuple[tuple[int, ...], str, str]] = field(default_factory=dict)
    replicated: list[str] = field(default_factory=list)  # replicated tensors held as the first or last replica
    digests: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    rank_values: dict[str, Any] = field(default_factory=dict)
    rank_tensors: list[TensorItem] = field(default_factory=list)
    leader: bool = True
    digest_sources: dict[str, torch.Tensor] = field(default_factory=dict)
    # an optimizer's param_groups: each rank's, joined by rank 0 (pipeline stages hold parts of a group)
    group_values: dict[str, Any] = field(default_factory=dict)


def _stage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy (or the tensor itself when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()




def holders_of(names: list[str] | None, group: Group) -> Holders:
    """Find the ranks holding the same state names as this one (one 8-byte hash per rank).
    ``names`` None: this rank failed to list its state and only joins the exchange (its
    hash matches no rank's), so that the ranks' collectives stay in step."""
    text = "\0failed" if names is None else "\n".join(sorted(names))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    hashes = all_gather_fixed(group, digest)
    return Holders(group, [r for r, h in enumerate(hashes) if h == digest])


def tensor_digest(dtype: str, shape: tuple[int, ...], crc: int) -> str:
    """The agreement digest of a replicated tensor (rank 0 compares them between ranks)."""
    return f"tensor {dtype} {list(shape)} crc32c={crc:08x}"


# keyed on DTensor specs, which hold their device mesh and so its process groups: emptied
# at exit with unickpt's own groups (release_groups), or the mesh's gloo groups would live
# on into the interpreter's finalization (where they can abort the process)
_ITEMS: dict[tuple, tuple | None] = group_cache()


def _tensor_item(name: str, t: torch.Tensor, holders: Holders) -> TensorItem | None:
    """``tensor_item``, memoized for DTensors on their spec (mesh, placements, shape,
    stride, dtype) and the holders: pieces and replica roles depend on nothing else, and
    computing them dominates the time of a save's call for models with many tensors."""
    if not is_dtensor(t):
        return tensor_item(name, t, holders)
    try:
        key = (name, t._spec, tuple(t.placements), tuple(holders.members), holders.group.rank, holders.group.size, id(holders.group.pg))
        known = key in _ITEMS
    except (AttributeError, TypeError):  # a torch without hashable specs: no memo
        return tensor_item(name, t, holders)
    if not known:
        item = tensor_item(name, t, holders)
        if len(_ITEMS) > 100_000:
            _ITEMS.clear()
        _ITEMS[key] = None if item is None else (item.global_shape, item.pieces, item.replica_index, item.replicas, item.layout)
        return item
    fields = _ITEMS[key]
    if fields is None:
        return None
    local = getattr(t, "_local_tensor", None)
    return TensorItem(name, local if local is not None else t.to_local(), *fields)


@dataclass
class FlatState:
    """A state flattened once (:func:`flatten_state`), for a caller that reads it before
    saving it (the snapshots count its bytes first): :func:`collect` takes it in place of
    the state, and does not call every ``state_dict()`` a second time."""

    leaves: list[Leaf]
    groups: set[str]  # the flattened names of the param_groups of optimizers keyed by parameter name


def flatten_state(state_dict: dict[str, Any]) -> FlatState:
    """``state_dict`` flattened as :func:`collect` does (:func:`~unickpt.engine.state.flatten`)."""
    groups: set[str] = set()

    def on_stateful(name: str, obj: Any) -> dict[str, Any]:
        if isinstance(obj, NamedOptimizer) and obj.by_name:
            groups.add(f"{name}.param_groups")
        return obj.state_dict()

    return FlatState(flatten(state_dict, on_stateful), groups)


def collect(state_dict: dict[str, Any] | FlatState, group: Group, defer: bool = False) -> LocalState:
    """Classify this rank's state (collective): fragments it owns, values to check and
    commit, per-rank state. Copies what it will write to host memory, unless ``defer``:
    then tensors to write still refer to the live state and replicated tensors whose
    digest is still to be computed are listed in ``digest_sources`` (async save stages
    and digests them itself). ``state_dict`` may be one already flattened
    (:func:`flatten_state`)."""
    _stage_fn = (lambda t: t.detach()) if defer else _stage
    out = LocalState()
    try:
        flat = state_dict if isinstance(state_dict, FlatState) else flatten_state(state_dict)
    except Exception:  # a Stateful's state_dict() that fails: still join the others' exchange, then fail
        holders_of(None, group)
        raise
    leaves, groups = flat.leaves, flat.groups
    holders = holders_of([leaf.name for leaf in leaves if not isinstance(leaf.value, PerRank)], group)
    out.leader = holders.members[0] == group.rank
    lines: dict[tuple, list[TensorItem]] = {}
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, PerRank):
            if isinstance(v.value, torch.Tensor):
                out.rank_tensors.append(tensor_item(leaf.name, _stage_fn(v.value), None))
            else:
                out.rank_values[leaf.name] = encode_value(v.value, leaf.name)
            continue
        if isinstance(v, (torch.Tensor, Sharded)):
            kind = "sharded" if isinstance(v, Sharded) else "dtensor" if is_dtensor(v) else "plain"
            if isinstance(v, Sharded):
                item = sharded_item(leaf.name, v)
                v = v.local
            else:
                item = _tensor_item(leaf.name, v, holders)
            if item is None:
                continue
            dtype = dtype_name(v.dtype)
            if item.layout == "replicated":
                item.local = _stage_fn(v)
                if defer:
                    out.digest_sources[leaf.name] = item.local
                elif group.size == 1:  # no other rank to agree with: no pass over the bytes
                    out.digests[leaf.name] = tensor_digest(dtype, tuple(item.local.shape), 0)
                else:
                    out.digests[leaf.name] = tensor_digest(dtype, tuple(item.local.shape), crc32c(as_bytes(item.local)))
            if item.pieces and item.replicas > 1:
                lines.setdefault(_line_key(item, kind), []).append(item)
            elif item.pieces:
                item.local = _stage_fn(item.local)
                out.to_write.append(item)
            # a tensor this rank writes comes with its fragment; the leader declares empty
            # ones, and the first and last of several replicas name the tensor (rank 0 checks that
            # some replica wrote it)
            if not item.pieces and out.leader and Box.whole(item.global_shape).volume == 0:
                out.declared[leaf.name] = (item.global_shape, dtype, item.layout)
            elif item.pieces and item.replicas > 1 and item.replica_index in (0, item.replicas - 1):
                out.replicated.append(leaf.name)
            continue
        enc = encode_value(v, leaf.name)
        if leaf.name in groups:
            out.group_values[leaf.name] = enc
            continue
        out.values[leaf.name] = enc
        out.digests[leaf.name] = hashlib.sha256(json.dumps(enc, sort_keys=True).encode()).hexdigest()
    for line in lines.values():
        for part in replica_parts(line):
            part.local = _stage_fn(part.local)
            out.to_write.append(part)
    return out


def _line_key(item: TensorItem, kind: str) -> tuple:
    """Which line of replicated tensors ``item`` joins: tensors whose replicas are the same
    ranks, as every one of those ranks sees them (plain tensors: all holders; DTensors:
    the same layout; Sharded: the same replica count, which the rules give per set of
    replica axes, and the same index; see docs/FORMAT.md, "Who writes replicas")."""
    key = (kind, item.replicas, item.replica_index)
    return key if kind == "sharded" else key + (item.layout,)


def replica_parts(line: list[TensorItem]) -> list[TensorItem]:
    """This rank's share of a line of replicated tensors (all of the same replicas):
    whole tensors or row slices, cut by :func:`~unickpt.plan.save_plan.replica_shares`."""
    line = sorted(line, key=lambda i: (i.name, i.shard_key))
    sizes = [i.local.numel() * i.local.element_size() for i in line]
    shares = replica_shares(sizes, [cut_rows(i) for i in line], line[0].replicas, line[0].replica_index)
    return [row_slice(line[k], a, b) if cut_rows(line[k]) > 1 else line[k] for k, a, b in shares]


