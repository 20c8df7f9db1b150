"""A Hugging Face Trainer job under ``unickpt launch`` with live recovery
(``unickpt.integrations.hf.run``), run by tests/test_hf_trainer.py: the model, the
``TrainingArguments`` (``GLOBAL_BATCH // world.size`` samples a rank: the global batch
kept), the manager and the trainer built per generation; DDP over gloo, no dropout.

Every rank appends one line per optimizer step to ``--log``: the step, the loss of the
global batch (the Trainer's, averaged over the ranks), the sum of the global batch's
token ids (which samples were seen), the world size, the generation, its rank and pid,
and the time.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from transformers import TrainerCallback

import unickpt
from unickpt.integrations.hf import UnickptTrainer, run

from hf_trainer_job import Tokens, tiny_llama, training_args
from live_helpers import live_args, log_step

GLOBAL_BATCH = 12  # an equal slice on 1, 2, 3, 4 or 6 ranks; Tokens() has 48 samples: 4 steps an epoch


class Counting(UnickptTrainer):
    """Counts the token ids of the batches this rank trains on in the current optimizer step."""

    ids_seen = 0

    def training_step(self, model, inputs, *args, **kwargs):
        Counting.ids_seen += int(inputs["input_ids"].sum())
        return super().training_step(model, inputs, *args, **kwargs)


class StepLog(TrainerCallback):
    """Each rank logs each optimizer step as a reporter does (``on_log``: after the
    Trainer's own logging; a step re-done after a re-forming is reported once)."""

    def __init__(self, path: str, world: unickpt.World, sleep: float) -> None:
        self.path, self.world, self.sleep = path, world, sleep

    def on_step_begin(self, args, state, control, **kwargs):
        Counting.ids_seen = 0  # the samples of this optimizer step only

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        seen = torch.tensor([float(Counting.ids_seen)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(seen)
        log_step(self.path, self.world, state.global_step, logs["loss"], float(seen), self.sleep)


def main() -> None:
    args = live_args()
    torch.set_num_threads(1)

    def train(world: unickpt.World) -> None:
        Counting.ids_seen = 0  # a step interrupted mid-way counted part of its batch
        targs = training_args("hf_out", args.steps, GLOBAL_BATCH // world.size)
        manager = unickpt.CheckpointManager(args.ckpt_dir, snapshot_every=1)
        Counting(model=tiny_llama(0.0), args=targs, train_dataset=Tokens(), manager=manager,
                       callbacks=[StepLog(args.log, world, args.sleep)]).train()

    run(train)


if __name__ == "__main__":
    main()
