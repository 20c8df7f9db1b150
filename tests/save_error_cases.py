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


def node_copies(rank: int, world: int, root: str, case: str) -> None:
    """A save into directories local to each rank's "machine" (``<root>/node<rank>``, the
    in-memory snapshots' target: :class:`~unickpt.engine.targets.NodeCopies`), index in 2
    parts, rank 1 keeping both and rank 2 the second. ``ok``: rank 0 holds the whole index,
    ranks 1 and 2 their parts of it and the same root manifest. ``prepare``: rank 1 cannot
    prepare its directory; ``publish``: rank 0's commit fails. Either way every rank raises
    the same SaveError naming the cause, and no directory holds a manifest."""
    from unittest import mock

    from unickpt.engine import targets
    from unickpt.engine.background_save import start_save
    from unickpt.engine.save_options import SaveOptions

    mine = os.path.join(root, f"node{rank}")
    target = targets.NodeCopies(targets.IndexParts(2, ((), (0, 1), (1,))))
    state = {f"t{i}": torch.full((3,), float(i)) for i in range(6)}
    patches = []
    if case == "prepare" and rank == 1:
        patches.append(mock.patch.object(targets, "open_storage", side_effect=OSError(13, "Permission denied")))
    if case == "publish" and rank == 0:
        patches.append(mock.patch.object(targets.NodeCopies, "publish", side_effect=OSError(28, "No space left on device")))
    for p in patches:
        p.start()
    try:
        start_save(state, mine, SaveOptions(), lazy=True, target=target, overwrite=True,
                   metadata={"snapshot": {"step": 1}}).result(timeout=60)
    except unickpt.SaveError as e:
        assert case != "ok", e
        if case == "prepare":
            assert str(e) == f"rank 1: cannot prepare {os.path.join(root, 'node1')}: [Errno 13] Permission denied", str(e)
        else:
            assert e.failures == {0: "OSError: [Errno 28] No space left on device"}, e.failures
    else:
        assert case == "ok", f"the save did not fail on rank {rank}"
    finally:
        for p in patches:
            p.stop()
    torch.distributed.barrier()
    names = {r: sorted(os.listdir(os.path.join(root, f"node{r}"))) if os.path.isdir(os.path.join(root, f"node{r}")) else []
             for r in range(world)}
    if case != "ok":
        assert not any("manifest.json" in n for n in names.values()), names
        return
    assert "fragments.jsonl" in names[0] and "manifest.json" in names[0], names[0]
    assert {n for n in names[1] if n.startswith(("fragments", "manifest"))} == {"fragments_00000.jsonl", "fragments_00001.jsonl", "manifest.json"}
    assert {n for n in names[2] if n.startswith(("fragments", "manifest"))} == {"fragments_00001.jsonl", "manifest.json"}
    read = lambda r, n: open(os.path.join(root, f"node{r}", n), "rb").read()  # noqa: E731
    whole = read(0, "fragments.jsonl")
    assert read(1, "fragments_00000.jsonl") + read(1, "fragments_00001.jsonl") == whole
    assert read(2, "fragments_00001.jsonl") == read(1, "fragments_00001.jsonl")
    assert read(0, "manifest.json") == read(1, "manifest.json") == read(2, "manifest.json")
