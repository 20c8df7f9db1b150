"""Rank functions of tests/test_one_rank_fails.py (importable by the forked ranks): in each
collective call one rank fails before or between the collectives the other enters, for a
real reason (its own state, its node's files); every rank must raise, at once."""

from __future__ import annotations

import os
import time

import torch

import unickpt

BOUND_S = 20.0  # far below the 60 s the test's ranks may run: a rank waiting out a collective fails it


class Loader:
    """A data loader's position (a Stateful): on ``failing`` ranks its ``load_state_dict``
    raises (after ``armed``, its ``state_dict`` too), as a loader whose workers died does."""

    def __init__(self, failing: bool = False, armed: bool = False) -> None:
        self.failing, self.armed, self.pos = failing, armed, 7

    def state_dict(self) -> dict:
        if self.failing and self.armed:
            raise RuntimeError("the loader's workers died")
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        if self.failing:
            raise RuntimeError("the saved worker state does not fit this rank's workers")
        self.pos = state["pos"]


def _fails(rank: int, what: str, call, expect: dict[int, tuple[type, str]]) -> None:
    """``call()`` raises on this rank the type and text ``expect`` gives it, within BOUND_S."""
    t0 = time.monotonic()
    try:
        call()
    except Exception as e:
        seconds = time.monotonic() - t0
        kind, text = expect[rank]
        assert isinstance(e, kind) and text in str(e), f"{what}: rank {rank} raised {type(e).__name__}: {e}"
        assert seconds < BOUND_S, f"{what}: rank {rank} raised after {seconds:.1f} s"
    else:
        raise AssertionError(f"{what}: rank {rank} did not fail")


def collective_calls(rank: int, world: int, root: str) -> None:
    """Five calls, each failing on one rank for its own reason."""
    shared = os.path.join(root, "shared")
    # 1. a load (the newest checkpoint) where rank 1's Stateful refuses its state: a plain
    #    RuntimeError there, which the search for a whole checkpoint used to let out alone
    ckpts = unickpt.Checkpoints(shared)
    ckpts.save({"w": torch.ones(4), "loader": Loader()}, 1)
    _fails(rank, "load", lambda: ckpts.load({"w": torch.zeros(4), "loader": Loader(failing=rank == 1)}),
           {0: (unickpt.UnickptError, "could not be loaded on rank 1 (RuntimeError: the saved worker state"),
            1: (RuntimeError, "does not fit this rank's workers")})

    # 2. an async save whose staging buffer rank 1 cannot allocate (a tensor of 2**50 bytes,
    #    beyond any address space); its next save must not wait for the failed one
    huge = torch.zeros(1).expand(2**48) if rank == 1 else torch.zeros(4)
    _fails(rank, "async_save", lambda: unickpt.async_save({"w": huge}, os.path.join(shared, "a")).result(timeout=60),
           {r: (unickpt.SaveError, "rank 1: ") for r in (0, 1)})
    unickpt.async_save({"w": torch.ones(4)}, os.path.join(shared, "b")).result(timeout=60)

    # 3. a load sharing replicated tensors from node-local copies: rank 1's manifest is cut
    #    short (the test did it), so rank 1 fails to open it while rank 0 shares
    local = unickpt.Checkpoints(os.path.join(root, f"node{rank}"))
    _fails(rank, "load(broadcast_replicated=True)",
           lambda: local.load({"w": torch.zeros(8)}, broadcast_replicated=True),
           {0: (unickpt.UnickptError, "load failed on rank(s) 1"), 1: (unickpt.UnickptError, "manifest")})

    # 4. rank 0 cannot list its node-local root (a symbolic link to itself, as a broken
    #    mount leaves): every rank hears its error instead of waiting for its list
    listing = unickpt.Checkpoints(os.path.join(root, f"listing{rank}"))
    _fails(rank, "load (rank 0 cannot list)", lambda: listing.load({"w": torch.zeros(4)}),
           {r: (unickpt.UnickptError, "OSError: [Errno 40]") for r in (0, 1)})

    # 5. a restore where rank 1's state holds what no save can store (a generator, as a
    #    data iterator on that rank only): refused there before the first collective
    manager = unickpt.CheckpointManager(os.path.join(shared, "managed"))
    extra = {"batches": (b for b in range(3))} if rank == 1 else {}
    _fails(rank, "restore (rank 1's state unsaveable)", lambda: manager.restore({"w": torch.zeros(4), **extra}),
           {0: (unickpt.UnickptError, "rank 1: "), 1: (unickpt.UnickptError, "batches")})
    manager.close()


def snapshot_state_fails(rank: int, world: int, root: str) -> None:
    """Rank 1's loader dies between two snapshots: its ``state_dict()`` raises while the
    snapshot asks every rank for the size of its state. Every rank counts the failed
    snapshot and goes on training (rank 0 used to wait in the snapshot's exchange)."""
    os.environ["UNICKPT_SHM_ROOT"] = os.path.join(root, "shm")
    manager = unickpt.CheckpointManager(os.path.join(root, "ck"), snapshot_every=1)
    loader = Loader(failing=rank == 1)
    state = {"w": torch.ones(16), "loader": loader}
    try:
        assert manager.restore({"w": state["w"]}) == 0
        manager.maybe_save({"w": state["w"]}, 1)
        loader.armed = True
        t0 = time.monotonic()
        manager.maybe_save(state, 2)
        seconds = time.monotonic() - t0
        assert seconds < BOUND_S, f"rank {rank}: the failed snapshot took {seconds:.1f} s"
        assert manager.stats()["snapshots_failed"] == 1, manager.stats()
        g = torch.ones(1)
        torch.distributed.all_reduce(g)  # the next step's gradients: every rank is still in step
        assert g.item() == world
    finally:
        manager.close()
