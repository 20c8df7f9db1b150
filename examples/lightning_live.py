"""A Lightning fit that keeps training through the loss of a rank, in the same processes.

    unickpt launch --standalone --nproc-per-node 3 --max-restarts 1 --start-method forkserver --preload lightning \
        examples/lightning_live.py [--steps 2000]

Kill one of the three workers (``kill -9 <pid>``): the two others print
``rank 2 lost (exit -9); continuing on 2 ranks at step S (generation 1)`` and go on from
memory within a second; the replacement, forked from the launcher's fork server (which
imported torch and Lightning once), joins a second or so later (``1 replacement
joined; continuing on 3 ranks``), or in the same re-forming when it is ready by then
(``rank 2 lost (exit -9), 1 joined``). Without ``--start-method forkserver`` every worker
is a fresh interpreter and the replacement joins after its imports (5-10 s). The global batch stays 12 samples whatever the number
of ranks, so the loss follows the unbroken run's curve.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F

from unickpt.integrations.lightning import UnickptCallback, run

GLOBAL_BATCH = 12  # an equal slice on 1, 2, 3, 4 or 6 ranks


class GlobalStream:
    """Global batches of a synthetic regression set; each rank yields its slice of each.
    Its state (epoch, position) is the same on every rank: it reshards to any world."""

    def __init__(self, rank: int, world: int, size: int = 960) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 16, generator=g)
        self.y = (self.x @ torch.randn(16, 4, generator=g)).tanh()
        self.rank, self.world, self.epoch, self.position = rank, world, 0, 0

    def __len__(self) -> int:
        return len(self.x) // GLOBAL_BATCH

    def __iter__(self):
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        while self.position < len(self):
            batch = order[self.position * GLOBAL_BATCH:(self.position + 1) * GLOBAL_BATCH]
            self.position += 1
            idx = batch[self.rank::self.world]
            yield self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.position = int(sd["epoch"]), int(sd["position"])


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(world, steps: int) -> None:
    """One generation: the Trainer, a fresh module and the callback for this world."""
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=world.local_size, num_nodes=world.nodes, strategy="ddp",
                        max_steps=steps, logger=False, enable_checkpointing=False, use_distributed_sampler=False,
                        callbacks=[UnickptCallback("ckpt", snapshot_every=1, per_rank_data=False)])
    trainer.fit(Model(), train_dataloaders=GlobalStream(world.rank, world.size))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    steps = parser.parse_args().steps
    run(lambda world: fit(world, steps))
