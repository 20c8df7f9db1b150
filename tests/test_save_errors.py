"""Typed records between ranks and of a restore (issue 33, item 3): a failed save's
SaveError maps each failed rank to its cause on every rank, with real gloo ranks; the
restore line is rendered from a typed outcome, with exactly the text it always had."""

from __future__ import annotations

import os
import pickle

import pytest

import unickpt
from unickpt.engine.restored import Restored
from unickpt.testing import run_ranks

from save_error_cases import failing_ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["save", "async"])
def test_a_failed_save_names_every_failed_rank_and_why_on_every_rank(tmp_path, mode):
    run_ranks(failing_ranks, 3, str(tmp_path / "ck"), mode, preload=["torch", "torch.distributed", "unickpt"])
    assert not os.path.exists(tmp_path / "ck" / "manifest.json")


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
    (Restored(10, "disk", 0.125, "ck/step_00000010", kept=("rng", "a", "b", "c", "d")),
     "resumed step 10 from disk (ck/step_00000010; 0.12 s; per-rank state left as it is: saved by another number "
     "of ranks (rng, a, b and 2 more))"),
    (Restored(0, "fresh", 0.1, memory="no snapshot in memory", nothing="no checkpoint in ck"),
     "starting fresh (memory: no snapshot in memory; no checkpoint in ck)"),
    (Restored(0, "fresh", 0.1, nothing="no checkpoint in ck"), "starting fresh (no checkpoint in ck)"),
])
def test_the_restore_line_is_rendered_from_its_record(restored, line):
    assert restored.line() == line
