"""What the tests' fork launchers (tests/ds_fork.py, tests/node_fork.py) do in a forked
child: its output to a file, a body run, the process ended with the body's exit code; and
a script or ``-m`` module run as ``__main__`` as ``python`` would run it."""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


def run_main(argv: list[str]) -> None:
    """``python script args`` or ``python -m module args``, in this process: ``argv`` is
    ``[script, args...]`` or ``["-m", module, args...]``."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def exit_after(log: str, body: Callable[[], None]) -> NoReturn:
    """In a forked child: stdout and stderr to ``log``, stdin from /dev/null, ``body`` run;
    the process ends with 0, SystemExit's code, or 1 after another exception (printed)."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        body()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # as python prints what ended a script, and exits 1
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
