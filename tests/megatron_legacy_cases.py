"""Legacy Megatron-LM checkpoints (``--ckpt-format torch``) built here as Megatron-LM writes
them, since Megatron-LM itself is not installable (it needs CUDA and Apex).

Followed (NVIDIA/Megatron-LM, ``megatron/training/checkpointing.py`` of 2025-2026, the
same layout since Megatron-LM 2.x): ``get_checkpoint_name`` (``iter_{:07d}`` or
``release``, then ``mp_rank_{tp:02d}`` or ``mp_rank_{tp:02d}_{pp:03d}`` with pipeline
parallelism, one ``model_optim_rng.pt``), ``save_checkpoint`` writing the tracker file
``latest_checkpointed_iteration.txt`` (the iteration, or ``release``),
``generate_state_dict`` (``args`` - an ``argparse.Namespace`` -, ``checkpoint_version``
3.0, ``iteration``, ``model``, ``optimizer``, ``opt_param_scheduler``, ``rng_state`` - a
list of one dict from ``get_rng_state`` -, ``num_floating_point_operations_so_far``).
``model`` is the rank's ``state_dict_for_save_checkpoint()``: nested dicts for the legacy
``GPTModel`` (``language_model`` -> ``embedding`` -> ``word_embeddings``, ``encoder`` ->
``layers.I....``, ``output_layer``), a flat dict for Megatron-Core's ``GPTModel``
(local layer spec: ``input_layernorm``, ``pre_mlp_layernorm``). Tensor-parallel cuts as
Megatron's layers make them: ``VocabParallelEmbedding`` rows of the padded vocabulary,
``ColumnParallelLinear`` QKV in per-query-group order ``[q heads of group g; k_g; v_g]``
(``checkpoint_version`` 3.0), fused SwiGLU fc1 ``[gate_t; up_t]``, ``RowParallelLinear``
on dim 1; layer names stage-local. The model's parameters carry Megatron's tensor-parallel
attributes (megatron-core's own ``set_tensor_model_parallel_attributes`` on the parallel
layers, ``set_defaults_if_not_set_tensor_model_parallel_attributes`` on the rest, as
``get_model`` does; ``shared`` on tied embeddings).

``optimizer`` is, for a bf16 run (``args.bf16``), megatron-core's own
``Float16OptimizerWithFloat16Params.state_dict()``: the inner torch optimizer's
``state_dict()`` (groups built as ``_get_param_groups`` does: weight-decayed parameters, then
biases and 1-d ones, with ``wd_mult``), no ``grad_scaler`` (bf16 without ``--loss-scale``),
and ``fp32_from_fp16_params``: the fp32 main params per group, each carrying the attributes
``copy_tensor_model_parallel_attributes`` (and ``shared``) copied from its bf16 parameter, so
``torch.save`` pickles them through ``torch._tensor._rebuild_from_type_v2`` with
``torch.Tensor`` as Megatron's real checkpoints do. For an fp32 run it is
``FP32Optimizer.state_dict()``: the torch optimizer's state dict alone. The optimizer
classes are megatron-core's, called on an instance holding the fields their ``state_dict``
reads: their ``__init__`` accepts CUDA parameters only. ``opt_param_scheduler`` is a real
``OptimizerParamScheduler``'s state dict after the run's steps.

The ground truth is independent of unickpt: the global model (bf16 weights and fp32 masters),
a global torch ``AdamW`` step on the masters, and Megatron's cuts of them; each rank's
optimizer state comes from its own live ``AdamW`` step on its cut.
"""

from __future__ import annotations

