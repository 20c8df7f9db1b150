"""A user's FSDP2 training loop under ``unickpt.run``, started by ``unickpt launch`` in
tests/test_live.py (and under torchrun there: ``fn`` called once).

Every rank appends one line per step to ``--log``: the step, the global mean loss, the
world size, the generation, its rank and pid. The loss is the mean over one global
batch whatever the number of ranks (each rank takes an equal slice), so a run that loses
a rank and goes on with fewer follows the unbroken curve (:func:`reference`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unickpt

GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4 and 6 ranks


def build() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, 8, generator=g)
    y = torch.randn(96, 2, generator=g)
    return model, x, y


def batch(step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (1-based)."""
    i = ((step - 1) * GLOBAL_BATCH) % len(x)
    return x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]


def reference(steps: int) -> list[float]:
    """The unbroken run's loss per step, on one process (the same arithmetic, up to the
    order of the sums)."""
    model, x, y = build()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(1, steps + 1):
        xb, yb = batch(step, x, y)
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        optim.step()
        optim.zero_grad()
        out.append(float(loss.detach()))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds of 'compute' per step")
    p.add_argument("--snapshot-every", type=int, default=1)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: a dp x tp mesh, FSDP2 over dp; "
                   "unickpt.run(train, multiple_of=tp)")
    p.add_argument("--multiple-of", type=int, default=None, help="unickpt.run's multiple_of (default: --tp)")
    p.add_argument("--stop-file", default=None, help="end the run (every rank at the same step) once this file "
                   "exists: a test stops a long run when it has seen what it waits for, however slow the machine")
    p.add_argument("--stop-before-first-step", type=int, default=None, metavar="RANK",
                   help="this rank stops itself (SIGSTOP) in generation 0 once restored, before its first step; "
                   "the time into --log's '.stopped' file")
    args = p.parse_args()

    def train(world: unickpt.World) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model, x, y = build()
        if args.tp > 1:  # FSDP2 x TP on a dp x tp mesh: the layout only a multiple of tp ranks can hold
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh2 = init_device_mesh("cpu", (world.size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            mesh, dp, dp_size = mesh2["dp"], mesh2["dp"].get_local_rank(), world.size // args.tp
        else:
            mesh, dp, dp_size = init_device_mesh("cpu", (world.size,)), world.rank, world.size
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = {"model": model, "optim": optim}
        manager = unickpt.CheckpointManager(args.ckpt_dir, snapshot_every=args.snapshot_every)
        start = manager.restore(state)
        if world.generation == 0 and world.rank == args.stop_before_first_step:
            with open(args.log + ".stopped", "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)  # its launcher's hang check kills it
        for step in range(start + 1, args.steps + 1):
            if args.stop_file:  # rank 0 decides, every rank ends at the same step
                stop = torch.tensor([float(world.rank == 0 and os.path.exists(args.stop_file))])
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if stop.item():
                    break
            xb, yb = batch(step, x, y)
            loss = F.mse_loss(model(xb[dp::dp_size]), yb[dp::dp_size])
            loss.backward()
            if args.sleep:
                time.sleep(args.sleep)
            manager.before_update()
            optim.step()
            optim.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            manager.maybe_save(state, step)
            # logged after maybe_save, as a user's loop does: a step whose boundary a
            # replacement joins at runs to its end too
            with open(args.log, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(total) / world.size, "size": world.size,
                                    "generation": world.generation, "rank": world.rank, "pid": os.getpid(), "t": time.time()}) + "\n")
        manager.close()

    unickpt.run(train, multiple_of=args.multiple_of or args.tp)


if __name__ == "__main__":
    main()
