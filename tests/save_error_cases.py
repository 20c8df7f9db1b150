"""Rank functions of tests/test_save_errors.py (importable by the spawned ranks)."""

from __future__ import annotations

import torch

import unickpt


def _state(rank: int) -> dict:
    state = {"w": torch.full((4,), float(rank)), "step": 3}
    if rank in (1, 2):
        state["cfg"] = {"fn": print}  # a value no checkpoint can hold: this rank fails
    return state


def failing_ranks(rank: int, world: int, path: str, mode: str) -> None:
    """Ranks 1 and 2 fail; every rank must get the same SaveError, mapping 1 and 2 to
    their causes, and nothing is committed."""
    try:
        if mode == "async":
            unickpt.async_save(_state(rank), path).result(timeout=120)
        else:
            unickpt.save(_state(rank), path)
    except unickpt.SaveError as e:
        assert e.ranks == [1, 2], e.failures
        assert all("'cfg.fn'" in why for why in e.failures.values()), e.failures
        assert str(e).startswith("save failed, nothing was committed:\nrank 1: ") and "\nrank 2: " in str(e), str(e)
    else:
        raise AssertionError("the save did not fail")


def claim_of_a_committed_location(rank: int, world: int, path: str) -> None:
    """Rank 0's claim finds a committed checkpoint at ``path`` (the ranks skip the early
    check each save makes, as when a checkpoint is committed between it and the claim):
    every rank raises CheckpointExistsError for ``path``, not only rank 0."""
    from unickpt.dist import resolve_group
    from unickpt.engine.commit import prepare_collective

    try:
        prepare_collective(resolve_group(), path, overwrite=False)
    except unickpt.CheckpointExistsError as e:
        assert e.location == path and "already holds a committed checkpoint" in str(e), (e.location, str(e))
    else:
        raise AssertionError("the claim did not fail")
