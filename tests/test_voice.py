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
