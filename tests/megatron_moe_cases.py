"""Megatron-Core MoE experts saved by the real ``dist_checkpointing.save`` (torch_dist) on
gloo ranks, expert parallel: each rank builds Megatron-Core's own ``SequentialMLP`` (the
experts of an MoE layer, local linear layers, SwiGLU) on the CPU for its share of the
experts and hands its ``sharded_state_dict`` (the expert axis prepended with each local
expert's *global* id, SwiGLU's fc1 cut by ``apply_swiglu_sharded_factory``) to
``dist_checkpointing.save``. The live weights of every rank are dumped beside the
checkpoint as the ground truth (rank functions for ``run_ranks``: importable, module level).
"""

from __future__ import annotations

from typing import Any

import torch

LAYERS, EXPERTS, HIDDEN, FFN = 2, 4, 8, 6
PREFIX = "decoder.layers.mlp.experts."
PRELOAD = ["torch", "torch.distributed.checkpoint", "megatron.core.dist_checkpointing",
           "megatron.core.transformer.moe.experts", "unickpt", "megatron_moe_cases"]


def _experts(ep: int, ep_rank: int, seed: int, kind: str) -> tuple[list[Any], Any]:
    """One experts module per layer (``kind``: ``"sequential"`` -> ``SequentialMLP``,
    ``"grouped"`` -> the grouped-GEMM ``GroupedMLP``) holding this expert-parallel rank's
    experts, and the expert data-parallel group."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe import grouped_gemm_util
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.cuda.synchronize = lambda *a, **k: None  # Megatron-Core's writer syncs CUDA after staging
    torch.cuda.current_device = lambda: "cpu"
    world = dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    me = singles[dist.get_rank()]
    # expert parallel over every rank, or (ep = 1) every rank an expert-data-parallel replica
    ep_group, dp_group = (dist.group.WORLD, me) if ep == world else (me, dist.group.WORLD)
    pg = ProcessGroupCollection(ep=ep_group, expt_tp=me, expt_dp=dp_group, tp=me)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
                            moe_ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            use_cpu_initialization=True, expert_model_parallel_size=ep)
    torch.manual_seed(seed + 101 * ep_rank)
    if kind == "grouped":
        # the grouped_gemm CUDA kernels are not installed: GroupedMLP only checks for them
        # at construction; its parameters and sharded_state_dict (all that is used here, no
        # forward) need none
        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
        return [GroupedMLP(EXPERTS // ep, cfg, pg_collection=pg) for _ in range(LAYERS)], dp_group
    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return [SequentialMLP(EXPERTS // ep, cfg, subs, pg_collection=pg) for _ in range(LAYERS)], dp_group


def _sharded(layers: list[Any], group: Any, singleton: bool,
             moments: dict[int, torch.Tensor] | None = None) -> dict[str, Any]:
    """The layers' sharded state as Megatron-Core's ``TransformerBlock`` builds it: the
    layer axis prepended (``decoder.layers.`` keys), the experts' below it; with ``moments``
    (``{id(param): exp_avg}``) also each parameter's Adam moment as Megatron-Core's
    optimizers shard it (``make_sharded_optimizer_tensor``, ``optimizer.state.exp_avg.`` keys)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    out: dict[str, Any] = {}
    meta = {"singleton_local_shards": singleton, "dp_cp_group": group}
    for i, mlp in enumerate(layers):
        sd = mlp.sharded_state_dict(prefix=PREFIX, sharded_offsets=((0, i, LAYERS),), metadata=meta)
        out.update({f"layer{i}.{k}": v for k, v in sd.items() if not isinstance(v, ShardedObject)})
        for k, v in sd.items():
            if moments is not None and not isinstance(v, ShardedObject):
                out[f"optim.layer{i}.{k}"] = make_sharded_optimizer_tensor(v, moments[id(v.data)], "optimizer.state.exp_avg")
    return out


def _moments(layers: list[Any], seed: int) -> dict[int, torch.Tensor]:
    """An Adam ``exp_avg`` for every parameter of the layers (``{id(param): tensor}``)."""
    g = torch.Generator().manual_seed(seed)
    return {id(p): torch.randn(p.shape, generator=g) for mlp in layers for p in mlp.parameters()}


def live(layers: list[Any], ep_rank: int, moments: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``{"L.E.fc1"|"L.E.fc2": weight}`` of the live experts, keyed by their global expert id
    (``[out, in]`` as a linear layer's weight; GroupedMLP's ``weight1``/``weight2`` viewed per
    expert as its forward does, ``[in, out]``, transposed); with ``moments``, the parameters'
    moments viewed the same way."""
    per = layers[0].num_local_experts

    def of(p: torch.Tensor) -> torch.Tensor:
        return p if moments is None else moments[id(p)]

    out = {}
    for i, mlp in enumerate(layers):
        for j in range(per):
            g = ep_rank * per + j
            if hasattr(mlp, "local_experts"):
                fc1, fc2 = of(mlp.local_experts[j].linear_fc1.weight), of(mlp.local_experts[j].linear_fc2.weight)
            else:
                fc1 = of(mlp.weight1).view(per, HIDDEN, -1)[j].t()
                fc2 = of(mlp.weight2).view(per, -1, HIDDEN)[j].t()
            out[f"{i}.{g}.fc1"] = fc1.detach().contiguous().clone()
            out[f"{i}.{g}.fc2"] = fc2.detach().contiguous().clone()
    return out


def save(rank: int, world: int, path: str, kind: str, singleton: bool) -> None:
    """EP=``world``: Megatron-Core's save of the experts; the live weights to ``path``.live.R."""
    from megatron.core import dist_checkpointing

    layers, group = _experts(world, rank, 0, kind)
    moments = _moments(layers, 50 + rank)
    dist_checkpointing.save(_sharded(layers, group, singleton, moments), path)
    torch.save({**live(layers, rank), **{f"{k}.exp_avg": v for k, v in live(layers, rank, moments).items()}},
               f"{path}.live.{rank}")


def megatron_load(rank: int, world: int, path: str, kind: str, singleton: bool) -> None:
    """EP=1 (one process, every expert): Megatron-Core's own load into fresh layers."""
    from megatron.core import dist_checkpointing

    layers, group = _experts(1, 0, 7, kind)
    sharded = _sharded(layers, group, singleton)
    loaded = dist_checkpointing.load(sharded, path)
    for i, mlp in enumerate(layers):
        prefix = f"layer{i}.{PREFIX}"
        mlp.load_state_dict({k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}, strict=False)
    if rank == 0:
        torch.save(live(layers, 0), f"{path}.megatron_ep1")


KINDS = (("sequential", False), ("sequential", True), ("grouped", False))


def checkpoint_dir(root: str, kind: str, singleton: bool) -> str:
    """Where :func:`save_all` saves one kind."""
    return f"{root}/{kind}{'_singleton' if singleton else ''}"


def save_and_load_all(rank: int, world: int, root: str) -> None:
    """:func:`save` of every kind into ``root/<kind>[_singleton]``, then :func:`megatron_load`
    of each on every rank (each an EP=1 replica holding all experts; rank 0's result kept):
    one start of the ranks."""
    import torch.distributed as dist

    for kind, singleton in KINDS:
        save(rank, world, checkpoint_dir(root, kind, singleton), kind, singleton)
    dist.barrier()
    for kind, singleton in KINDS:
        megatron_load(rank, world, checkpoint_dir(root, kind, singleton), kind, singleton)
