"""torchrun's own restarts with the snapshot tier on: a trainer SIGKILLed three times in
one run; torchrun relaunches the workers each time, they resume from memory, and the job
finishes by itself with exit 0 and the losses, bitwise, of an unbroken run.

Under torchrun the agent's store (and every key in it) lives for the whole job, and
process-group names repeat from round to round: before unickpt deleted its groups'
rendezvous keys (and the default group's) once joined, the relaunched workers read the
dead workers' addresses and died in gloo's connectFullMesh ("Connection refused").
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.mttr import TINY, breakdown, run_job  # noqa: E402
from forked import run_forked  # noqa: E402
from train_cases import train  # noqa: E402

RUN = ["--dp", "2", "--fsdp", "--steps", "36", "--save-every", "10", *TINY]
FLAGS = [*RUN, "--snapshot-every", "1"]


def _losses(path: str) -> dict[int, float]:
    import json

    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}  # a re-run step's last record wins


@pytest.mark.multiprocess
def test_three_kills_one_run_resume_from_memory_bitwise(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    whole.mkdir()
    broken.mkdir()
    # the unbroken run: the same trainer and layout on ranks forked from the suite's fork
    # server, no snapshots (they change no bit of a loss; the broken run's equality shows it)
    ref_log = str(whole / "loss.jsonl")
    run_forked(train, 2, [*RUN, "--ckpt-dir", str(whole / "ckpt"), "--loss-log", ref_log], None)
    job = run_job(str(broken), [*FLAGS, "--ckpt-dir", str(broken / "ckpt")], [7, 16, 25], timeout=300)
    assert job["rc"] == 0, job["output"][-4000:]
    assert len(job["kills"]) == 3
    assert "connectFullMesh" not in job["output"]
    rows = breakdown(job)
    assert [r["from"] for r in rows] == ["memory"] * 3, job["output"][-3000:]
    assert all(r["steps_lost"] <= 2 for r in rows), rows
    want, got = _losses(ref_log), _losses(job["log"])
    assert sorted(got) == list(range(1, 37))
    assert got == want  # bitwise: the float of every step's loss is the same
