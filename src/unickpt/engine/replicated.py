"""Optional on load: read each replicated plain tensor on one rank and broadcast it.

By default every rank reads every byte it needs (no collective, so a failing rank cannot
hang the others). A plain (non-DTensor) target tensor is whole on every rank, so N ranks
read it N times. With ``load(..., broadcast_replicated=True)`` each such tensor is read
by one rank (chosen by a hash of its name, spreading them over the ranks) and broadcast
over the group; the load becomes collective. Whether that is faster depends on where the
bytes come from and on the network: see docs/PERFORMANCE.md.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..dist import Group, all_gather_fixed
from ..errors import LayoutError, UnickptError
from ..plan.save_plan import replica_owner


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
        reports = all_gather_fixed(self.group, names + (b"\x01" if failed else b"\x00"))
        bad = [r for r, rep in enumerate(reports) if rep[8:] != b"\x00"]
        if bad and not failed:
            raise UnickptError(f"load failed on rank(s) {', '.join(map(str, bad))}; see their errors")
        if failed:
            return
        if any(rep[:8] != names for rep in reports):
            raise LayoutError("broadcast_replicated=True needs the same plain tensors on every rank of the group")
        for name in sorted(self.shared):
            target, owner = self.shared[name]
            dist.broadcast(target.detach(), src=self.group.global_rank(owner), group=self.group.pg)
