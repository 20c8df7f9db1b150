"""Whether a training state can be saved at all, checked once before training starts
(:meth:`unickpt.CheckpointManager.restore`): an entry that is not a tensor, a Stateful
object or plain data (a plain ``torch.utils.data.DataLoader``, a file handle) would make
every save of the run fail, and the run would go on with no checkpoint."""

from __future__ import annotations

from typing import Any

import torch

from ..engine.state import PerRank, Sharded, is_stateful
from ..errors import UnickptError
from ..format.values import encode_value


def check_saveable(state: dict[str, Any]) -> None:
    """One :class:`~unickpt.UnickptError` naming the first entry of ``state`` that no save
    can store, with what to use instead. Stateful objects are taken as they are: their
    ``state_dict()`` is not called (it may change them: DCP's optimizer state dict makes
    the optimizer's state with a step)."""
    def visit(name: str, value: Any) -> None:
        if isinstance(value, PerRank):
            value = value.value
        if isinstance(value, (torch.Tensor, Sharded)) or is_stateful(value):
            return
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{name}.{k}" if name else str(k), v)
            return
        if isinstance(value, (list, tuple)):
            for k, v in enumerate(value):
                visit(f"{name}.{k}", v)
            return
        try:
            encode_value(value, name)
        except UnickptError as e:
            raise UnickptError(_unsaveable(name, value, e)) from None

    if not isinstance(state, dict):
        raise UnickptError(f"the state must be a dict, not {type(state).__name__}")
    visit("", state)


def _unsaveable(name: str, value: Any, error: UnickptError) -> str:
    kind = type(value).__name__
    if isinstance(value, torch.utils.data.DataLoader):
        instead = ("a torch DataLoader has no state_dict/load_state_dict: use a Stateful loader such as torchdata's "
                   "StatefulDataLoader (torchdata.stateful_dataloader), which resumes at its position, or leave "
                   f"{name!r} out of the state")
    else:
        instead = (f"make it Stateful (state_dict/load_state_dict), store plain data in its place, or leave {name!r} "
                   "out of the state")
    return (f"the state's entry {name!r} ({kind}) can never be saved, so every checkpoint of this run would fail: "
            f"{instead} ({error})")
