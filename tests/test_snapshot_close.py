"""A planned stop that is to resume from memory (``close(keep_snapshots=True)``) returns
once the keepers hold the newest snapshot whole: a relaunch right after it resumes from
that step, not an older one (seen on an H200, where the relaunch outran the keeper)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import unickpt
from unickpt.snapshot import paths
from unickpt.snapshot.client import in_progress
from unickpt.snapshot.keeper_admin import stop_keeper
from unickpt.testing import run_ranks


def _planned_stop(rank: int, world: int, root: str, shm: str) -> None:
    state = {"w": torch.randn(4 << 20), "v": torch.randn(4 << 20)}  # 32 MiB: the keeper's commit takes a while
    mgr = unickpt.CheckpointManager(root, snapshot_every=1, parity=0)
    mgr.restore(state)
    for step in (1, 2, 3):
        mgr.before_update()
        state["w"].add_(1)
        mgr.maybe_save(state, step)
        if step < 3:  # the keeper idle again before the next: no snapshot is skipped for want of it
            mgr._snap.settle()
            while in_progress(mgr._snap.jdir, mgr._snap.table):
                time.sleep(0.01)
    jdir = mgr._snap.jdir
    mgr.close(keep_snapshots=True)
    assert os.path.exists(os.path.join(jdir, paths.step_name(3), paths.WHOLE)), os.listdir(os.path.join(jdir, paths.step_name(3)))
    again = {k: torch.zeros_like(v) for k, v in state.items()}
    mgr2 = unickpt.CheckpointManager(root, snapshot_every=1, parity=0)
    assert mgr2.restore(again) == 3, mgr2.restored_line
    assert all(torch.equal(again[k], state[k]) for k in state)
    mgr2.close()


@pytest.mark.multiprocess
def test_planned_stop_leaves_the_newest_snapshot_whole(tmp_path, monkeypatch):
    shm = str(tmp_path / "shm")
    monkeypatch.setenv("UNICKPT_SHM_ROOT", shm)
    try:
        run_ranks(_planned_stop, 1, str(tmp_path / "ckpt"), shm)
    finally:
        stop_keeper(shm)
