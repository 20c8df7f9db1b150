"""One voice (issue 33, item 5): the library speaks through the ``unickpt`` logger; with no
configuration the console lines reach stdout and the warnings stderr, a handler of the
user's takes over; the library itself never prints to stdout (the command line, the
demos and the example trainer do)."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from pathlib import Path

from unickpt.logs import log, say

SRC = Path(__file__).resolve().parent.parent / "src" / "unickpt"
PRINTS_TO_STDOUT = ("cli.py", "__main__.py", "demo.py", "demo_fault.py", "demo_resume.py", "examples/")

SCRIPT = """
import logging, unickpt
from unickpt.logs import log, say
say("resumed step 3 from memory (test)")
log.warning("unickpt: a warning")
log.info("unickpt: information, not for the console")
"""


def test_unconfigured_console_lines_go_to_stdout_and_warnings_to_stderr():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "resumed step 3 from memory (test)\n"
    assert out.stderr == "unickpt: a warning\n"


def test_a_handler_of_the_user_takes_over(capsys):
    got: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: got.append(record.getMessage())  # type: ignore[method-assign]
    say("starting fresh (one)")
    assert capsys.readouterr().out == "starting fresh (one)\n"
    log.addHandler(handler)
    try:
        say("starting fresh (two)")
        log.warning("unickpt: w")
    finally:
        log.removeHandler(handler)
    assert got == ["starting fresh (two)", "unickpt: w"]
    assert capsys.readouterr().out == ""


def test_the_library_does_not_print_to_stdout():
    found = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(PRINTS_TO_STDOUT):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                if not any(k.arg == "file" for k in node.keywords):
                    found.append(f"{rel}:{node.lineno}")
    assert not found, f"print to stdout in the library (use unickpt.logs.say or the unickpt logger): {found}"


def test_each_durable_save_is_one_record_counted_once(tmp_path, caplog):
    import torch

    import unickpt

    state = {"w": torch.arange(1024, dtype=torch.float32)}
    for mode in ("sync", "async"):
        manager = unickpt.CheckpointManager(str(tmp_path / mode), save_every=2, async_save=mode == "async")
        manager.restore(state)
        for step in (1, 2, 3, 4):
            manager.maybe_save(state, step)
        manager.close()
        stats = manager.stats()
        last = stats["last_save"]
        assert stats["saves"] == 2 and stats["saves_failed"] == 0, stats
        assert (last["step"], last["mode"], last["error"]) == (4, mode, None), last
        assert last["bytes"] >= 4096 and 0 <= last["stall_s"] <= last["seconds"], last
    # a failure: counted once, told once (one warning), kept as the record's error
    blocked = tmp_path / "blocked"
    manager = unickpt.CheckpointManager(str(blocked), save_every=1)
    manager.restore(state)
    blocked.mkdir()
    (blocked / "step_00000001").write_text("a file where the checkpoint goes")
    with caplog.at_level(logging.WARNING, logger="unickpt"):
        manager.maybe_save(state, 1)
    manager.close()
    stats = manager.stats()
    assert stats["saves"] == 0 and stats["saves_failed"] == 1, stats
    assert stats["last_save"]["error"] and stats["last_save"]["bytes"] is None
    told = [r.getMessage() for r in caplog.records if r.name == "unickpt" and r.levelno >= logging.WARNING]
    assert len(told) == 1 and told[0].startswith("unickpt: checkpoint of step 1 failed, training goes on: "), told
    assert stats["last_error"] == told[0].removeprefix("unickpt: ")
