"""Train unickpt's example model with DeepSpeed ZeRO on CPU (gloo): the peer whose
checkpoints tests/test_deepspeed.py reads, converts and resumes.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 4 \\
        tests/ds_train.py --stage 2 --steps 8 --save-dir ckpt --save-at 4 --loss-log losses.json
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 \\
        tests/ds_train.py --stage 2 --steps 8 --load-dir ckpt --load-universal --loss-log resumed.json

The model, data and learning-rate schedule are those of ``unickpt.examples.train`` (same
parameter names, a data loader whose global batch does not depend on the data-parallel
degree, a torch AdamW), so a checkpoint of one trains on in the other. Data position and
learning rate are functions of the step: a resumed job needs only the step DeepSpeed
restores. Rank 0 writes ``[{"step": s, "loss": l}, ...]`` (loss averaged over the global
batch) to ``--loss-log``.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--steps", type=int, default=4, help="train until this step (total, also the lr horizon)")
    p.add_argument("--horizon", type=int, default=8, help="steps of the learning-rate schedule")
    p.add_argument("--save-dir", default=None, help="engine.save_checkpoint here (tag global_stepN)")
    p.add_argument("--save-at", type=int, nargs="*", default=None, help="steps to save after (default: the last)")
    p.add_argument("--load-dir", default=None, help="resume from this DeepSpeed checkpoint directory")
    p.add_argument("--load-universal", action="store_true", help="resume with checkpoint.load_universal")
    p.add_argument("--loss-log", default=None, help="rank 0 writes the losses of this run as JSON here")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--dataset-size", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 module with fp32 master weights")
    p.add_argument("--freeze", nargs="*", default=[], help="parameters made requires_grad=False (frozen)")
    p.add_argument("--frozen-extra", action="store_true",
                   help="add a frozen parameter `frozen_table` of 7x3 elements (unused by forward; odd size: ZeRO-3 pads it)")
    p.add_argument("--megatron-client-state", action="store_true",
                   help="save with the client_state Megatron-DeepSpeed passes (args, iteration, tokens, rng_state...)")
    p.add_argument("--bucket", type=int, default=2000,
                   help="ZeRO bucket sizes in elements (small: several buckets even for a tiny model)")
    return p.parse_args(argv)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """The example trainer's schedule (linear warm-up, cosine decay) over ``--horizon`` steps."""
    from unickpt.examples.train import learning_rate as lr

    return lr(step, argparse.Namespace(lr=args.lr, steps=args.horizon))


def megatron_client_state(args: argparse.Namespace, step: int) -> dict:
    """The ``client_state`` Megatron-DeepSpeed's ``save_checkpoint`` hands to
    ``engine.save_checkpoint`` (megatron/checkpointing.py): its ``args`` (a Namespace holding
    megatron-core enums and torch dtypes), ``checkpoint_version``, ``iteration``, ``tokens``,
    ``checkpoint_info``, ``universal_checkpoint_info`` and ``rng_state``, the list of
    ``get_rng_state()`` dicts (Python, NumPy, torch and accelerator generators, the
    model-parallel tracker's states), made with DeepSpeed's accelerator as it does."""
    import random

    import numpy as np
    from deepspeed.accelerator import get_accelerator
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    margs = argparse.Namespace(
        num_layers=args.layers, hidden_size=args.dim, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        padded_vocab_size=args.vocab, seq_length=args.seq, global_batch_size=args.global_batch, lr=args.lr,
        bf16=args.bf16, fp16=False, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto, deepspeed=True,
        zero_stage=args.stage, data_path=["/data/corpus_text_document"], iteration=step,
        consumed_train_samples=step * args.global_batch, consumed_train_tokens=step * args.global_batch * args.seq,
    )
    accelerator = get_accelerator()
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": accelerator.get_rng_state(),
           "rng_tracker_states": {"model-parallel-rng": accelerator.get_rng_state()}}
    return {"args": margs, "checkpoint_version": 3.0, "iteration": step, "tokens": margs.consumed_train_tokens,
            "checkpoint_info": {"padded_vocab_size": args.vocab, "original_vocab_size": args.vocab},
            "universal_checkpoint_info": {"universal_checkpoint_version": 0.2, "original_vocab_size": args.vocab,
                                          "padded_vocab_size": args.vocab},
            "rng_state": [rng]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch.distributed as dist

    from ds_job import init_gloo
    from unickpt.examples.data import MarkovTokens, ReshardableLoader
    from unickpt.examples.model import ModelArgs, Transformer

    deepspeed = init_gloo()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = Transformer(ModelArgs(args.dim, args.layers, args.heads, args.kv_heads, args.vocab, args.seq))
    if args.frozen_extra:
        model.frozen_table = torch.nn.Parameter(torch.randn(7, 3), requires_grad=False)
    for name, param in model.named_parameters():
        if name in args.freeze:
            param.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if args.global_batch % world:
        raise SystemExit(f"global batch {args.global_batch} does not split over {world} ranks")
    zero: dict = {"stage": args.stage}
    if args.stage in (1, 2):
        zero.update(reduce_bucket_size=args.bucket, allgather_bucket_size=args.bucket)
    if args.stage == 3:
        zero.update(reduce_bucket_size=args.bucket, stage3_prefetch_bucket_size=0, stage3_param_persistence_threshold=0)
    config = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.global_batch // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": args.bf16},
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; the torch-native trainer does not clip
        "checkpoint": {"load_universal": args.load_universal},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    start = 0
    if args.load_dir:
        path, _ = engine.load_checkpoint(args.load_dir, load_optimizer_states=True, load_lr_scheduler_states=False,
                                         load_module_only=False)
        if path is None:
            raise SystemExit(f"no checkpoint loaded from {args.load_dir}")
        start = engine.global_steps
    data = MarkovTokens(args.dataset_size, args.seq, args.vocab, args.seed)
    loader = ReshardableLoader(data, args.global_batch, rank, world, args.seed)
    for _ in range(start):  # data position is a function of the step
        loader.global_indices()
    losses = []
    for step in range(start + 1, args.steps + 1):
        x, y = loader.next_batch()
        for group in engine.optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        out = engine(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append({"step": step, "loss": float(mean / world)})
        if args.save_dir and step in (args.save_at if args.save_at is not None else [args.steps]):
            client = megatron_client_state(args, step) if args.megatron_client_state else {}
            engine.save_checkpoint(args.save_dir, client_state=client)
    if rank == 0 and args.loss_log:
        with open(args.loss_log, "w") as f:
            json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from ds_job import leave_without_finalizing

    leave_without_finalizing()
