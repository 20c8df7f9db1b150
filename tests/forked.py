"""Ranks forked from a preloaded fork server, for the test modules whose ranks need
nothing a fresh interpreter gives: ``unickpt.testing.run_ranks`` spawns by default, and
on 2 cores each spawned rank spends seconds importing torch; forked ones start at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unickpt.testing import run_ranks

# what every rank imports, once, in the fork server (unickpt.testing keeps one server with
# every module any run_ranks(preload=...) of the pytest process asked for)
PRELOAD = [
    "torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel", "unickpt", "unickpt.testing",
]


def run_forked(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240) -> None:
    """``unickpt.testing.run_ranks(fn, world, *args)`` with the ranks forked from the
    preloaded server; a rank's failure raises RankFailure with its traceback, as there."""
    run_ranks(fn, world, *args, timeout=timeout, preload=PRELOAD)
