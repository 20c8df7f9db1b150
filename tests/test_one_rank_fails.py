"""What fails on one rank fails the collective call on every rank, at once: no rank is
left waiting, until the group's timeout, in a collective the failed rank never enters
(loads, async saves, the sharing of replicated tensors, rank 0's listings, snapshots).
Real gloo ranks, each failing for a real reason; each call must end within 20 s, the
ranks are killed after 60."""

from __future__ import annotations

import os

import pytest
import torch

import unickpt
from unickpt.testing import run_ranks

from one_rank_fails_cases import collective_calls, snapshot_state_fails

PRELOAD = ["torch", "torch.distributed", "unickpt"]


@pytest.mark.multiprocess
def test_a_rank_that_fails_alone_fails_every_rank_at_once(tmp_path):
    for r in (0, 1):  # each node's own copy of step 1; rank 1's manifest cut short
        unickpt.save({"w": torch.arange(8.0)}, str(tmp_path / f"node{r}" / "step_00000001"))
    manifest = tmp_path / "node1" / "step_00000001" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    (tmp_path / "listing0").symlink_to("listing0")  # rank 0's root: a link to itself, which no listing can follow
    run_ranks(collective_calls, 2, str(tmp_path), preload=PRELOAD, timeout=60)
    assert not os.path.exists(tmp_path / "shared" / "a" / "manifest.json")
    assert os.path.exists(tmp_path / "shared" / "b" / "manifest.json")


@pytest.mark.multiprocess
def test_a_snapshot_that_fails_on_one_rank_fails_on_every_rank_and_training_goes_on(tmp_path):
    run_ranks(snapshot_state_fails, 2, str(tmp_path), preload=PRELOAD, timeout=60)