import argparse
import io
import os
import random
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Cfg:
    """A small Llama-shaped GPT and the layout it was saved at."""

    layers: int = 4
    hidden: int = 8
    heads: int = 4
    groups: int = 2
    head_dim: int = 2
    ffn: int = 12
    vocab: int = 30
    divisible: int = 8  # make_vocab_size_divisible_by
    tp: int = 2
    pp: int = 2
    naming: str = "legacy"
    iteration: int = 7
    release: bool = False
    optimizer: bool = True
    tied: bool = False  # the output layer reuses the word embeddings
    precision: str = "bf16"  # "bf16": bf16 weights, fp32 main params in the optimizer; "fp32": fp32 weights only

    @property
    def padded(self) -> int:
        """Megatron's ``_vocab_size_with_padding``: a multiple of divisible * tp."""
        m = self.divisible * self.tp
        return -(-self.vocab // m) * m

    def at(self, tp: int, pp: int) -> "Cfg":
        """The same model at another layout (same padded vocabulary when it still divides)."""
        return replace(self, tp=tp, pp=pp)


def _names(cfg: Cfg) -> dict[str, str]:
    """Global tensor names of one layer (``{L}`` the layer) and the others, for the naming."""
    if cfg.naming == "legacy":
        e = "language_model.encoder."
        return {
            "embed": "language_model.embedding.word_embeddings.weight", "final": e + "final_layernorm.weight",
            "output": "language_model.output_layer.weight", "ln1": e + "layers.{L}.input_layernorm.weight",
            "qkv": e + "layers.{L}.self_attention.query_key_value.weight", "proj": e + "layers.{L}.self_attention.dense.weight",
            "ln2": e + "layers.{L}.post_attention_layernorm.weight", "fc1": e + "layers.{L}.mlp.dense_h_to_4h.weight",
            "fc2": e + "layers.{L}.mlp.dense_4h_to_h.weight",
        }
    d = "decoder."
    return {
        "embed": "embedding.word_embeddings.weight", "final": d + "final_layernorm.weight", "output": "output_layer.weight",
        "ln1": d + "layers.{L}.input_layernorm.weight", "qkv": d + "layers.{L}.self_attention.linear_qkv.weight",
        "proj": d + "layers.{L}.self_attention.linear_proj.weight", "ln2": d + "layers.{L}.pre_mlp_layernorm.weight",
        "fc1": d + "layers.{L}.mlp.linear_fc1.weight", "fc2": d + "layers.{L}.mlp.linear_fc2.weight",
    }


LAYER_KEYS = ("ln1", "qkv", "proj", "ln2", "fc1", "fc2")


def global_masters(cfg: Cfg, seed: int = 5) -> dict[str, torch.Tensor]:
    """The global fp32 master weights (Megatron's global forms: interleaved QKV, fused
    ``[gate; up]`` fc1, padded vocabulary), in model order."""
    g = torch.Generator().manual_seed(seed)
    n, h, d = _names(cfg), cfg.hidden, cfg.head_dim
    qkv_rows = (cfg.heads + 2 * cfg.groups) * d
    out = {n["embed"]: torch.randn(cfg.padded, h, generator=g)}
    for L in range(cfg.layers):
        shapes = {"ln1": (h,), "qkv": (qkv_rows, h), "proj": (h, cfg.heads * d), "ln2": (h,), "fc1": (2 * cfg.ffn, h),
                  "fc2": (h, cfg.ffn)}
        for k in LAYER_KEYS:
            out[n[k].format(L=L)] = torch.randn(*shapes[k], generator=g)
    out[n["final"]] = torch.randn(h, generator=g)
    if not cfg.tied:
        out[n["output"]] = torch.randn(cfg.padded, h, generator=g)
    return out


def global_grads(masters: dict[str, torch.Tensor], seed: int = 9) -> dict[str, torch.Tensor]:
    """One step's gradients of the global parameters."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in masters.items()}


def _kind(name: str) -> str:
    for k, pattern in (("embed", "word_embeddings"), ("output", "output_layer"), ("qkv", "query_key_value"),
                       ("qkv", "linear_qkv"), ("proj", "dense.weight"), ("proj", "linear_proj"), ("fc1", "dense_h_to_4h"),
                       ("fc1", "linear_fc1"), ("fc2", "dense_4h_to_h"), ("fc2", "linear_fc2")):
        if pattern in name:
            return k
    return "norm"


def cut(cfg: Cfg, name: str, t: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s slice of global tensor ``name``, as Megatron's layer holds it."""
    kind, tp = _kind(name), cfg.tp
    if kind in ("embed", "output"):
        c = t.shape[0] // tp
        return t[tp_rank * c:(tp_rank + 1) * c].clone()
    if kind == "qkv":  # whole query groups: the interleaved global tensor cut on rows
        return t.chunk(tp, 0)[tp_rank].clone()
    if kind == "fc1":
        gate, up = t.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]])
    if kind in ("proj", "fc2"):
        return t.chunk(tp, 1)[tp_rank].clone()
    return t.clone()


