"""Launching the example trainer as simulated nodes (one torchrun agent per node on
localhost, each with its own shm root) and injecting failures, for the snapshot tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from unickpt.testing import free_port, kill_session

TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
TINY = ["--steps", "10", "--seed", "3", "--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--dataset-size", "240"]


def env_for(root: str) -> dict[str, str]:
    """The environment of one simulated node."""
    return dict(os.environ, OMP_NUM_THREADS="1", UNICKPT_SHM_ROOT=root)


def launch_nodes(cwd, roots: list[str], flags: list[str], nproc: int = 1, script: str | None = None,
                 agent: list[str] = ()) -> list[subprocess.Popen]:
    """One torchrun agent per shm root, all meeting at one c10d rendezvous on localhost;
    each agent in its own session (so a node's processes can be killed together). The
    example trainer runs, or ``script`` (a path) when given; ``agent``: more torchrun flags."""
    port = free_port()
    procs = []
    what = [script] if script else ["-m", "unickpt.examples.train"]
    for i, root in enumerate(roots):
        cmd = [TORCHRUN, f"--nnodes={len(roots)}", f"--node-rank={i}", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", *agent, *what, *flags]
        out = open(os.path.join(cwd, f"node{i}.log"), "w")
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env_for(root), stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def wait_all(procs: list[subprocess.Popen], cwd, timeout: float = 240, check: bool = True) -> list[str]:
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
