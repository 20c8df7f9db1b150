"""A user's own training loop (not the example trainer) made fault tolerant by
``unickpt.CheckpointManager`` in five lines; run under torchrun by tests/test_manager_loop.py.

FSDP2 over all ranks, AdamW, an LR scheduler, gradient clipping, dropout (so the RNG
matters), a buffer the optimizer does not own, changed by every forward, a Stateful data loader. Rank 0 appends ``{"step", "loss"}`` per step to
``--loss-log`` and, at the end, writes every parameter, optimizer moment, the scheduler
and loader state to ``--final`` (for bitwise comparisons).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unickpt


class Counted(torch.nn.Module):
    """Multiplies by a learned scale; counts its calls in a buffer the optimizer does not
    own (as batch-norm statistics are), the same on every rank."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(width))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.scale


class Loader:
    """Deterministic batches of a synthetic regression set; each rank takes its slice
    of every global batch; its state (epoch, position) is global."""

    def __init__(self, rank: int, world: int, global_batch: int = 12, size: int = 96) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, 16, generator=g)
        self.y = (self.x @ torch.randn(16, 4, generator=g)).tanh()
        self.rank, self.world, self.batch = rank, world, global_batch
        self.epoch, self.position = 0, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the next global batch."""
        if self.position + self.batch > len(self.x):
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        idx = order[self.position:self.position + self.batch]
        self.position += self.batch
        mine = idx[self.rank::self.world]
        return self.x[mine], self.y[mine]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.position = int(sd["epoch"]), int(sd["position"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--snapshot-every", type=int, default=0)
    p.add_argument("--parity", type=int, default=None)
    p.add_argument("--log-deltas", action="store_true")
    p.add_argument("--durable", default=None)
    p.add_argument("--keep", type=int, default=None)
    p.add_argument("--compute-sleep", type=float, default=0.0)
    p.add_argument("--stop-after", type=int, default=None, help="return after this step without close() (a failure)")
    p.add_argument("--loss-log", required=True)
    p.add_argument("--final", default=None)
    p.add_argument("--final-at", type=int, action="append", default=[],
                   help="also write --final's files as they are after this step, to FINAL_<step> (repeatable)")
    p.add_argument("--dropout", type=float, default=0.1)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), Counted(32), torch.nn.ReLU(),
                                torch.nn.Dropout(args.dropout), torch.nn.Linear(32, 4))
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    loader = Loader(rank, world)
    state = {"model": model, "optim": optimizer, "sched": scheduler, "loader": loader, "rng": unickpt.RNGState(),
             "samples": 0}

    # -- the five lines (plus the options) ---------------------------------------------
    manager = unickpt.CheckpointManager(
        args.ckpt_dir, keep=args.keep, save_every=args.save_every, async_save=args.async_save,
        snapshot_every=args.snapshot_every, parity=args.parity, log_deltas=args.log_deltas, durable=args.durable)
    start = manager.restore(state)
    for step in range(start + 1, args.steps + 1):
        if args.compute_sleep:
            time.sleep(args.compute_sleep)
        x, y = loader.next()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        manager.before_update()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state["samples"] += loader.batch
        manager.maybe_save(state, step)
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            with open(args.loss_log, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(total) / world}) + "\n")
        if step in args.final_at:  # one unbroken run serves as the reference of runs of several lengths
            write_final(f"{args.final}_{step}", model, optimizer, scheduler, loader, state, manager, rank)
        if args.stop_after == step:
            if args.durable:  # the last save's copy reached the durable tier before the failure (the
                manager.wait()  # copy is a daemon thread: a process that ends mid-copy leaves it unfinished)
            dist.destroy_process_group()
            return
    manager.close()
    if args.final:
        write_final(args.final, model, optimizer, scheduler, loader, state, manager, rank)
    dist.barrier()
    dist.destroy_process_group()


def write_final(path: str, model, optimizer, scheduler, loader, state, manager, rank: int) -> None:
    """Every parameter and optimizer moment, whole (collective), to ``path`` (rank 0), and
    the scheduler, loader, sample count and the manager's stats to ``path``.json."""
    tensors = {f"model.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    for name, param in model.named_parameters():
        for k, v in optimizer.state[param].items():
            tensors[f"optim.{name}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    if rank == 0:
        torch.save(tensors, path)
        sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
        with open(path + ".json", "w") as f:
            json.dump({"sched": sched, "loader": loader.state_dict(), "samples": state["samples"],
                       "stats": manager.stats()}, f)


if __name__ == "__main__":
    main()
