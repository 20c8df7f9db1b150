"""torchtitan's training loop under ``unickpt launch`` with live recovery (``unickpt.run``),
run by tests/test_torchtitan.py: torchtitan's components (tests/titan_cases.py: its Llama 3,
FSDP2 as torchtitan applies it, ``OptimizersContainer``, ``LRSchedulersContainer``,
``ParallelAwareDataloader``, a train state) and the integration's checkpointer, built per
generation and driven as ``Trainer.train`` drives them: ``load(step=-1)``; per step
``maybe_wait_for_staging()`` before ``optimizers.step()``, ``save(step, last_step)``.
torchtitan's ``Trainer`` itself needs a GPU; this is its loop on CPU over gloo.

The data is a global stream (``GLOBAL_BATCH`` sequences a step whatever the number of
ranks, each rank its equal slice), which goes on at the restored ``train_state.step`` on
any number of ranks: torchtitan's loader refuses another data-parallel degree ("dataloader
resharding is not supported yet"), so its position, kept per rank, is left alone there.

Every rank appends one line per step to ``--log`` (tests/live_helpers.log_step).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader

import unickpt
from unickpt.integrations.torchtitan import UnickptCheckpointManager

from live_helpers import live_args, log_step
from titan_cases import SEQ, VOCAB, TrainState, sharded_parts, train_step

GLOBAL_BATCH = 6  # an equal slice on 1, 2, 3 or 6 ranks


class GlobalTokens(IterableDataset):
    """Step ``s``'s global batch is the same on any number of ranks (sequence ``i`` seeded
    by ``(s, i)``); this rank yields its slice. Stateful: the next step."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.step = rank, world, 0

    def __iter__(self):
        per = GLOBAL_BATCH // self.world
        while True:
            rows = [torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(1000 * self.step + i))
                    for i in range(self.rank * per, (self.rank + 1) * per)]
            self.step += 1
            for row in rows:
                yield {"input": row[:-1]}, row[1:]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def build(world: unickpt.World, steps: int, folder: str | None):
    """torchtitan's components for ``world`` (FSDP2 over its ranks) and the checkpointer
    (off when ``folder`` is None), as torchtitan's ``Trainer`` builds them."""
    model, optimizers, lr_schedulers = sharded_parts(world.size, steps, total_steps=steps)
    data = GlobalTokens(world.rank, world.size)
    dataloader = ParallelAwareDataloader(data, dp_rank=world.rank, dp_world_size=world.size,
                                         batch_size=GLOBAL_BATCH // world.size)
    state = TrainState()
    checkpointer = UnickptCheckpointManager.Config(
        enable=folder is not None, folder=folder or "unused", interval=1000, snapshot_every=1,
    ).build(dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": state}, sd_adapter=None, base_folder="")
    return model, optimizers, lr_schedulers, data, dataloader, state, checkpointer


def train(world: unickpt.World, steps: int, folder: str | None, log: str, sleep: float) -> None:
    """One generation of the loop: build, restore (from memory after a re-forming), train
    to ``steps``. Logs each step's global loss and the sum of the global batch's inputs."""
    model, optimizers, lr_schedulers, data, dataloader, state, checkpointer = build(world, steps, folder)
    checkpointer.load(step=-1)
    data.step = state.step  # the global stream goes on at the restored step, on any number of ranks
    batches = iter(dataloader)
    while state.step < steps:
        loss, inputs = train_step(model, batches, optimizers, lr_schedulers, checkpointer, state, steps)
        total = torch.stack([loss.detach(), inputs["input"].sum().float()])
        if world.size > 1:
            dist.all_reduce(total)
        log_step(log, world, state.step, float(total[0]) / world.size, float(total[1]), sleep)
    checkpointer.close()


def main() -> None:
    args = live_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    unickpt.run(lambda world: train(world, args.steps, args.ckpt_dir, args.log, args.sleep))


if __name__ == "__main__":
    main()
