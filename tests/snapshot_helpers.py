"""Launching the example trainer as simulated nodes (one torchrun agent per node on
localhost, each with its own shm root) and injecting failures, for the snapshot tests.

Each agent is torchrun's own (``torch.distributed.run.main``) forked from a preloaded
launcher (tests/node_fork.py) and forks its workers (torchrun's ``--run-path
--start-method fork``): a node starts without importing torch in every process.
(tests/test_cli.py starts ``torchrun`` as a program, as a user does.)"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from unickpt.testing import free_port, kill_session

HERE = os.path.dirname(os.path.abspath(__file__))
# what a forked node's workers import beyond tests/node_fork.py's BASE, by the script they run
PRELOAD = {"lightning_train.py": ("lightning",), "hf_trainer_job.py": ("transformers", "transformers.trainer")}
TINY = ["--steps", "10", "--seed", "3", "--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--dataset-size", "240"]


def env_for(root: str) -> dict[str, str]:
    """The environment of one simulated node."""
    return dict(os.environ, OMP_NUM_THREADS="1", UNICKPT_SHM_ROOT=root)


class _Launcher:
    """The client of one tests/node_fork.py process (one per preload list, started at first use)."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "node_fork.py"), *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lock = threading.Lock()

    def ask(self, request: dict) -> dict:
        with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the nodes' launcher (tests/node_fork.py) ended ({self.proc.wait()}); its errors "
                                 "are on this test's stderr")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(30)


_LAUNCHERS: dict[tuple[str, ...], _Launcher] = {}


@atexit.register
def _close_launchers() -> None:
    for launcher in _LAUNCHERS.values():
        launcher.close()