def stage_names(cfg: Cfg, pp_rank: int) -> list[tuple[str, str]]:
    """``(global name, stage-local name)`` of the parameters of pipeline stage ``pp_rank``, in model order."""
    n = _names(cfg)
    per = cfg.layers // cfg.pp
    out = []
    if pp_rank == 0:
        out.append((n["embed"], n["embed"]))
    for i in range(per):
        for k in LAYER_KEYS:
            out.append((n[k].format(L=pp_rank * per + i), n[k].format(L=i)))
    if pp_rank == cfg.pp - 1:
        out.append((n["final"], n["final"]))
        if not cfg.tied:
            out.append((n["output"], n["output"]))
        elif cfg.pp > 1:  # the last stage's copy of the tied embeddings (Megatron's initialize_word_embeddings)
            out.append((n["embed"], "word_embeddings_for_head.weight" if cfg.naming == "legacy" else "output_layer.weight"))
    return out


def rank_params(cfg: Cfg, tensors: dict[str, torch.Tensor], tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """``{stage-local name: local tensor}`` of one rank, in model order."""
    return {local: cut(cfg, g, tensors[g], tp_rank) for g, local in stage_names(cfg, pp_rank)}


def _nested(flat: dict[str, Any], naming: str) -> dict[str, Any]:
    """The legacy ``state_dict_for_save_checkpoint`` nesting of flat names."""
    if naming != "legacy":
        return dict(flat)
    out: dict[str, Any] = {}
    for k, v in flat.items():
        if k == "word_embeddings_for_head.weight":
            out["word_embeddings_for_head"] = {"weight": v}
            continue
        lm = k[len("language_model."):]
        if lm.startswith("embedding.word_embeddings."):
            out.setdefault("language_model", {}).setdefault("embedding", {}).setdefault("word_embeddings", {})[lm.rsplit(".", 1)[1]] = v
        elif lm.startswith("encoder."):
            out.setdefault("language_model", {}).setdefault("encoder", {})[lm[len("encoder."):]] = v
        elif lm.startswith("output_layer."):
            out.setdefault("language_model", {}).setdefault("output_layer", {})[lm.rsplit(".", 1)[1]] = v
        else:
            raise KeyError(k)
    return out


def _parallel_dim(name: str) -> int | None:
    """The dim Megatron's layer cuts ``name`` on (``partition_dim``), None for a replicated tensor."""
    kind = _kind(name)
    return 0 if kind in ("embed", "output", "qkv", "fc1") else 1 if kind in ("proj", "fc2") else None


def megatron_params(cfg: Cfg, local: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.nn.Parameter]:
    """The rank's model parameters (``{local name: Parameter}`` in ``cfg``'s dtype) with the
    attributes Megatron's layers and ``get_model`` give them (``names``: local -> global name)."""
    from megatron.core.tensor_parallel.layers import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
    )

    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    out = {}
    for k, v in local.items():
        p = out[k] = torch.nn.Parameter(v.detach().to(dtype))
        dim = _parallel_dim(names[k])
        if dim is not None:
            set_tensor_model_parallel_attributes(p, is_parallel=True, dim=dim, stride=1)
        set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        if cfg.tied and cfg.pp > 1 and _kind(names[k]) == "embed":  # initialize_word_embeddings
            p.shared = True
    return out


