"""A tiny Lightning job made fault tolerant by ``unickpt.integrations.lightning.UnickptCallback``;
run under torchrun (DDP over gloo, CPU; or ``--strategy fsdp2``: FSDP2 through Lightning's
ModelParallelStrategy) by tests/test_lightning.py.

The model has dropout (so the RNG matters); AdamW with a per-step LR schedule; the training
data is a resumable iterable: each rank takes its slice of every global batch, and its
state (epoch, batch) is the position in the global stream, the same on every rank. Rank 0
appends ``{"step", "loss"}`` (the loss of the global batch) per step to ``--loss-log`` and,
at the end, writes the weights and the optimizer's moments to ``--final``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

from unickpt.integrations.lightning import UnickptCallback


class Batches:
    """A synthetic regression set served as global batches of ``batch`` samples, in an
    order reshuffled each epoch; each rank yields its slice of every global batch."""

    def __init__(self, rank: int, world: int, batch: int = 8, size: int = 80) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, 16, generator=g)
        self.y = (self.x @ torch.randn(16, 4, generator=g)).tanh()
        self.rank, self.world, self.batch = rank, world, batch
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return len(self.x) // self.batch

    def __iter__(self):
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        while self.position < len(self):
            idx = order[self.position * self.batch:(self.position + 1) * self.batch][self.rank::self.world]
            self.position += 1  # before the yield: the state at a batch's end counts it
            yield self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.position = int(sd["epoch"]), int(sd["position"])


class Recorded(L.pytorch.loggers.Logger):
    """A real Lightning logger that keeps each (step, loss) it is given; with ``path``, rank
    0 also appends each to it as a JSON line (a live job's logger, built once per process)."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__()
        self.path = path
        self.calls: list[tuple[int, float]] = []

    @property
    def name(self) -> str:
        return "recorded"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        if "loss" not in metrics:
            return
        self.calls.append((step, float(metrics["loss"])))
        if self.path and (not dist.is_initialized() or dist.get_rank() == 0):
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(metrics["loss"])}) + "\n")


class Regression(L.LightningModule):
    def __init__(self, dropout: float, loss_log: str, sleep: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                                       torch.nn.Linear(32, 4))
        self.loss_log, self.sleep = loss_log, sleep

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self._loss = loss.detach().clone()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        total = self._loss
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        if self.global_rank == 0:
            with open(self.loss_log, "a") as f:
                f.write(json.dumps({"step": self.global_step, "loss": float(total)}) + "\n")
        if self.sleep:
            time.sleep(self.sleep)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ShardedRegression(Regression):
    """The same module sharded by FSDP2 over Lightning's ModelParallelStrategy mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # collective for a DTensor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--snapshot-every", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--loss-log", required=True)
    p.add_argument("--final", default=None)
    p.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    args = p.parse_args()

    L.seed_everything(0, verbose=False)
    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        model = ShardedRegression(args.dropout, args.loss_log, args.sleep)
        strategy = ModelParallelStrategy(data_parallel_size=nproc, tensor_parallel_size=1,
                                         process_group_backend="gloo")
    else:
        model, strategy = Regression(args.dropout, args.loss_log, args.sleep), "ddp"
    callback = UnickptCallback(args.ckpt_dir, save_every=args.save_every, async_save=True,
                               snapshot_every=args.snapshot_every, per_rank_data=False)
    trainer = L.Trainer(accelerator="cpu", devices=nproc, strategy=strategy, max_steps=args.steps,
                        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    rank, world = trainer.global_rank, trainer.world_size
    trainer.fit(model, train_dataloaders=Batches(rank, world))
    if args.final:
        _write_final(args.final, model, trainer, callback)
    if dist.is_initialized():  # as torch asks: destroyed before the interpreter exits, not by Lightning's atexit
        dist.barrier()
        dist.destroy_process_group()


def _write_final(path: str, model: Regression, trainer: L.Trainer, callback: UnickptCallback) -> None:
    """Rank 0 writes the full weights and moments (collective for DTensors) and the run's facts."""
    rank = trainer.global_rank
    opt = trainer.optimizers[0]
    tensors = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    for name, param in model.named_parameters():
        for k, v in opt.state[param].items():
            tensors[f"optim.{name}.{k}"] = _full(v)
    if rank == 0:
        torch.save(tensors, path)
        with open(path + ".json", "w") as f:
            json.dump({"restored_step": callback.restored_step, "global_step": trainer.global_step,
                       "epoch": trainer.current_epoch, "stats": callback.manager.stats()}, f)


if __name__ == "__main__":
    main()
