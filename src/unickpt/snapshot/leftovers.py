"""What a node's shm root holds after a job: its keeper and the snapshots it holds. A job
that ends cleanly (``CheckpointManager.close()``) leaves nothing; a job killed and not
relaunched leaves its keeper holding its snapshots in host memory (it serves the relaunch
that never comes). ``unickpt snapshots [--free]`` lists and frees them."""

from __future__ import annotations

import os
from typing import Any

from . import paths
from .keeper_admin import running_keeper, stop_keeper


def held_snapshots(root: str) -> dict[str, Any]:
    """What the shm ``root`` holds: ``keeper`` (the live keeper's pid, job, address; None
    when none runs) and ``jobs`` (each job directory: ``job``, ``steps`` held, ``whole``
    steps, ``bytes``, and ``memory``: the most its snapshots hold on this node, as the job
    stated it (``state``, ``ring``, ``ring_slots``, ``parity``, ``total``, ``cap``), or None)."""
    keeper = running_keeper(root)
    jobs = []
    base = paths.base_dir(root)
    names = sorted(os.listdir(base)) if os.path.isdir(base) else []
    for name in names:
        jdir = os.path.join(base, name)
        if not os.path.isdir(jdir):
            continue
        held = paths.steps(jdir)
        whole = [s for s in held if os.path.exists(os.path.join(jdir, paths.step_name(s), paths.WHOLE))]
        jobs.append({"job": name, "steps": held, "whole": whole, "bytes": paths.dir_bytes(jdir),
                     "memory": paths.read_memory(jdir)})
    return {"root": root, "keeper": keeper, "jobs": jobs}


def free_snapshots(root: str, timeout: float = 30.0) -> dict[str, Any]:
    """Stop ``root``'s keeper (it deletes its job's snapshots and exits) and remove the
    snapshots no live keeper holds; returns what was held before."""
    before = held_snapshots(root)
    stop_keeper(root, timeout)
    if running_keeper(root) is None:
        for job in before["jobs"]:
            paths.remove_tree(os.path.join(paths.base_dir(root), job["job"]))
        for leftover in (paths.address_file(root), paths.pid_file(root), os.path.join(paths.base_dir(root), "keeper.log")):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        paths.remove_if_empty(root)
    return before


def running_jobs(root: str) -> list[int]:
    """The pids of this machine's processes of a job that uses the shm ``root``: trainers
    (torchrun's ``RANK`` and ``LOCAL_RANK`` in their environment) and ``unickpt launch``
    launchers whose ``$UNICKPT_SHM_ROOT`` (else /dev/shm) is ``root``. Linux (/proc); the
    processes of other users are not seen."""
    want = os.path.realpath(root)
    out = []
    me = os.getpid()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if any(b"keeper_server" in a for a in argv):
            continue  # a keeper (it inherits its trainer's environment): what --free stops
        trainer = b"RANK" in env and b"LOCAL_RANK" in env
        launcher = b"launch" in argv and any(a.endswith(b"unickpt") for a in argv)
        if not (trainer or launcher):
            continue
        used = env.get(paths.SHM_ROOT_ENV.encode(), b"").decode(errors="replace") or "/dev/shm"
        if os.path.realpath(used) == want:
            out.append(int(entry))
    return out