def main_params(params: dict[str, torch.nn.Parameter], masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 main params of Float16OptimizerWithFloat16Params (holding ``masters``' values):
    plain tensors carrying their parameter's tensor-parallel attributes, as its ``__init__``
    makes them."""
    from megatron.core.tensor_parallel.layers import copy_tensor_model_parallel_attributes

    out = {}
    for k, p in params.items():
        main = out[k] = masters[k].detach().clone().float()
        copy_tensor_model_parallel_attributes(main, p)
        if hasattr(p, "shared"):
            main.shared = p.shared
    return out


def optimizer_state(cfg: Cfg, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What megatron-core's ``Float16OptimizerWithFloat16Params.state_dict()`` (bf16: no loss
    scaler, ``fp32_from_fp16_params`` the main params per group) or ``FP32Optimizer.state_dict()``
    returns for the torch optimizer ``opt``."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    if cfg.precision == "bf16":
        mixed = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
        mixed.optimizer, mixed.grad_scaler = opt, None
        mixed.fp32_from_float16_groups = [list(g["params"]) for g in opt.param_groups]
        return mixed.state_dict()
    plain = FP32Optimizer.__new__(FP32Optimizer)
    plain.optimizer = opt
    return plain.state_dict()


def scheduler_state(cfg: Cfg, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """megatron-core's ``OptimizerParamScheduler.state_dict()`` after the run's steps."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    lrs = [g["lr"] for g in opt.param_groups]
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_steps=100,
                                    lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=100,
                                    wd_incr_style="constant")
    sched.step(cfg.iteration)
    for g, lr in zip(opt.param_groups, lrs):  # the state dict is what matters: leave the step's lr as it was
        g["lr"] = lr
    return sched.state_dict()


def _no_wd(local: str, t: torch.Tensor) -> bool:
    return local.endswith(".bias") or t.ndim == 1


def _adamw(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> torch.optim.AdamW:
    """One AdamW step on ``params`` (fp32 masters, updated in place) with groups as
    Megatron's ``_get_param_groups`` builds them (insertion order of their keys)."""
    groups: dict[float, list[torch.Tensor]] = {}
    for local, p in params.items():
        p.grad = grads[local]
        groups.setdefault(0.0 if _no_wd(local, p) else 1.0, []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "wd_mult": m, "lr_mult": 1.0, "weight_decay": 0.1 * m,
                              "is_expert_parallel": False, "default_config": True, "is_decoupled_lr": False}
                             for m, ps in groups.items()], lr=1e-2, betas=(0.9, 0.95), foreach=False)
    opt.step()
    return opt


