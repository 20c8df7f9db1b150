"""On load: read replicated state once per replica group and broadcast it.

Rule-described shards held by several replicas (``Sharded`` with ``replicas > 1``: the
weights replicated over data parallelism) and DTensor shards held by several ranks of
their mesh (``Replicate`` over a mesh dimension) are split among their replicas, each reading its
share and broadcasting it (:class:`ShardedReplicas`): by default wherever the rule
(:func:`sharing_pays`) says it is faster, given where the bytes come from (the storage's
``read_rate``) and the group's backend; ``load(..., broadcast_replicated=False)`` reads
them whole on every rank. With ``broadcast_replicated=True`` they are always shared, and
each plain (non-DTensor) target tensor too, which is whole on every rank: one rank
(chosen by a hash of its name) reads it and broadcasts it over the group. Shared, the load
is collective. The rule and its figures: docs/SCALE.md, "Replicated state: the rule".
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from ..dist import Group, all_gather_fixed, group_cache, new_group
from ..errors import LayoutError, UnickptError
from ..storage.base import READ_RATE
from ..plan.save_plan import replica_owner, replica_shares
from .items import TensorItem, cut_rows, mesh_replicas, row_slice
from .state import Sharded


# bytes/s one replica receives while the replicas broadcast their shares, by backend: gloo
# over TCP (0.43 GB/s between 4 local processes, bench/scale_recovery.py), NCCL over
# NVLink / InfiniBand (tens of GB/s)
BROADCAST_RATE = {"gloo": 0.4e9, "nccl": 20e9}


def sharing_pays(read_rate: float, broadcast_rate: float) -> bool:
    """Whether R >= 2 replicas needing the same B bytes load them faster by reading a share
    each and broadcasting: whole, B / s; shared, B / (R s) + B (R - 1) / (R b). Shared is
    faster exactly when b > s, whatever B and R (the fixed cost, one small all-gather and
    the first time the replicas' process group, aside)."""
    return broadcast_rate > read_rate


def share_by_default(state: dict[str, Any], group: Group, storage: Any) -> bool:
    """``broadcast_replicated``'s default: share when the rule says it pays for ``storage``
    (its ``read_rate``, else a local file's) and the group's backend, and the state holds
    replicated rule-described shards. Decided alike on every rank of a data-parallel job
    (the storage, the backend, and replicas: a dimension of the mesh every rank has), so
    the collective it implies is entered by all or by none."""
    if not group.active or group.size < 2:
        return False
    rate = float(getattr(storage, "read_rate", READ_RATE["local"]))
    backend = "nccl" if group.device().type == "cuda" else "gloo"  # the device the group's collectives run on
    if not sharing_pays(rate, BROADCAST_RATE[backend]):
        return False
    return _holds_replicated(state)


def _holds_replicated(value: Any) -> bool:
    """Whether ``value`` holds a ``Sharded`` with replicas or a DTensor replicated over a
    mesh dimension, in nested dicts, lists and tuples (Stateful objects are not asked for
    their state: no side effect before the load)."""
    if isinstance(value, Sharded):
        return value.replicas > 1
    if isinstance(value, torch.Tensor):
        return mesh_replicas(value) > 1
    if isinstance(value, dict):
        return any(_holds_replicated(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_replicated(v) for v in value)
    return False


class ReplicatedReads:
    """Decides who reads which replicated tensor, then broadcasts them (collective)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.shared: dict[str, tuple[torch.Tensor, int]] = {}

    def read_here(self, name: str, target: torch.Tensor) -> bool:
        """Whether this rank reads ``target`` itself (it owns it, or it cannot be shared)."""
        if not self.group.active or not target.is_contiguous() or target.device != self.group.device():
            return True
        owner = replica_owner(name, (), self.group.size)
        self.shared[name] = (target, owner)
        return owner == self.group.rank

    def finish(self, failed: bool) -> None:
        """Collective: agree that every rank read its part, then broadcast each shared
        tensor from its reader. Raises on every rank if any rank failed."""
        if not self.group.active:
            return
        names = hashlib.blake2b("\n".join(sorted(self.shared)).encode(), digest_size=8).digest()
        reports = all_gather_fixed(self.group, names + _flag(failed))
        _raise_if_others_failed(reports, failed)
        if failed:
            return
        if any(rep[:8] != names for rep in reports):
            raise LayoutError("broadcast_replicated=True needs the same plain tensors on every rank of the group")
        for name in sorted(self.shared):
            target, owner = self.shared[name]
            dist.broadcast(target.detach(), src=self.group.global_rank(owner), group=self.group.pg)


def _flag(failed: bool) -> bytes:
    """The last byte of a rank's report: whether its part of the load failed."""
    return b"\x01" if failed else b"\x00"


def _raise_if_others_failed(reports: list[bytes], failed: bool) -> None:
    """Every rank's report ends with its :func:`_flag`: when another rank failed and this
    one did not, raise here too (a failed rank raises its own error)."""
    bad = [r for r, rep in enumerate(reports) if rep[-1:] != b"\x00"]
    if bad and not failed:
        raise UnickptError(f"load failed on rank(s) {', '.join(map(str, bad))}; see their errors")


_GROUPS: dict[tuple, Any] = group_cache()  # process groups of replicas, made once per set of ranks; emptied at exit


class ShardedReplicas:
    """``Sharded`` targets held by several replicas (rule-described weights replicated
    over data parallelism): instead of every replica reading the whole shard, the ranks
    holding the same replicated shards (found by comparing one digest of them) split
    them as a save does (``replica_shares``: each reads about 1/N of the bytes, cut at
    rows), then each share is broadcast from its reader over a process group of those
    ranks (collective; created once per set of ranks, by its members only). Rows of a
    target covered by no stored piece (padding) take the reading replica's values."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.items: list[tuple[Any, TensorItem]] = []  # (entry, item), deferred
        self.members: list[int] = []
        self.pg: Any = None
        self.line: list[tuple[Any, TensorItem]] = []

    def defer(self, entry: Any, item: TensorItem) -> bool:
        """Take ``item`` (of manifest ``entry``) to read by shares; False when it must be
        read here whole (no replicas, or not a tensor that can be broadcast as it is)."""
        t = item.local
        if not self.group.active or item.replicas < 2 or not t.is_contiguous() or t.device != self.group.device():
            return False
        self.items.append((entry, item))
        return True

    def plan(self, failed: bool) -> list[tuple[Any, TensorItem]]:
        """Collective: find this rank's replicas; the parts (entry, row slice) it reads.
        When the replicas cannot be matched (a rank failed, or the ranks holding the same
        shards are not as many as the shards' replica count) every deferred item is read
        whole here, as without sharing."""
        line = sorted(self.items, key=lambda ei: (ei[1].name, ei[1].shard_key))
        digest = hashlib.blake2b(repr([(i.name, i.shard_key, i.replicas) for _, i in line]).encode(), digest_size=8).digest()
        reports = all_gather_fixed(self.group, digest + _flag(failed))
        members = [r for r, rep in enumerate(reports) if rep[:8] == digest]
        if failed or any(rep[8:] != b"\x00" for rep in reports) or not line or len(members) != line[0][1].replicas \
                or any(i.replicas != len(members) for _, i in line):
            return [] if failed else line
        self.members, self.line = members, line
        key = (id(self.group.pg), tuple(members))
        if key not in _GROUPS:
            _GROUPS[key] = new_group([self.group.global_rank(m) for m in members], local=True)
        self.pg = _GROUPS[key]
        return self.parts(members.index(self.group.rank))

    def parts(self, share: int) -> list[tuple[Any, TensorItem]]:
        """The row slices of the line replica ``share`` reads."""
        return shared_parts(self.line, len(self.members), share)

    def finish(self, failed: bool) -> None:
        """Collective: agree every rank read its shares, then broadcast each from its
        reader to the other replicas. Raises on every rank if any rank failed."""
        if not self.group.active:
            return
        _raise_if_others_failed(all_gather_fixed(self.group, _flag(failed)), failed)
        if failed or self.pg is None:
            return
        for share, member in enumerate(self.members):
            src = self.group.global_rank(member)
            for _, part in self.parts(share):
                dist.broadcast(part.local, src=src, group=self.pg)


def shared_parts(line: list[tuple[Any, TensorItem]], replicas: int, share: int) -> list[tuple[Any, TensorItem]]:
    """Of ``line`` (``(entry, item)`` of the replicated shards the same ``replicas`` ranks
    hold, sorted by name and shard), the row slices replica ``share`` reads: the cut of
    :func:`~unickpt.plan.save_plan.replica_shares`, as a save cuts the writes."""
    items = [i for _, i in line]
    sizes = [i.local.numel() * i.local.element_size() for i in items]
    shares = replica_shares(sizes, [cut_rows(i) for i in items], replicas, share)
    return [(line[k][0], row_slice(items[k], a, b) if cut_rows(items[k]) > 1 else items[k]) for k, a, b in shares]
