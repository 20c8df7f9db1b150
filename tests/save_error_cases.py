"""Rank functions of tests/test_save_errors.py (importable by the spawned ranks)."""

from __future__ import annotations

import os

import torch

import unickpt


class _FailingStateful:
    """A Stateful whose ``state_dict()`` raises: the save fails on this rank before its
    first collective."""

    def state_dict(self) -> dict:
        raise RuntimeError("the data loader's state_dict failed")

    def load_state_dict(self, state: dict) -> None:
        pass


def _state(rank: int) -> dict:
    state = {"w": torch.full((4,), float(rank)), "step": 3}
    if rank == 1:
        state["cfg"] = {"fn": print}  # a value no checkpoint can hold: this rank fails
    if rank == 2:
        state["loader"] = _FailingStateful()
    return state


def failing_ranks(rank: int, world: int, path: str, mode: str) -> None:
    """Ranks 1 and 2 fail (rank 2 before the save's first collective); every rank must
    get the same SaveError, mapping 1 and 2 to their causes, and nothing is committed."""
    try:
        if mode == "async":
            unickpt.async_save(_state(rank), path).result(timeout=120)
        else:
            unickpt.save(_state(rank), path)
    except unickpt.SaveError as e:
        assert e.ranks == [1, 2], e.failures
        assert "'cfg.fn'" in e.failures[1] and "the data loader's state_dict failed" in e.failures[2], e.failures
        assert str(e).startswith("save failed, nothing was committed:\nrank 1: ") and "\nrank 2: " in str(e), str(e)
    else:
        raise AssertionError("the save did not fail")


def committed_locations(rank: int, world: int, path: str, root: str) -> None:
    """Every rank raises CheckpointExistsError, not only the rank that finds a committed
    checkpoint:

    * rank 0's claim finds one at ``path`` (the ranks skip the early check each save
      makes, as when a checkpoint is committed between it and the claim);
    * only rank 1 finds one (the same path on node-local disks, played by a path of each
      rank's own under ``root``), with ``save`` and ``async_save``: rank 1 used to raise
      alone while rank 0 waited in the save's collectives."""
    from unickpt.dist import resolve_group
    from unickpt.engine.commit import prepare_collective

    def expect_exists(attempt, where: str) -> None:
        try:
            attempt()
        except unickpt.CheckpointExistsError as e:
            assert e.location == where and "already holds a committed checkpoint" in str(e), (e.location, str(e))
        else:
            raise AssertionError("the save did not fail")

    expect_exists(lambda: prepare_collective(resolve_group(), path, overwrite=False), path)
    mine = os.path.join(root, f"seen_by_rank_{rank}")  # committed for rank 1 by the test
    expect_exists(lambda: unickpt.save({"w": torch.ones(2)}, mine), mine)
    expect_exists(lambda: unickpt.async_save({"w": torch.ones(2)}, mine).result(timeout=60), mine)
    assert os.path.exists(os.path.join(mine, "manifest.json")) == (rank == 1)
