"""A user-style distributed script run many times to count the runs whose processes do
not exit cleanly (issue 29: ``terminate called without an active exception``, SIGABRT,
at interpreter exit).

Each run: N ranks on one gloo group (file store) save with ``unickpt.save``, with
``unickpt.async_save`` and take a snapshot through ``Snapshotter`` (a keeper started
and stopped), then ``dist.barrier()``, ``dist.destroy_process_group()`` and a plain
return: the interpreter finalizes as any script's would. Ranks are forked from this
process after it imported torch and unickpt (a rank starts in a fraction of a second),
and each leaves through the interpreter's own exit, not ``os._exit``.

    python tests/clean_exit_script.py --runs 200 --world 4 --load 2

prints the number of runs and of processes that exited with a non-zero status or a
signal (``--load`` busy processes compete for the CPUs meanwhile).
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401  (imported once here, not in every rank)

THREADS_FILE: list[str] = []  # where a rank reports the threads still alive when its interpreter finalizes


@atexit.register  # before unickpt is imported: runs after unickpt's own exit handlers (LIFO)
def _report_threads() -> None:
    """Write the names of this process's threads other than the main one, as they are
    when the interpreter starts to finalize (a gloo thread still alive there can abort)."""
    if THREADS_FILE:
        names = []
        for tid in os.listdir("/proc/self/task"):
            if int(tid) != os.getpid():
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
        with open(THREADS_FILE[0], "w") as f:
            f.write("\n".join(names))


import unickpt  # noqa: E402
from unickpt import SnapshotOptions  # noqa: E402
from unickpt.snapshot.client import Snapshotter  # noqa: E402
from unickpt.testing import free_port  # noqa: E402


def user_script(rank: int, world: int, work: str, port: int) -> None:
    """What a user's script does: a device mesh (2 x world/2) and DTensor state over a
    TCPStore rendezvous, as under torchrun; save three ways, then barrier, destroy and
    return."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    faulthandler.enable(all_threads=True)  # an abort prints every thread's Python stack
    os.environ.update(UNICKPT_SHM_ROOT=os.path.join(work, "shm"), GROUP_RANK="0", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    w = distribute_tensor(torch.arange(4096.0).reshape(64, 64), mesh, [Shard(0), Shard(1)])
    state = {"w": w, "mine": unickpt.PerRank(torch.full((256,), float(rank))), "step": 3}
    unickpt.save(state, os.path.join(work, "sync"))
    handle = unickpt.async_save(state, os.path.join(work, "async"))
    snap = Snapshotter("clean-exit", SnapshotOptions(every=1, parity=0))
    KEPT.append(snap)  # a user's global holding on to it until the exit
    snap.snapshot(state, 3)
    handle.result()
    snap.close()
    dist.barrier()
    dist.destroy_process_group()


class RankDone(BaseException):
    """Raised in a forked rank once its script returned: unwinds to the module's top,
    where the rank exits through the interpreter (the parent's cleanup is skipped)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


PARENT = os.getpid()
KEPT: list = []


def fork_rank(rank: int, world: int, work: str, port: int) -> int:
    """Fork a rank that runs :func:`user_script` and then exits as the script would
    (:class:`RankDone`, then ``sys.exit`` at the top: atexit handlers, thread joins and
    the interpreter's finalization all run)."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    THREADS_FILE.append(os.path.join(work, f"threads{rank}"))
    try:
        user_script(rank, world, work, port)
    except Exception:
        import traceback

        traceback.print_exc()
        code = 1
    raise RankDone(code)


def one_run(world: int, timeout: float = 120) -> list[int]:
    """Run the script on ``world`` ranks; every rank's wait status (0: clean exit)."""
    work = tempfile.mkdtemp(prefix="clean-exit")
    try:
        port = free_port()
        pids = [fork_rank(r, world, work, port) for r in range(world)]
        deadline = time.monotonic() + timeout
        statuses = {}
        while len(statuses) < world:
            for pid in pids:
                if pid not in statuses:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        statuses[pid] = status
            if time.monotonic() > deadline:
                for pid in pids:
                    if pid not in statuses:
                        os.kill(pid, 9)
                        statuses[pid] = os.waitpid(pid, 0)[1]
                break
            time.sleep(0.01)
        alive = []
        for r in range(world):
            try:
                with open(os.path.join(work, f"threads{r}")) as f:
                    alive += [n for n in f.read().split("\n") if n]
            except FileNotFoundError:
                alive.append(f"rank {r} did not report")
        return [statuses[p] for p in pids], alive
    finally:
        if os.getpid() == PARENT:
            shutil.rmtree(work, ignore_errors=True)


def busy() -> None:
    """A CPU hog (the load other jobs put on a shared machine)."""
    while True:
        pass


def main(argv: list[str] | None = None) -> None:
    """Count unclean exits over ``--runs`` runs; exit status 1 if there was any."""
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--load", type=int, default=2, help="busy processes running meanwhile")
    p.add_argument("--progress", action="store_true", help="print every run's exit statuses")
    p.add_argument("--seconds", type=float, default=None, help="stop starting runs after this long")
    args = p.parse_args(argv)
    hogs = []
    for _ in range(args.load):
        pid = os.fork()
        if pid == 0:
            busy()
        hogs.append(pid)
    bad, runs, t0, threads = [], 0, time.monotonic(), []
    try:
        for _ in range(args.runs):
            if args.seconds is not None and time.monotonic() - t0 > args.seconds:
                break
            statuses, alive = one_run(args.world)
            runs += 1
            bad += [s for s in statuses if s != 0]
            threads += alive
            if args.progress:
                print(f"run {runs}: {statuses} threads alive at exit: {alive}", flush=True)
    finally:
        for pid in hogs if os.getpid() == PARENT else []:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    described = [f"signal {os.WTERMSIG(s)}" if os.WIFSIGNALED(s) else f"exit {os.WEXITSTATUS(s)}" for s in bad]
    print(f"runs {runs} processes {runs * args.world} unclean {len(bad)} {described} threads alive at exit "
          f"{len(threads)} {sorted(set(threads))} in {time.monotonic() - t0:.1f} s", flush=True)
    raise SystemExit(1 if bad else 0)  # threads: reported (torch itself keeps a device mesh group alive)


if __name__ == "__main__":
    try:
        main()
    except RankDone as done:
        sys.exit(done.code)