class ForkedNode:
    """A node's torchrun agent forked by tests/node_fork.py, seen as a ``subprocess.Popen``
    (pid, poll, wait, returncode): the agent is not this process's child."""

    def __init__(self, launcher: _Launcher, pid: int, pids: str) -> None:
        self.launcher, self.pid, self.pids = launcher, pid, pids
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.launcher.ask({"poll": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"node agent {self.pid}", timeout or 0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def worker_pids(node: ForkedNode) -> dict[int, int]:
    """Global rank -> pid of a node's live workers, as they recorded themselves (a worker
    torchrun restarted replaces the one before it)."""
    out = {}
    for name in os.listdir(node.pids) if os.path.isdir(node.pids) else []:
        if not name.startswith("rank") or not name[4:].isdigit():
            continue  # a record being written
        try:
            pid = int(open(os.path.join(node.pids, name)).read())
            if int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == node.pid:  # still the agent's
                out[int(name[4:])] = pid
        except (OSError, ValueError, IndexError):
            continue  # ended
    return out


def launch_nodes(cwd, roots: list[str], flags: list[str], nproc: int = 1, script: str | None = None,
                 agent: list[str] = ()) -> list[ForkedNode]:
    """One torchrun agent per shm root, all meeting at one c10d rendezvous on localhost;
    each agent in its own session (so a node's processes can be killed together). The
    example trainer runs, or ``script`` (a path) when given; ``agent``: more torchrun flags."""
    port = free_port()
    preload = PRELOAD.get(os.path.basename(script or ""), ())
    launcher = _LAUNCHERS.get(preload) or _LAUNCHERS.setdefault(preload, _Launcher(preload))
    what = [script] if script else ["-m", "unickpt.examples.train"]
    procs = []
    for i, root in enumerate(roots):
        pids = os.path.join(os.path.abspath(cwd), f"node{i}.pids")
        shutil.rmtree(pids, ignore_errors=True)
        argv = [f"--nnodes={len(roots)}", f"--node-rank={i}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", *agent, "--start-method=fork", "--run-path",
                os.path.join(HERE, "node_rank.py"), *what, *flags]
        pid = launcher.ask({"start": argv, "cwd": os.path.abspath(cwd), "env": dict(env_for(root), NODE_PIDS=pids),
                            "log": os.path.abspath(os.path.join(cwd, f"node{i}.log"))})["pid"]
        procs.append(ForkedNode(launcher, pid, pids))
    return procs


def wait_all(procs: list, cwd, timeout: float = 240, check: bool = True) -> list[str]:
    """Wait for the agents; return each node's output (raise with it when one failed)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                kill_session(q)
            raise
    outs = [open(os.path.join(cwd, f"node{i}.log")).read() for i in range(len(procs))]
    if check and any(p.returncode for p in procs):
        raise AssertionError("a node failed:\n" + "\n".join(f"--- node {i} ---\n{o[-3000:]}" for i, o in enumerate(outs)))
    return outs


def wait_for(cond, timeout: float = 120, what: str = "condition", procs=()) -> None:
    """Poll ``cond`` until it holds; fail when ``timeout`` passes or one of ``procs`` ends first."""
    deadline = time.monotonic() + timeout
    while not cond():
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a process ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def commit_manifest(sdir: str, doc: dict) -> None:
    """Write a hand-made snapshot step's manifest as a snapshot commits it: whole, by a
    rename (a keeper that read it half-written would rightly leave the step alone)."""
    tmp = os.path.join(sdir, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(sdir, "manifest.json"))


def keeper_pid(root: str) -> int | None:
    """The pid in ``<root>/keeper.pid``, if any."""
    try:
        return int(open(os.path.join(root, "keeper.pid")).read())
    except (FileNotFoundError, ValueError):
        return None


def kill_keeper(root: str) -> None:
    """SIGKILL the keeper of a shm root (if it runs) and wait until it is gone."""
    pid = keeper_pid(root)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    for _ in range(500):
        try:
            os.waitpid(pid, os.WNOHANG)  # a keeper this process started (ensure_keeper in a test) is reaped
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def lose_node(root: str) -> None:
    """A lost node's memory: its keeper killed, its shm root deleted."""
    kill_keeper(root)
    shutil.rmtree(root, ignore_errors=True)


def steps_whole(root: str) -> list[int]:
    """Steps marked whole in a shm root (read by the test, the outside observer)."""
    base = os.path.join(root, "unickpt")
    out = []
    for job in (os.listdir(base) if os.path.isdir(base) else []):
        jdir = os.path.join(base, job)
        if not os.path.isdir(jdir):
            continue
        for d in os.listdir(jdir):
            if d.startswith("step_") and os.path.exists(os.path.join(jdir, d, "whole")):
                out.append(int(d[5:]))
    return sorted(out)


def step_dir(root: str, step: int) -> str:
    """The directory of a snapshot step in a shm root (the only job there)."""
    base = os.path.join(root, "unickpt")
    job = next(j for j in os.listdir(base) if os.path.isdir(os.path.join(base, j)))
    return os.path.join(base, job, f"step_{step:08d}")


def flip_bit(path: str, offset: int | None = None) -> None:
    """Flip one bit of a file (in the middle when no offset is given)."""
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        at = size // 2 if offset is None else offset
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def losses(path: str) -> dict[int, float]:
    """step -> loss of a --loss-log file (the last record of a step wins)."""
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}


def resumed_lines(outs: list[str]) -> list[str]:
    """The recovery lines printed (resumed ... / starting fresh ...)."""
    return [line for o in outs for line in o.splitlines() if line.startswith(("resumed step", "starting fresh"))]


def snapshots_during_slow_save(rank: int, world: int, env: dict[str, str], url: str, root: str, out: str) -> None:
    """Ranks of one node: an ``async_save`` to ``url`` (a throttled object store) is still
    writing while three snapshots are taken and committed; then the newest snapshot is
    recovered from memory into zeroed tensors. Rank 0 writes what it saw to ``out``."""
    import torch

    import unickpt
    from unickpt.api.load import load_into
    from unickpt import SnapshotOptions
    from unickpt.snapshot import Snapshotter, recover

    os.environ.update(env, UNICKPT_SHM_ROOT=root, UNICKPT_JOB_ID="slow-durable", GROUP_RANK="0", LOCAL_RANK=str(rank))
    gen = torch.Generator().manual_seed(rank)
    durable = {"w": torch.arange(64.0), "big": unickpt.PerRank(torch.randn(1 << 19, generator=gen))}  # 2 MiB a rank
    state = {"w": torch.zeros(1000), "mine": unickpt.PerRank(torch.full((500,), float(rank))), "step": 0}
    snap = Snapshotter("slow-durable", SnapshotOptions(every=1, parity=0))
    t0 = time.monotonic()
    handle = unickpt.async_save(durable, url)
    seen = []
    for step in (1, 2, 3):
        state["w"] += step
        state["mine"].value.mul_(2).add_(rank)
        state["step"] = step
        snap.snapshot(state, step).result()
        if rank == 0:  # and the keeper made it whole
            while not os.path.exists(os.path.join(snap.jdir, f"step_{step:08d}", "whole")):
                time.sleep(0.01)
        seen.append({"step": step, "at": time.monotonic() - t0, "durable_done": handle.done()})
    handle.result()
    durable_s = time.monotonic() - t0
    want = {"w": state["w"].clone(), "mine": state["mine"].value.clone()}
    state = {"w": torch.zeros(1000), "mine": unickpt.PerRank(torch.zeros(500)), "step": -1}

    def load(path, storage):
        load_into(state, path, storage=storage, manifest=storage.manifest)
        return int(state["step"])

    outcome = recover(snap, load)
    got = {"w": state["w"], "mine": state["mine"].value}
    back = {"w": torch.zeros(64), "big": unickpt.PerRank(torch.zeros(1 << 19))}
    unickpt.load(back, url)
    snap.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"snapshots": seen, "durable_s": durable_s, "line": outcome.line, "source": outcome.source,
                       "step": outcome.step, "bitwise": all(torch.equal(got[k], want[k]) for k in want),
                       "durable_bitwise": torch.equal(back["big"].value, durable["big"].value)
                       and torch.equal(back["w"], durable["w"])}, f)


