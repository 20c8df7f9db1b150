"""``unickpt demo --fault-tolerance`` as a newcomer meets it (issue 29, item 5; issue 32).

* live recovery end to end (``unickpt launch`` of the example trainer on 4 ranks, rank 2
  SIGKILLed, a replacement joins): the survivors go on in their own processes, no step
  lost, every loss within 1e-4 of the unbroken run, nothing left behind. This is also
  the test of the example trainer under ``unickpt launch`` with a kill;
* ``--node-loss`` end to end (4 torchrun nodes, one lost, about 25 s): exit 0, a table whose every step
  with a loss has its relative difference and whose last column is named, and nothing
  left in the temporary directory;
* the PNG's note on the node loss lies inside the plot frame;
* a failing run's error carries the nodes' log tails (its temporary directory is removed).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from unickpt.demo_fault import NODES, FaultDemo, _logs, _table, plot_figure


def _result(failed_at: int = 11, resumed: int = 10, steps: int = 16) -> FaultDemo:
    reference = {s: 5.0 - 0.1 * s for s in range(1, steps + 1)}
    line = f"resumed step {resumed} from memory (node 2 of 4 lost: its files decoded from XOR parity; 0.27 s)"
    return FaultDemo(reference, {s: v for s, v in reference.items() if s <= failed_at},
                     {s: v * (1 + 1e-7) for s, v in reference.items() if s > resumed}, line, failed_at, 0.27,
                     "plot.png", 1.0)


@pytest.mark.parametrize("failed_at", [3, 11, 15])
def test_plot_note_stays_inside_the_frame(failed_at: int) -> None:
    fig = plot_figure(_result(failed_at, failed_at - 1))
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    (note,) = [t for t in ax.texts if "decoded from parity" in t.get_text()]
    box = note.get_window_extent(renderer)
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, (box, frame)


def test_table_names_every_column_and_fills_every_difference() -> None:
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    _table(_result(), console.print, console)
    lines = out.getvalue().splitlines()
    header = [c.strip() for c in next(ln for ln in lines if "step" in ln and "┃" in ln).split("┃")[1:-1]]
    assert header == ["step", "unbroken", "this run", "on", "rel. diff", "note"], header
    rows = [[c.strip() for c in ln.split("│")[1:-1]] for ln in lines if re.match(r"│\s+\d+ │", ln)]
    assert len(rows) == 16 and all(re.fullmatch(r"\d\.\de[-+]\d\d", r[4]) for r in rows), rows
    assert rows[9][5] == "last whole snapshot" and rows[10][5] == "node 2 lost"


def _left(tmp: Path) -> list[str]:
    """What a demo left in its $TMPDIR (its unickpt-demo-* folder, torchrun's torchelastic_*
    log folders), but torch's compile cache (torchinductor_<user>: kept on purpose)."""
    return [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]


def test_failure_message_carries_the_logs(tmp_path: Path) -> None:
    (tmp_path / "node0.log").write_text("".join(f"line {i}\n" for i in range(40)) + "RuntimeError: boom\n")
    text = _logs(str(tmp_path), NODES)  # node1-3 have no log: left out, no error
    assert text.startswith("--- node 0 (last lines) ---\n") and text.endswith("RuntimeError: boom")
    assert "line 25" not in text and "line 39" in text


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_fault_demo_end_to_end_leaves_nothing_behind_slow(tmp_path: Path) -> None:
    """SLOW: the real demo (4 torchrun nodes, one SIGKILLed) with its own temporary directory."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "COLUMNS": "200", "NO_COLOR": "1"}
    r = subprocess.run([sys.executable, "-m", "unickpt", "demo", "--fault-tolerance", "--node-loss", "--plot",
                        str(tmp_path / "ft.png")],
                       capture_output=True, text=True, env=env, timeout=290, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^OK: max relative difference after the recovery \d\.\de[-+]\d+ \(bound 1e-4\)", r.stdout, re.M), r.stdout
    assert re.search(r"┃ step ┃.*┃ rel\. diff ┃ note\s+┃", r.stdout), r.stdout
    rows = [ln for ln in r.stdout.splitlines() if re.match(r"│\s+\d+ │", ln)]
    assert len(rows) == 16 and all(re.search(r"│\s+\d\.\de[-+]\d\d │", ln) for ln in rows), r.stdout
    assert (tmp_path / "ft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _left(tmp) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_live_demo_end_to_end_slow(tmp_path: Path) -> None:
    """SLOW: the real live-recovery demo: 4 -> 3 -> 4 ranks under ``unickpt launch`` (the
    example trainer), its lines, table and PNG; no keeper and no temporary directory left.
    The run that shows a crash, the survivors going on in their processes and a
    replacement growing the job back (tests/test_live.py has the other failures)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "COLUMNS": "200", "NO_COLOR": "1"}
    r = subprocess.run([sys.executable, "-m", "unickpt", "demo", "--fault-tolerance", "--plot", str(tmp_path / "ft.png")],
                       capture_output=True, text=True, env=env, timeout=390, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert re.search(r"^OK: 0 steps lost, survivors in their own processes: True, max relative difference "
                     r"\d\.\de[-+]\d+ \(bound 1e-4\)", out, re.M), out
    assert re.search(r"^   resumed step \d+ from memory \(", out, re.M), out
    assert re.search(r"^   rank 2 lost \(exit -9\); continuing on 3 ranks at step \d+ \(generation 1\)$", out, re.M), out
    rows = [[c.strip() for c in ln.split("│")[1:-1]] for ln in out.splitlines() if re.match(r"│\s+\d+ │", ln)]
    assert len(rows) == 24 and {r[3] for r in rows} >= {"3", "4"}, out
    assert re.search(r"^   1 replacement joined; continuing on 4 ranks at step \d+ \(generation 2\)$", out, re.M), out
    sizes = "".join(r[3] for r in rows)
    assert re.fullmatch(r"4+3+4+", sizes), sizes  # shrink now, grow later
    assert (tmp_path / "ft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _left(tmp) == []
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp) not in ps  # no keeper (nor worker) of the demo's job left running
