"""Processes that use unickpt exit cleanly (issue 29: SIGABRT, "terminate called
without an active exception", at interpreter exit).

A gloo process group still referenced when the interpreter finalizes keeps its threads
running into the teardown, where one that drops a tensor's last reference needs the GIL
and the process aborts. unickpt held such references past ``destroy_process_group()``:
its memo of DTensor items (keyed on specs, which hold the device mesh and its groups)
and its own groups. ``unickpt.dist.release_groups`` drops them at exit.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import unickpt
from unickpt.testing import run_ranks

pytestmark = pytest.mark.multiprocess  # every test here starts processes

HERE = os.path.dirname(os.path.abspath(__file__))


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) - 1


def _held_groups_released(rank: int, world: int, out: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from unickpt.dist import release_groups

    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(256.0).reshape(16, 16), mesh, [Shard(0)])}
    unickpt.save(state, os.path.join(out, "ckpt"), overwrite=True)
    unickpt.async_save(state, os.path.join(out, "async"), overwrite=True).result()
    dist.barrier()
    dist.destroy_process_group()
    del state, mesh
    gc.collect()
    before = _threads()
    release_groups()  # what runs at exit, before the interpreter finalizes
    gc.collect()
    after = _threads()
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{before} {after}")
    dist.init_process_group("gloo", init_method=f"file://{out}/store2", rank=rank, world_size=world)  # run_ranks destroys it


def test_release_groups_frees_what_unickpt_held_of_the_mesh_and_its_channels(tmp_path):
    run_ranks(_held_groups_released, 2, str(tmp_path))
    for rank in range(2):
        before, after = map(int, open(tmp_path / f"rank{rank}").read().split())
        # the async-save channel's group (and what the memo of DTensor items held of the mesh)
        # were alive after destroy_process_group; releasing them joins their gloo threads
        assert after <= before - 3, (before, after)


def test_user_script_many_runs_under_load_exit_cleanly():
    """A user's script (save, async_save, snapshot kept in a global, barrier, destroy,
    return) run for ~15 s with the CPUs loaded: every process exits with status 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.join(os.path.dirname(HERE), "src"),
                                                                      os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, os.path.join(HERE, "clean_exit_script.py"), "--runs", "200", "--seconds", "15",
           "--world", "4", "--load", "1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "unclean 0" in r.stdout