def args_of(cfg: Cfg) -> argparse.Namespace:
    """Megatron-LM's args as a training run would save them: sizes, parallelism, megatron-core
    enums (``attention_backend``, ``model_type``) and torch dtypes (``params_dtype`` and the
    optimizer's ``main_grads_dtype``... as ``validate_args`` sets them)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    bf16 = cfg.precision == "bf16"
    return argparse.Namespace(
        num_layers=cfg.layers, hidden_size=cfg.hidden, ffn_hidden_size=cfg.ffn, num_attention_heads=cfg.heads,
        group_query_attention=cfg.groups != cfg.heads, num_query_groups=cfg.groups, kv_channels=cfg.head_dim,
        swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
        untie_embeddings_and_output_weights=not cfg.tied, padded_vocab_size=cfg.padded, make_vocab_size_divisible_by=cfg.divisible,
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp, virtual_pipeline_model_parallel_size=None,
        max_position_embeddings=64, seq_length=16, rotary_base=10000, norm_epsilon=1e-5, weight_decay=0.1, lr=1e-2,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16, fp16=False, loss_scale=None,
        attention_backend=AttnBackend.auto, model_type=ModelType.encoder_or_decoder, main_grads_dtype=torch.float32,
        main_params_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
        use_distributed_optimizer=False, ckpt_format="torch", tokenizer_type="NullTokenizer", iteration=cfg.iteration,
        data_path=["/data/corpus_text_document"], rampup_batch_size=None, cp_comm_type=["p2p"], transformer_impl="local",
        consumed_train_samples=cfg.iteration * 8, lr_decay_style="cosine", rerun_mode="disabled",
    )


def truth(cfg: Cfg) -> dict[str, dict[str, torch.Tensor]]:
    """The global state after one step, from a live global AdamW (no unickpt): ``masters``
    (fp32), ``model`` (bf16), ``exp_avg``, ``exp_avg_sq``, ``step``, keyed by global name."""
    masters = global_masters(cfg)
    grads = global_grads(masters)
    opt = _adamw(masters, grads)
    st = opt.state
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    return {"masters": {k: v.detach().clone() for k, v in masters.items()},
            "model": {k: v.detach().to(dtype) for k, v in masters.items()},
            "exp_avg": {k: st[v]["exp_avg"] for k, v in masters.items()},
            "exp_avg_sq": {k: st[v]["exp_avg_sq"] for k, v in masters.items()},
            "step": {k: st[v]["step"] for k, v in masters.items()}}


def write(cfg: Cfg, root: str) -> str:
    """Write the checkpoint of ``cfg`` under ``root`` as Megatron-LM's ``save_checkpoint``
    does; returns ``root``."""
    masters0 = global_masters(cfg)
    grads = global_grads(masters0)
    tag = "release" if cfg.release else f"iter_{cfg.iteration:07d}"
    random.seed(1)
    np.random.seed(1)
    for p in range(cfg.pp):
        for t in range(cfg.tp):
            names = {local: g for g, local in stage_names(cfg, p)}
            local = {k: v.clone() for k, v in rank_params(cfg, masters0, t, p).items()}
            params = megatron_params(cfg, local, names)
            opt = None
            if cfg.optimizer:
                # the optimizer steps on the fp32 main params (bf16) or on the fp32 parameters themselves
                mains = main_params(params, local) if cfg.precision == "bf16" else params
                opt = _adamw(mains, rank_params(cfg, grads, t, p))
                for k, param in params.items():  # _copy_main_params_to_model_params
                    param.data.copy_(mains[k].detach())
            # generate_state_dict's keys, in its order; state_dict_for_save_checkpoint detaches the
            # parameters (their attributes stay behind)
            sd: dict[str, Any] = {"args": args_of(cfg), "checkpoint_version": 3.0, "iteration": cfg.iteration,
                                  "model": _nested({k: v.detach() for k, v in params.items()}, cfg.naming)}
            if opt is not None:
                sd["optimizer"] = optimizer_state(cfg, opt)
                sd["opt_param_scheduler"] = scheduler_state(cfg, opt)
            if cfg.naming == "mcore":  # TransformerEngine layers' extra state, as older TE versions return it
                for i in range(cfg.layers // cfg.pp):
                    sd["model"][f"decoder.layers.{i}.self_attention.linear_qkv._extra_state"] = io.BytesIO()
            # get_rng_state's dict (one data-parallel rank's); the CUDA generator's state is a CPU
            # ByteTensor like torch's own, which stands for it here
            sd["rng_state"] = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
                                "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}]
            sd["num_floating_point_operations_so_far"] = 1.25e12
            d = f"mp_rank_{t:02d}" if cfg.pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            os.makedirs(os.path.join(root, tag, d), exist_ok=True)
            torch.save(sd, os.path.join(root, tag, d, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release" if cfg.release else str(cfg.iteration))
    return root
