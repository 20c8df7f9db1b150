"""A one-rank trainer for tests/test_snapshot_ring.py: takes snapshots of steps 1-3 through
``CheckpointManager`` (each made whole before the next), writes what its ring held
(the inode of each step's rank file, where each slot is mapped) to ``--report``, then
starts the snapshot of step 4 and SIGKILLs itself while it is being copied.

    python tests/ring_kill_script.py --ckpt DIR --report FILE

The state of step ``s`` is :func:`state_of` ``(s)``: the test checks the recovered one
bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

NUMEL = 24 << 20  # 96 MiB of float32: the copy of step 4 takes tens of milliseconds at least


def state_of(step: int) -> dict[str, torch.Tensor]:
    """The training state as of ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.rand(NUMEL, generator=g), "b": torch.full((1000,), float(step))}


def _whole(mgr, step: int) -> None:
    from unickpt.snapshot.client import in_progress

    mgr._snap.settle()
    sdir = os.path.join(mgr._snap.jdir, f"step_{step:08d}")
    while in_progress(mgr._snap.jdir, mgr._snap.table) or not os.path.exists(os.path.join(sdir, "whole")):
        time.sleep(0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--report", required=True)
    args = p.parse_args()
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    import unickpt

    mgr = unickpt.CheckpointManager(args.ckpt, snapshot_every=1, parity=0)
    state = state_of(0)
    assert mgr.restore(state) == 0, mgr.restored_line
    report = {"steps": {}, "maps": []}
    for step in (1, 2, 3):
        for k, v in state_of(step).items():
            state[k].copy_(v)
        mgr.maybe_save(state, step)
        mgr.before_update()
        _whole(mgr, step)
        rank_file = os.path.join(mgr._snap.jdir, f"step_{step:08d}", "rank_00000.safetensors")
        report["steps"][str(step)] = os.stat(rank_file).st_ino
        report["maps"].append({str(i): s.buf.data_ptr() for i, s in mgr._snap.ring.slots.items()})
    report["slots"] = {str(i): os.stat(s.path).st_ino for i, s in mgr._snap.ring.slots.items()}
    with open(args.report, "w") as f:
        json.dump(report, f)
    for k, v in state_of(4).items():
        state[k].copy_(v)
    # SIGKILLed once the snapshot of step 4 is under way in the background (its copy into
    # a slot, or its commit), before it is whole; the report says whether it was still copying
    def kill() -> None:
        while mgr._snap.handle is None:
            time.sleep(0.0005)
        report["killed_while_copying"] = not mgr._snap.handle.staged()
        with open(args.report, "w") as f:
            json.dump(report, f)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    mgr.maybe_save(state, 4)
    time.sleep(30)
    sys.exit("not killed")


if __name__ == "__main__":
    main()
