"""Run a function on N spawned ranks (gloo on localhost) and report each rank's failure.

Used by the test suite and the demo; users can use it to try unickpt without torchrun.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(AssertionError):
    """One or more spawned ranks raised; the message holds each rank's traceback."""


# "LO-HI": free_port() takes ports from this range only (the test suite gives each
# pytest-xdist worker its own slice below the kernel's ephemeral range, so two workers
# never pick the same port, nor does the kernel hand it to a client socket meanwhile).
PORTS_ENV = "UNICKPT_TEST_PORTS"
_cursor: int | None = None


def free_port() -> int:
    """A TCP port on localhost that is free right now (from ``$UNICKPT_TEST_PORTS`` when
    set, ``LO-HI``: each call the next free one after the last, starting at a place drawn
    from the process id, so that processes sharing a range rarely try the same one)."""
    span = os.environ.get(PORTS_ENV)
    if not span:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    try:
        lo, hi = (int(x) for x in span.split("-"))
        if not 0 < lo < hi < 65536:
            raise ValueError
    except ValueError:
        raise ValueError(f"${PORTS_ENV}={span!r}: expected LO-HI, two port numbers with LO < HI") from None
    global _cursor
    size = hi - lo + 1
    if _cursor is None or not lo <= _cursor <= hi:
        _cursor = lo + (os.getpid() * 7919) % size
    for _ in range(size):
        port, _cursor = _cursor, lo + (_cursor - lo + 1) % size
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in ${PORTS_ENV}={span}")


def _entry(rank: int, world: int, store: str, fn: Callable, args: tuple, errdir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    # run_ranks asks a rank that outlives its timeout for every thread's stack (SIGUSR1)
    faulthandler.register(signal.SIGUSR1, file=open(os.path.join(errdir, f"rank{rank}.stacks"), "w"), all_threads=True)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            fn(rank, world, *args)
            dist.barrier()  # tear down together: no rank closes its connections while a peer still uses them
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(errdir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240, preload: list[str] | None = None) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes with a gloo group.

    ``fn`` must be importable (a module-level function). The ranks meet through a file
    store in a fresh temporary directory, so concurrent runs never race for a TCP port.
    With ``preload`` (module names), ranks are forked from a fork server that imported
    those modules once, instead of spawned: on a 2-core machine 4 spawned ranks spend
    ~25 s importing torch, forked ones start in under a second.
    Raises RankFailure listing the traceback of every rank that failed; ranks still running
    after ``timeout`` seconds are killed, and the failure lists every thread's stack in each
    (a stopped rank is continued first, so that it can tell).
    """
    if preload:
        _serve(preload)
    with tempfile.TemporaryDirectory() as errdir:
        ctx = mp.start_processes(
            _entry, args=(world, os.path.join(errdir, "store"), fn, args, errdir), nprocs=world, join=False,
            start_method="forkserver" if preload else "spawn",
        )
        try:
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):  # False while one still runs
                if time.monotonic() >= deadline:
                    _kill_hung(ctx.processes)
                    raise RuntimeError(f"run_ranks: the ranks were still running after {timeout:g} s; killed")
        except Exception as e:
            reports = [f"{e}"]
            for r in range(world):
                for name, what in ((f"rank{r}.txt", "traceback"), (f"rank{r}.stacks", "stacks at the timeout")):
                    p = os.path.join(errdir, name)
                    if os.path.exists(p) and os.path.getsize(p):
                        reports.append(f"--- rank {r}: {what} ---\n{open(p).read()}")
            raise RankFailure("\n".join(reports)) from None


_SERVED: list[str] = []  # every module run_ranks(preload=...) was asked for in this process


def _serve(preload: list[str]) -> None:
    """Have the fork server import ``preload``. The process has one fork server, which
    imports the modules named when it starts: one started for other modules is stopped,
    and the next imports every module asked for so far (otherwise each rank forked from it
    imports what the server lacks, seconds of CPU a rank for torch._dynamo or a framework)."""
    missing = [m for m in preload if m not in _SERVED]
    if not missing:
        return
    stop = getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_stop", None)  # CPython's own, for its tests
    if stop is not None:
        stop()
    _SERVED.extend(missing)
    multiprocessing.set_forkserver_preload(list(_SERVED))


def _kill_hung(processes: list[Any]) -> None:
    """Every live rank writes its threads' stacks (SIGUSR1, continued if stopped), then is killed."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        for sig in (signal.SIGUSR1, signal.SIGCONT):
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
    time.sleep(1.0)  # faulthandler writes from the signal handler: a second is plenty
    for p in alive:
        p.kill()
        p.join()


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun's workers are in process groups of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_session(p: subprocess.Popen) -> None:
    """SIGKILL an agent and the trainers it started; snapshot keepers (detached, in their
    own sessions) are left alone: they outlive the trainers."""
    for pid in [p.pid, *descendants(p.pid)]:
        try:
            if b"unickpt.snapshot.keeper_server" in open(f"/proc/{pid}/cmdline", "rb").read():
                continue
        except OSError:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()
