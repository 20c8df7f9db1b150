"""A private copy of a training state kept aside, to put back after a failed load."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..engine.items import is_dtensor
from ..engine.state import PerRank, Sharded, flatten, optimizers_of, without_optimizers, write_back


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


class StateCopy:
    """The values of ``state`` now (every tensor's bytes, every plain value, every
    Stateful's state dict), so that :meth:`put_back` returns ``state`` to them exactly
    after a load that failed midway had overwritten part of it. Host memory: one copy of
    the rank's state."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.optimizers = [(opt, copy.deepcopy(opt.state_dict())) for _, opt in optimizers_of(state)]
        self.values = {leaf.name: _copy(leaf.value) for leaf in flatten(without_optimizers(state))}

    def put_back(self) -> None:
        """Return ``state`` to the values it had when copied (in place; Stateful objects
        get ``load_state_dict`` with their copied state)."""
        statefuls: list[tuple[Any, dict[str, Any]]] = []

        def on_stateful(name: str, obj: Any) -> dict[str, Any]:
            sd = obj.state_dict()
            statefuls.append((obj, sd))
            return sd

        for opt, sd in self.optimizers:
            opt.load_state_dict(copy.deepcopy(sd))
        rest = without_optimizers(self.state)
        for leaf in flatten(rest, on_stateful):
            if leaf.name not in self.values:
                continue
            now, saved = leaf.value, self.values[leaf.name]
            if isinstance(now, Sharded) and isinstance(saved, Sharded):
                now.local.copy_(saved.local)
            elif isinstance(now, torch.Tensor) and isinstance(saved, torch.Tensor) and now.shape == saved.shape:
                _local(now).copy_(_local(saved))
            elif isinstance(now, PerRank) and isinstance(saved, PerRank):
                now.value = copy.deepcopy(saved.value)
            else:
                leaf.replace(copy.deepcopy(saved))
        for obj, sd in reversed(statefuls):
            obj.load_state_dict(sd)
        write_back(self.state, rest)


def _copy(value: Any) -> Any:
    if isinstance(value, Sharded):
        return Sharded(value.local.detach().clone(), value.global_shape, value.pieces, value.replica_index,
                       value.replicas, value.layout)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)
