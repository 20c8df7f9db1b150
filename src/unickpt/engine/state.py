"""Walking a user's nested state: flattening to dotted names, Stateful objects, PerRank values.

Names follow DCP's convention: nested keys joined with ".", list positions as numbers.
Lists and tuples holding no tensor are plain values; dicts are always descended (an
empty dict is a plain value, so it round-trips). A torch optimizer is seen through its
parameter names (``optim_state``): ``optim.state.<param name>.exp_avg``, as torch's
``get_state_dict`` names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnickptError
from .optim_state import is_optimizer, named_optimizer

__all__ = ["PerRank", "Sharded"]


@dataclass
class PerRank:
    """Marks state that differs between ranks by nature (a data-loader position, a local
    RNG state). It is stored once per rank instead of being checked for agreement.

    On load, a ``PerRank`` in the target receives this rank's saved value in ``.value``
    (same world size), or use :func:`unickpt.load_rank_values` to reshard it yourself.

    Args:
        value: This rank's value: a tensor or plain data.
    """

    value: Any


@dataclass
class Sharded:
    """A plain local tensor with an explicit layout: the pieces of a global tensor it holds.

    This is how state that carries no placement of its own (Megatron-style TP slices,
    ZeRO flat partitions, pipeline-stage tensors) enters save and load; the rules layer
    builds these. ``replica_index``/``replicas`` say which copy this is when several ranks
    hold the same pieces (exactly one copy is written). On load the target's ``local``
    is filled in place; elements covered by no piece (padding) are left as they are.

    Args:
        local: This rank's tensor (saved from, loaded into in place).
        global_shape: The shape of the whole tensor.
        pieces: The pieces of the global tensor ``local`` holds
            (:class:`~unickpt.plan.piece.Piece`).
        replica_index: Which copy this is, when several ranks hold the same pieces.
        replicas: How many ranks hold them (exactly one copy is written).
        layout: A name for the layout, stored in the manifest.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    pieces: list[Any]
    replica_index: int = 0
    replicas: int = 1
    layout: str = "explicit"


@dataclass
class Leaf:
    """One flattened entry: its dotted name, its value, and where it lives (to replace it)."""

    name: str
    value: Any
    parent: Any
    key: Any

    def replace(self, new: Any) -> None:
        """Put ``new`` in place of this leaf's value in its container."""
        if isinstance(self.parent, tuple):
            raise UnickptError(f"cannot replace {self.name!r}: it sits inside a tuple; use a list")
        self.parent[self.key] = new


def is_stateful(obj: Any) -> bool:
    """True for objects following DCP's Stateful protocol (``state_dict``/``load_state_dict``)."""
    return (
        not isinstance(obj, (dict, list, tuple, torch.Tensor))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def _holds_state(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, PerRank, Sharded)) or is_stateful(obj):
        return True
    if isinstance(obj, dict):
        return any(_holds_state(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_state(v) for v in obj)
    return False


def flatten(
    state: dict[str, Any],
    on_stateful: Callable[[str, Any], dict[str, Any]] | None = None,
) -> list[Leaf]:
    """Flatten ``state`` into leaves in a deterministic order.

    ``on_stateful(name, obj)`` is called for each Stateful object and returns the dict to
    descend into (by default ``obj.state_dict()``). A torch optimizer is handed over as a
    :class:`~unickpt.engine.optim_state.NamedOptimizer` (its state keyed by the names of its
    parameters in the modules of ``state``) unless its own ``state_dict`` names them.
    """
    if not isinstance(state, dict):
        raise UnickptError(f"state_dict must be a dict, not {type(state).__name__}")
    leaves: list[Leaf] = []
    seen: set[str] = set()
    modules: list[tuple[str, Any]] | None = None

    def visit(name: str, value: Any, parent: Any, key: Any) -> None:
        nonlocal modules
        if is_stateful(value):
            if is_optimizer(value):
                if modules is None:
                    modules = find_modules(state)
                value = named_optimizer(value, modules, name)
            sd = on_stateful(name, value) if on_stateful else value.state_dict()
            for k, v in sd.items():
                visit(f"{name}.{k}" if name else str(k), v, sd, k)
            return
        descend = (isinstance(value, dict) and value) or (isinstance(value, (list, tuple)) and _holds_state(value))
        if descend:
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                visit(f"{name}.{k}" if name else str(k), v, value, k)
            return
        if name in seen:
            raise UnickptError(f"two entries of the state flatten to the same name {name!r}")
        seen.add(name)
        leaves.append(Leaf(name, value, parent, key))

    for k, v in state.items():
        visit(str(k), v, state, k)
    return leaves


def _objects(state: dict[str, Any], kind: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """The objects of ``state`` that ``kind`` accepts (not inside Stateful objects), with
    their flattened names, in flattening order."""
    found: list[tuple[str, Any]] = []

    def visit(name: str, value: Any) -> None:
        if kind(value):
            found.append((name, value))
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(f"{name}.{k}" if name else str(k), v)
        elif isinstance(value, (list, tuple)):
            for k, v in enumerate(value):
                visit(f"{name}.{k}" if name else str(k), v)

    visit("", state)
    return found


def find_modules(state: dict[str, Any]) -> list[tuple[str, torch.nn.Module]]:
    """The ``nn.Module`` objects in ``state`` (not inside other Stateful objects), with
    their flattened names, in flattening order."""
    return _objects(state, lambda v: isinstance(v, torch.nn.Module))


def optimizers_of(state: dict[str, Any]) -> list[tuple[str, torch.optim.Optimizer]]:
    """The torch optimizers of ``state`` with their flattened keys, in order."""
    return _objects(state, is_optimizer)


def without_optimizers(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every optimizer left out (same structure otherwise)."""
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not is_optimizer(v)}
        return value

    return strip(state)


def write_back(state: dict[str, Any], stripped: dict[str, Any]) -> None:
    """Put the plain values a load replaced in ``stripped`` (made by
    :func:`without_optimizers`) back into ``state``."""
    for k, v in stripped.items():
        if isinstance(v, dict) and isinstance(state.get(k), dict):
            write_back(state[k], v)
        else:
            state[k] = v
