"""What a snapshot every step costs a small model's step: the fixed part of a snapshot
(its collectives, its bookkeeping), which the write rate (``bench.snapshot_rate``) does
not show.

Two ranks (one node, gloo), a tiny model (8 -> 16 -> 2, AdamW), ``CheckpointManager`` in
a plain loop, the same steps timed three ways in the same run:

- without snapshots (``snapshot_every=0``): the step itself;
- with a snapshot every step (``snapshot_every=1``): the step, the snapshot's stall and
  the background commit competing for the same cores;
- one ``all_reduce`` of one element on the same group: the floor of any agreement between
  the ranks.

It prints each per step (wall, and CPU of rank 0's process, all its threads), how many
snapshots were taken and how many skipped (a snapshot is skipped while the node's keeper
still encodes two earlier ones: then a step costs less; the node's ranks wake the keeper
as each step commits, so on one node none is skipped), what a snapshot adds to a step and
what one snapshot taken costs, in milliseconds and in all-reduces, and what restoring the
newest one costs (the manager closed keeping its snapshots, a second one restoring them
into a state built again: what a relaunch pays)::

    python -m bench.snapshot_step              # 300 steps each way
    python -m bench.snapshot_step --steps 100
    python -m bench.snapshot_step --blocks 100 --steps 100   # many small tensors: 1,601 in the state

``--blocks N`` replaces the model by N blocks of ``Linear(64, 64)`` + ``LayerNorm(64)``
(four parameters a block, each with AdamW's two moments and its step count: 16 tensors a
block; 1,601 entries at 100, with the optimizer's param_groups): what a snapshot costs
per tensor, which a real model's hundreds of parameters and their optimizer state pay.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time

WARM = 30  # steps before the timing: the keeper started, the ring sized, the first commits done


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _state(blocks: int):
    """The model (tiny, or ``blocks`` blocks), its AdamW and the state of both."""
    import torch

    if blocks:
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
                                      for _ in range(blocks)])
    else:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim, {"model": model, "optim": optim}


def _loop(rank: int, world: int, work: str, steps: int, every: int, out: str, blocks: int = 0) -> None:
    import torch
    import torch.distributed as dist

    import unickpt

    os.environ.update(UNICKPT_SHM_ROOT=os.path.join(work, f"shm{every}"), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    torch.manual_seed(0)
    model, optim, state = _state(blocks)
    x = torch.randn(4, 64 if blocks else 8)
    manager = unickpt.CheckpointManager(os.path.join(work, f"ck{every}"), snapshot_every=every)
    manager.restore(state)
    figures = {}
    for phase, n in (("warm", WARM), ("timed", steps)):
        dist.barrier()
        before = manager.stats()
        c0, t0 = _cpu(), time.perf_counter()
        for i in range(n):
            step = i + 1 + (WARM if phase == "timed" else 0)
            model(x).sum().backward()
            manager.before_update()
            optim.step()
            optim.zero_grad()
            manager.maybe_save(state, step)
        manager.wait()
        figures[phase] = ((time.perf_counter() - t0) / n, (_cpu() - c0) / n)
        after = manager.stats()
        figures[phase + "_snapshots"] = [after["snapshots"] - before["snapshots"],
                                         after["snapshots_skipped"] - before["snapshots_skipped"]]
    manager.close(keep_snapshots=bool(every))
    if every:  # the newest snapshot restored into a state built again, as a relaunch does
        _, _, again = _state(blocks)
        second = unickpt.CheckpointManager(os.path.join(work, f"ck{every}"), snapshot_every=every)
        dist.barrier()
        c0, t0 = _cpu(), time.perf_counter()
        second.restore(again)
        figures["restore"] = (time.perf_counter() - t0, _cpu() - c0, second.restored_line.split(" (")[0])
        second.close()
    one = torch.ones(1)
    dist.barrier()
    c0, t0 = _cpu(), time.perf_counter()
    for _ in range(steps):
        dist.all_reduce(one)
    figures["all_reduce"] = ((time.perf_counter() - t0) / steps, (_cpu() - c0) / steps)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(figures, f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.snapshot_step", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="timed steps each way (after 30 to warm up)")
    p.add_argument("--blocks", type=int, default=0,
                   help="a model of this many Linear(64, 64) + LayerNorm(64) blocks (16 tensors of state each) "
                        "in place of the tiny one")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.blocks < 0:
        p.error("--blocks must be 0 or more")
    from unickpt.testing import run_ranks

    work = tempfile.mkdtemp(prefix="unickpt-bench-step-")
    try:
        got = {}
        for every in (0, 1):
            out = os.path.join(work, f"figures{every}.json")
            run_ranks(_loop, 2, work, args.steps, every, out, args.blocks,
                      preload=["torch", "unickpt", "unickpt.api.manager", __name__])
            got[every] = json.load(open(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (w0, c0), (w1, c1) = got[0]["timed"], got[1]["timed"]
    wa, ca = got[1]["all_reduce"]
    ms = 1e3
    what = f"{args.blocks} blocks, {16 * args.blocks + 1} entries of state" if args.blocks else "a tiny model"
    print(f"2 ranks, gloo, {what}, {args.steps} steps each way (per step; CPU: rank 0's process, every thread)")
    print(f"  without snapshots        {w0 * ms:7.2f} ms wall  {c0 * ms:7.2f} ms CPU")
    taken, skipped = got[1]["timed_snapshots"]
    why = ": the keeper still held two in progress" if skipped else ""
    print(f"  a snapshot every step    {w1 * ms:7.2f} ms wall  {c1 * ms:7.2f} ms CPU  ({taken} taken, {skipped} skipped{why})")
    print(f"  one all_reduce (floor)   {wa * ms:7.2f} ms wall  {ca * ms:7.2f} ms CPU")
    print(f"  a snapshot adds          {(w1 - w0) * ms:7.2f} ms wall  {(c1 - c0) * ms:7.2f} ms CPU  "
          f"= {(w1 - w0) / wa:.1f} all_reduces of wall, {(c1 - c0) / ca:.1f} of CPU (a step)")
    rw, rc, said = got[1]["restore"]
    print(f"  a restore ({said})   {rw * ms:7.2f} ms wall  {rc * ms:7.2f} ms CPU  (a new manager, a state built again)")
    if taken:
        per = args.steps / taken  # what the steps paid, over the snapshots they took
        print(f"  one snapshot taken costs {(w1 - w0) * per * ms:7.2f} ms wall  {(c1 - c0) * per * ms:7.2f} ms CPU  "
              f"= {(w1 - w0) * per / wa:.1f} all_reduces of wall")


if __name__ == "__main__":
    main()