def two_machines_rank(rank: int, world: int, roots: list[str], host: str, out: str) -> None:
    """Rank ``rank`` as node ``rank`` (its own shm root) whose keeper listens on ``host``:
    one snapshot protected by XOR parity across the 2 nodes, made whole by the keepers,
    then recovered from memory into zeroed tensors. Rank 0 writes the keepers'
    addresses, the recovery line and whether the state came back bitwise."""
    import torch

    import unickpt
    from unickpt.api.load import load_into
    from unickpt import SnapshotOptions
    from unickpt.snapshot import Snapshotter, recover

    os.environ.update(UNICKPT_SHM_ROOT=roots[rank], UNICKPT_JOB_ID="hosts", GROUP_RANK=str(rank), LOCAL_RANK="0",
                      UNICKPT_KEEPER_HOST=host)
    want = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    state = {"w": unickpt.PerRank(want.clone())}
    snap = Snapshotter("hosts", SnapshotOptions(every=1, parity=1))
    snap.snapshot(state, 1).result()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(snap.jdir, "step_00000001", "whole")):  # parity exchanged
        if time.monotonic() > deadline:
            raise TimeoutError("step 1 not whole")
        time.sleep(0.01)
    state["w"].value.zero_()

    def load(path, storage):
        load_into(state, path, storage=storage, manifest=storage.manifest)
        return 1

    outcome = recover(snap, load)
    ok = torch.tensor([int(torch.equal(state["w"].value, want))])
    torch.distributed.all_reduce(ok)
    snap.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"hosts": [t["host"] for t in snap.table], "line": outcome.line, "bitwise": int(ok) == world}, f)
