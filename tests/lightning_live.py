"""A Lightning job under ``unickpt launch`` with live recovery
(``unickpt.integrations.lightning.run``), run by tests/test_lightning.py: the Trainer, the
module and the callback are built per generation; DDP over gloo (or ``--strategy fsdp2``:
FSDP2 through ModelParallelStrategy). The data is tests/lightning_train.py's global
stream (``GLOBAL_BATCH`` samples a step whatever the number of ranks, each rank its equal
slice), so a run that loses a rank keeps the unbroken run's batches.

Every rank appends one line per step to ``--log``: the step, the global mean loss, the
sum of the global batch's inputs (which samples were seen), the world size, the
generation, its rank and pid, and the time.
"""

from __future__ import annotations


import lightning as L
import torch
import torch.distributed as dist

from unickpt.integrations.lightning import UnickptCallback, run

from lightning_train import Batches, Recorded, Regression, ShardedRegression
from live_helpers import live_args, log_step

GLOBAL_BATCH = 12  # an equal slice on 1, 2, 3, 4 or 6 ranks
SAMPLES = 96  # 8 steps an epoch


class Logged(Regression):
    """Regression whose every rank logs each step with where it ran."""

    def __init__(self, log: str, world, sleep: float) -> None:
        super().__init__(0.0, log, sleep)
        self.world = world

    def training_step(self, batch, batch_idx):
        self._xsum = batch[0].sum().detach().clone()
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        total = torch.stack([self._loss, self._xsum])
        dist.all_reduce(total)
        log_step(self.loss_log, self.world, self.global_step, float(total[0]) / self.world.size, float(total[1]),
                 self.sleep)


class ShardedLogged(Logged):
    configure_model = ShardedRegression.configure_model


def main() -> None:
    args = live_args(lambda p: p.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp"))

    given = Recorded(args.log + ".given")  # built once per process, as a user's logger should be

    def fit(world) -> None:
        L.seed_everything(0, verbose=False)
        if args.strategy == "fsdp2":
            from lightning.pytorch.strategies import ModelParallelStrategy

            model = ShardedLogged(args.log, world, args.sleep)
            strategy = ModelParallelStrategy(data_parallel_size=world.size, tensor_parallel_size=1,
                                             process_group_backend="gloo")
        else:
            model, strategy = Logged(args.log, world, args.sleep), "ddp"
        trainer = L.Trainer(accelerator="cpu", devices=world.local_size, num_nodes=world.nodes, strategy=strategy,
                            max_steps=args.steps, logger=given, log_every_n_steps=1, enable_checkpointing=False,
                            enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                            callbacks=[UnickptCallback(args.ckpt_dir, snapshot_every=1, per_rank_data=False)])
        trainer.fit(model, train_dataloaders=Batches(world.rank, world.size, GLOBAL_BATCH, SAMPLES))

    run(fit)


if __name__ == "__main__":
    main()
