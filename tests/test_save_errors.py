"""Typed records between ranks and of a restore (issue 33, item 3): a failed save's
SaveError maps each failed rank to its cause on every rank, with real gloo ranks; the
restore line is rendered from a typed outcome, with exactly the text it always had."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import unickpt
from unickpt.engine.outcome import Outcome
from unickpt.engine.restored import Restored
from unickpt.testing import run_ranks

from save_error_cases import committed_locations, failing_ranks, node_copies


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["save", "async"])
def test_a_failed_save_names_every_failed_rank_and_why_on_every_rank(tmp_path, mode):
    run_ranks(failing_ranks, 3, str(tmp_path / "ck"), mode, preload=["torch", "torch.distributed", "unickpt"],
              timeout=60)
    assert not os.path.exists(tmp_path / "ck" / "manifest.json")


@pytest.mark.multiprocess
def test_a_location_already_committed_is_the_same_error_on_every_rank(tmp_path):
    """A location that holds a committed checkpoint raises CheckpointExistsError, with its
    location, on both ranks: found by rank 0's claim (the other rank used to get a plain
    SaveError with the message only) or by rank 1 alone (rank 0 used to wait for it in the
    save's collectives until the group's timeout: 60 s here fails the test)."""
    path = str(tmp_path / "ck")
    unickpt.save({"w": torch.ones(2)}, path)
    unickpt.save({"w": torch.ones(2)}, str(tmp_path / "seen_by_rank_1"))
    run_ranks(committed_locations, 2, path, str(tmp_path), preload=["torch", "torch.distributed", "unickpt"], timeout=60)


@pytest.mark.multiprocess
def test_a_save_into_each_machines_directory_commits_or_fails_alike_on_every_rank(tmp_path):
    """The in-memory snapshots' target (a directory on each rank's machine, the index cut
    into parts the ranks keep): committed, each rank holds the root and its parts; a rank
    that cannot prepare its directory, or rank 0's failed commit, is the same SaveError on
    every rank and no manifest anywhere. (The target agrees on its directories in one
    all-reduce, its messages gathered only when a rank failed: both paths run here.)"""
    for case in ("ok", "prepare", "publish"):
        run_ranks(node_copies, 3, str(tmp_path / case), case, preload=["torch", "torch.distributed", "unickpt"], timeout=60)


def test_an_outcome_carries_its_error_as_itself():
    """What rank 0 broadcasts at a claim or a commit: every rank raises the error's own
    class with what it carries; a class unickpt does not have, or unreadable bytes, is a
    SaveError saying so."""
    def raised(outcome: Outcome) -> Exception:
        with pytest.raises(unickpt.UnickptError) as e:
            Outcome.decode(outcome.encode()).raise_error()
        return e.value

    e = raised(Outcome.of(unickpt.CheckpointExistsError("/ck/step_4")))
    assert type(e) is unickpt.CheckpointExistsError and e.location == "/ck/step_4"
    e = raised(Outcome.of(unickpt.SaveError("save failed", {1: "disk full"})))
    assert type(e) is unickpt.SaveError and e.failures == {1: "disk full"} and str(e) == "save failed"
    e = raised(Outcome.of(unickpt.StorageError("no backend for nosuch://")))
    assert type(e) is unickpt.StorageError and str(e) == "no backend for nosuch://"
    e = raised(Outcome.of(OSError(28, "No space left on device")))
    assert type(e) is unickpt.SaveError and e.failures == {0: "OSError: [Errno 28] No space left on device"}
    e = raised(Outcome(error="NoSuchError", message="m"))
    assert type(e) is unickpt.SaveError and str(e) == "m"
    with pytest.raises(unickpt.SaveError, match="rank 0's outcome is unreadable"):
        Outcome.decode(b"error\n{not json").raise_error()
    assert Outcome.decode(Outcome(payload=b"where").encode()).payload == b"where"
    Outcome.decode(Outcome().encode()).raise_error()


def test_save_error_keeps_its_map_across_processes():
    e = unickpt.SaveError("save failed", {3: "disk full", 7: "boom"})
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.failures, back.ranks) == ("save failed", {3: "disk full", 7: "boom"}, [3, 7])
    assert unickpt.SaveError("bad block_bytes").failures == {}


@pytest.mark.parametrize("restored, line", [
    (Restored(12, "memory", 0.5, "3 nodes, all present", "step 14: a node's copy is missing"),
     "resumed step 12 from memory (3 nodes, all present; skipped: step 14: a node's copy is missing; 0.50 s)"),
    (Restored(10, "disk", 1.25, "ck/step_00000010", memory="no snapshot in memory", logged=2),
     "resumed step 10 from disk + 2 logged steps (ck/step_00000010; memory: no snapshot in memory; 1.25 s)"),
    (Restored(20, "disk", 0.5, "ck/step_00000020", logged=0),  # the log on, nothing after the checkpoint
     "resumed step 20 from disk (ck/step_00000020; 0.50 s)"),
    (Restored(10, "disk", 0.125, "ck/step_00000010", kept=("rng", "a", "b", "c", "d")),
     "resumed step 10 from disk (ck/step_00000010; 0.12 s; per-rank state left as it is: saved by another number "
     "of ranks (rng, a, b and 2 more))"),
    (Restored(0, "fresh", 0.1, memory="no snapshot in memory", nothing="no checkpoint in ck"),
     "starting fresh (memory: no snapshot in memory; no checkpoint in ck)"),
    (Restored(0, "fresh", 0.1, nothing="no checkpoint in ck"), "starting fresh (no checkpoint in ck)"),
])
def test_the_restore_line_is_rendered_from_its_record(restored, line):
    assert restored.line() == line
