"""The universal checkpoint language: rules (parameter-name pattern -> sharding scheme)
that describe state carrying no placement of its own — Megatron-style tensor-parallel
slices, fused sub-parameters, vocabulary padding, pipeline stages, experts, ZeRO flat
partitions — so ``unickpt.save`` and ``unickpt.load`` reshard it onto any layout.

    from unickpt.rules import Coords, apply_rules, optimizer_state, ZeroPlan, presets

    rules = presets.megatron_gpt(vocab_size=32000, num_layers=32, heads=32, kv_heads=8,
                                 head_dim=128, ffn_hidden=11008)
    coords = Coords(tp=4, tp_rank=t, pp=2, pp_rank=p, dp=8, dp_rank=d)
    zero = ZeroPlan(rules, coords, dict(model.named_parameters()), stage=1)
    state = {
        "model": apply_rules(model.state_dict(), rules, coords, "save"),
        "optim": {"state": zero.state({"fp32": [fp32_flat], "exp_avg": [m], "exp_avg_sq": [v]}, "save")},
    }
    unickpt.save(state, path, metadata={"layout": rules.metadata(coords, zero=zero.describe())})

Loading is the same with ``"load"`` and the *target* job's coordinates, tensors and
partitions: they are filled in place.
"""

from . import presets
from .coords import Coords, split_range, split_sizes
from .language import Renumber, Rule, RuledTensor, Rules, apply_rules, optimizer_state
from .replicas import reconcile, reconcile_ranks
from .schemes import (
    Averaged,
    Fused,
    Partitioned,
    Replicated,
    Scheme,
    Target,
    VocabPadded,
    averaged,
    column,
    experts,
    fused,
    partitioned,
    replicated,
    row,
    scheme_from_json,
    vocab,
)
from .zero import ZeroPlan, compose_flat, group_partition, param_partition

__all__ = [
    "Coords", "split_range", "split_sizes", "Renumber", "Rule", "Rules", "RuledTensor", "apply_rules",
    "optimizer_state", "reconcile", "reconcile_ranks", "Scheme", "Target", "Replicated", "Averaged",
    "Partitioned", "VocabPadded", "Fused", "replicated", "averaged", "partitioned", "column", "row", "vocab",
    "fused", "experts", "scheme_from_json", "ZeroPlan", "compose_flat", "group_partition", "param_partition",
    "presets",
]
