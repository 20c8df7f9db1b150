"""``unickpt launch --start-method forkserver``: workers forked from a server that
imported torch once.

A spawned worker is a fresh interpreter: before its script's first line it spends 2-4 s
of CPU importing torch, ``torch.distributed`` and FSDP (more with Lightning or
transformers), and so does every replacement that joins a live job. Here the launcher
starts Python's own ``multiprocessing`` fork server once, which imports
:data:`PRELOAD` (and the launch's ``--preload`` modules) while the nodes join; each
worker is forked from it and runs the script as ``python script.py`` would
(:func:`_run_script`): ``__main__``, ``sys.argv``, ``sys.path[0]``, the worker's own
environment, its own session, stdout and stderr on the launcher's pipes, atexit
handlers at the end, exit codes as Python's (an uncaught exception 1, SystemExit's
code, a signal -N). The server never touches a device: a preloaded module that
initialises CUDA at import would break every worker forked after it.

:class:`ForkedWorker` is the part of ``subprocess.Popen`` the launcher uses (``pid``,
``stdout``, ``stderr``, ``poll``, ``wait``, ``kill``) plus ``sentinel``: the launcher
is not the worker's parent, so no SIGCHLD tells it of an exit; it waits on the sentinels.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from types import TracebackType
from typing import IO

# what a worker of unickpt.run with FSDP2 imports before its first line runs (~3 s of CPU);
# torch._dynamo too: torch's optimizers import it at their first add_param_group (0.6 s of
# CPU in every worker and every replacement that builds one)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "unickpt.live.run", "unickpt.api.manager")
SERVER_BOOT = "unickpt.live.forked_boot"  # preloaded first: the server dies with its launcher
# the signals that stop a job (a group's Ctrl-C, SLURM's SIGTERM or SIGUSR1): ignored by the
# server, which shares the launcher's process group; a worker gets Python's own handling back
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
                     if hasattr(signal, n))


def missing_modules(names: list[str]) -> list[str]:
    """The ones of ``names`` (``--preload``) whose top-level package no installed module
    answers (looked up without importing anything in the launcher: a submodule is the
    server's to import; one that fails there is imported again, and fails, in the worker)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name.partition(".")[0]) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


class WorkerServer:
    """The launcher's fork server (started once, from the launcher's main thread)."""

    def __init__(self, preload: list[str], env: dict[str, str]) -> None:
        """Start the server with ``env`` as its environment (what its imports read, such as
        ``OMP_NUM_THREADS``); it imports :data:`PRELOAD` and ``preload`` in the background."""
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload([SERVER_BOOT, *PRELOAD, *preload])
        saved = dict(os.environ)
        try:
            os.environ.clear()
            os.environ.update(env)
            from multiprocessing import forkserver
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def start(self, cmd: list[str], module: bool, env: dict[str, str]) -> ForkedWorker:
        """Fork a worker that runs ``cmd`` (the script or module, then its arguments) as
        ``python [-m] cmd...`` would, in ``env``. Raises OSError when the server is gone."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        out, err = Connection(out_w, readable=False), Connection(err_w, readable=False)
        try:
            proc = self.ctx.Process(target=_run_script, args=(cmd, module, env, out, err),
                                    name=f"unickpt-worker-{env.get('RANK', '')}", daemon=False)
            try:
                proc.start()
            except (EOFError, ConnectionError):  # the server ended (a preloaded module failed)
                raise OSError("the fork server is gone: a --preload module may have failed to import") from None
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            out.close()
            err.close()
        return ForkedWorker(proc, open(out_r, "rb"), open(err_r, "rb"))  # noqa: SIM115


class ForkedWorker:
    """A worker forked by :class:`WorkerServer`, used as the launcher uses a ``Popen``."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.proc, self.stdout, self.stderr = proc, stdout, stderr
        self.pid: int = proc.pid  # type: ignore[assignment]
        self.sentinel: int = proc.sentinel
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the worker ended (-N: killed by signal N), else None."""
        if self.returncode is None:
            self.returncode = self.proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        self.proc.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return code

    def kill(self) -> None:
        """SIGKILL the worker."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def die_with_parent() -> None:
    """SIGKILL this process when its parent ends (``PR_SET_PDEATHSIG``): a spawned worker
    (before its exec), the fork server, a forked worker (a lost node loses its workers)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _die_with_server() -> None:
    """In the forked worker: die with the server (which dies with the launcher)."""
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:  # the server ended before the call
        os._exit(1)


def _forget_server() -> None:
    """In the forked worker: drop what it inherited of the server's state (its end of the
    pipe whose closing tells the server its launcher is gone, and the server's address),
    so that the server ends with the launcher whatever workers live, and a worker that uses
    the forkserver start method itself gets a server of its own."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    with contextlib.suppress(AttributeError, OSError, TypeError):
        alive, server._forkserver_alive_fd = server._forkserver_alive_fd, None
        os.close(alive)
    with contextlib.suppress(AttributeError):
        server._forkserver_address = server._forkserver_pid = server._inherited_fds = None
        server._preload_modules = ["__main__"]


def _script_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's own first frame on: a spawned worker's shows no
    frame of this module or of runpy."""
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
        tb = tb.tb_next
    return tb


def _console(fd: int, errors: str) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors=errors, write_through=True)


def _run_script(cmd: list[str], module: bool, env: dict[str, str], out: Connection, err: Connection) -> None:
    """The forked worker's body: ``python [-m] cmd[0] cmd[1:]``, as a spawned worker runs."""
    for sig in STOP_SIGNALS:  # as a fresh interpreter has them (the server ignores them)
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    os.setsid()  # its own session, as start_new_session: the launcher signals its group
    _die_with_server()
    _forget_server()
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    sys.stdout = sys.__stdout__ = _console(1, "strict")
    sys.stderr = sys.__stderr__ = _console(2, "backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    target = cmd[0]
    sys.argv = list(cmd)
    code: int | str | None = 0
    interrupted = False
    try:
        if module:
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # noqa: BLE001 (as Python: said, then the exit)
        e.__traceback__ = _script_frames(e.__traceback__)  # what Python's hook prints
        sys.excepthook(type(e), e, e.__traceback__)
        interrupted, code = isinstance(e, KeyboardInterrupt), 1
    atexit._run_exitfuncs()
    if interrupted:  # as Python: an uncaught Ctrl-C ends the process by SIGINT
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(code)
