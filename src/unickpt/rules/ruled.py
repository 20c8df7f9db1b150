"""The tensor rules build: a :class:`unickpt.Sharded` that remembers the user's tensor it is a
window of, and how its replicas are reconciled on save (shared by the rules language and
the replica reconciliation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.state import Sharded


@dataclass
class RuledTensor(Sharded):
    """A :class:`unickpt.Sharded` built by rules.

    ``reduce`` says how replicas are reconciled on save (``"check"``: must agree;
    ``"mean"``: store their mean). ``local`` is a window (``window``: offset and length
    per dim) of ``base``, the user's tensor or flat buffer: on save the window is cut to
    the boxes this rank stores, so padding and rows another rank stores are not written.
    ``base_pieces`` lists every box this rank holds, relative to ``base``.
    """

    reduce: str = "check"
    base: torch.Tensor | None = None
    base_pieces: list[Any] = field(default_factory=list)
    window: tuple[tuple[int, int], ...] = ()

    def base_tensor(self) -> torch.Tensor:
        """The tensor ``local`` is a window of."""
        return self.local if self.base is None else self.base

    def rebase(self, new_base: torch.Tensor) -> None:
        """Point this tensor at a replacement of ``base`` (same shape): ``local`` becomes its window."""
        view = new_base
        for d, (o, n) in enumerate(self.window):
            view = view.narrow(d, o, n)
        self.base, self.local = new_base, view
