"""Train a small Mixtral-shaped model with DeepSpeed MoE (expert parallel) on CPU (gloo):
the peer whose checkpoints tests/test_deepspeed_moe.py reads.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 4 \\
        tests/ds_moe_train.py --ep 2 --stage 2 --steps 3 --save-dir ckpt --truth truth

The model is unickpt's example Llama-style decoder (``unickpt.examples.model``) whose
feed-forward blocks are ``deepspeed.moe.layer.MoE`` layers of ``--experts`` SwiGLU experts
(``layers.N.feed_forward.deepspeed_moe.gate.wg.weight``,
``layers.N.feed_forward.deepspeed_moe.experts.deepspeed_experts.E.{w1,w2,w3}.weight``):
Mixtral's shape. Each expert starts from its own seed (its global id), so no two experts
are alike.

After ``engine.save_checkpoint`` each rank writes ``--truth/rank_R.pt``: taken from the
live training state, not from the checkpoint, keyed by *global* parameter name (a local
expert ``deepspeed_experts.l`` of expert-parallel rank ``r`` is global expert
``r * num_local_experts + l``, DeepSpeed's own numbering, read from its live groups):

* ``module``: every parameter the rank holds, whole (its module copy);
* ``fragments``: ``name -> key -> (start, tensor)``: the slice of the fp32 master weights
  (``fp32``) and of each optimizer moment that this rank's ZeRO partition holds, cut from the
  live optimizer's flat partition at the address DeepSpeed linked to the parameter;
* ``step``: the optimizer step; ``ep_rank``, ``num_local_experts``.
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

LOCAL_EXPERT = re.compile(r"(\.deepspeed_experts\.)(\d+)\.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree (ep_size)")
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer (global)")
    p.add_argument("--stage", type=int, default=1, choices=(1, 2), help="ZeRO stage")
    p.add_argument("--bf16", action="store_true", help="bf16 module with fp32 master weights")
    p.add_argument("--data-first", action="store_true",
                   help="DeepSpeed's use_data_before_expert_parallelism (expert-data-parallel groups of consecutive ranks)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--truth", required=True, help="directory for each rank's ground truth")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=8)
    return p.parse_args(argv)


def build_model(args: argparse.Namespace):
    """The example decoder with DeepSpeed MoE feed-forward blocks (experts seeded by global id)."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    from unickpt.examples.model import FeedForward, ModelArgs, Transformer

    class MoEFeedForward(MoE):
        """``MoE`` returning only its output; the load-balancing loss is kept in ``aux``."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            out, self.aux, _ = super().forward(x)
            return out

    # what deepspeed.initialize does, done first: the seeds need the expert-parallel ranks
    groups._create_expert_and_data_parallel(args.ep, use_data_before_expert_parallel_=args.data_first)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(args.dim, args.layers, 4, 2, args.vocab, args.seq))
    for block in model.layers.values():
        block.feed_forward = MoEFeedForward(hidden_size=args.dim, expert=FeedForward(args.dim, 2 * args.dim),
                                            num_experts=args.experts, ep_size=args.ep, k=2, min_capacity=64)
    for layer, block in model.layers.items():
        moe = block.feed_forward
        ep_rank = groups._get_expert_parallel_rank(moe.expert_group_name)
        for local, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(1000 * (int(layer) + 1) + ep_rank * moe.num_local_experts + local)
            for p in expert.parameters():
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def global_name(name: str, ep_rank: int, num_local: int) -> str:
    """DeepSpeed's global name of a parameter (local expert ids renumbered over ep)."""
    return LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}.", name)


def ground_truth(engine, model, ep_rank: int, num_local: int) -> dict:
    """Each parameter's module copy and this rank's slices of its fp32 master weights and
    optimizer moments, from the live ZeRO optimizer."""
    opt = engine.optimizer
    module, fragments, step = {}, {}, None
    for name, p in model.named_parameters():
        g = global_name(name, ep_rank, num_local)
        module[g] = p.detach().clone()
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            continue
        flat = opt.single_partition_of_fp32_groups[mapping.param_group_index]
        at, n = mapping.hp_fragment_address.start, mapping.hp_fragment_address.numel
        start = mapping.lp_fragment_address.start
        state = opt.optimizer.state[flat]
        fragments[g] = {"fp32": (start, flat.detach().narrow(0, at, n).clone())}
        for key in ("exp_avg", "exp_avg_sq"):
            fragments[g][key] = (start, state[key].narrow(0, at, n).clone())
        step = state["step"]
    return {"module": module, "fragments": fragments, "step": step, "ep_rank": ep_rank, "num_local_experts": num_local}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups

    from ds_job import init_gloo
    from unickpt.examples.data import MarkovTokens, ReshardableLoader

    deepspeed = init_gloo()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args)
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    optimizer = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    config = {
        "train_batch_size": args.global_batch, "train_micro_batch_size_per_gpu": args.global_batch // world,
        "gradient_accumulation_steps": 1, "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 10**9,
        "use_data_before_expert_parallelism": args.data_first, "bf16": {"enabled": args.bf16},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    data = MarkovTokens(64, args.seq, args.vocab, 0)
    loader = ReshardableLoader(data, args.global_batch, rank, world, 0)
    for _ in range(args.steps):
        x, y = loader.next_batch()
        out = engine(x)
        aux = sum(block.feed_forward.aux for block in model.layers.values())
        engine.backward(F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)) + 0.01 * aux)
        engine.step()
    engine.save_checkpoint(args.save_dir)
    moe = next(iter(model.layers.values())).feed_forward
    ep_rank = groups._get_expert_parallel_rank(moe.expert_group_name)
    os.makedirs(args.truth, exist_ok=True)
    torch.save(ground_truth(engine, model, ep_rank, moe.num_local_experts), os.path.join(args.truth, f"rank_{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from ds_job import leave_without_finalizing

    leave_without_finalizing()
