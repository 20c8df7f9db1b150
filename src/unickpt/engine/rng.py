"""The random number generators of a rank as Stateful state (``unickpt.RNGState``)."""

from __future__ import annotations

import random
from typing import Any

import torch

from .state import PerRank

__all__ = ["RNGState"]


class RNGState:
    """This rank's random generators — torch's CPU generator, each CUDA device's when CUDA
    is initialised, and Python's ``random`` — as a Stateful object to put in the state
    that is saved and restored: ``state["rng"] = unickpt.RNGState()``.

    Every entry is per-rank (:class:`unickpt.PerRank`): a restore onto the same number of
    ranks sets each rank's generators as they were; onto another number of ranks the
    :class:`unickpt.CheckpointManager` leaves them as they are and says so (a rank's
    random stream has no meaning on another layout).

    Example:
        ``state = {"model": model, "optim": optim, "rng": unickpt.RNGState()}``
    """

    def state_dict(self) -> dict[str, Any]:
        """The generators' states now."""
        sd: dict[str, Any] = {"torch": PerRank(torch.get_rng_state()),
                              "python": PerRank(random.getstate())}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = PerRank(torch.stack(torch.cuda.get_rng_state_all()))
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Set the generators from ``sd`` (entries it lacks are left alone)."""
        if "torch" in sd:
            torch.set_rng_state(_value(sd["torch"]))
        if "python" in sd:
            version, internal, gauss = _value(sd["python"])
            random.setstate((version, tuple(internal), gauss))  # tuples come back as tuples; lists tolerated
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(_value(sd["cuda"])))


def _value(v: Any) -> Any:
    return v.value if isinstance(v, PerRank) else v

