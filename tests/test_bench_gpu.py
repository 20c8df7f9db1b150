"""``python -m bench.gpu``: the prepared GPU command runs every part on the CPU at tiny
sizes (``--dry-run``), so it cannot rot between the sessions that have a GPU, and a part
that runs out of time is written down while the report is still written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join(p for p in (os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH")) if p))


def _run(out, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu", "--dry-run", "--out", str(out), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=400)


@pytest.mark.multiprocess
def test_dry_run_runs_every_part_and_writes_the_report(tmp_path):
    p = _run(tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert list(doc["parts"]) == ["env", "tests", "limits", "async_save", "snapshot", "load", "restart"]
    assert all(part["status"] == "ok" for part in doc["parts"].values()), doc["parts"]
    figs = {name: part["figures"] for name, part in doc["parts"].items()}
    assert "skipped" in figs["tests"][0]["summary"]  # no CUDA here: the CUDA tests skip and say so
    whats = {f["what"] for f in figs["async_save"]}
    assert {"unickpt async_save eager", "unickpt async_save lazy", "dcp async_save (pinned stager)"} <= whats
    assert all(f["bitwise_equal"] for f in figs["load"])
    assert [f["save"] for f in figs["async_save"] if f["what"] == "unickpt async_save eager"] == [1, 2, 3] * 2
    assert any(f["what"] == "fresh process (1 rank)" and f["total_s"] > 0 for f in figs["restart"])
    assert "DRY RUN" in (tmp_path / "gpu.md").read_text()


def _scratch() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("unickpt-gpu-")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.multiprocess
def test_a_part_out_of_time_is_written_down_and_the_report_still_written(tmp_path):
    """A part out of its time is written down, the report still written, and the part's
    scratch folders removed all the same (a killed part cannot remove its own: each run of
    this test left two in /dev/shm)."""
    before = _scratch()
    p = _run(tmp_path, "--parts", "restart,env", "--budget", "3.5")
    assert p.returncode == 1
    assert _scratch() <= before, _scratch() - before
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert doc["parts"]["restart"]["status"].startswith("timed out")
    assert doc["parts"]["env"]["status"].startswith("not run")
    assert "timed out" in (tmp_path / "gpu.md").read_text()
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, "-m", "bench.gpu", "--out", str(tmp_path), "--parts", "nosuch"], cwd=ROOT, env=ENV,
                       capture_output=True, check=True)
