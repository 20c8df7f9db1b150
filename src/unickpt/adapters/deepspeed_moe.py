"""Where the experts of a DeepSpeed MoE (expert-parallel) checkpoint live.

DeepSpeed's ``MoE`` layer (``deepspeed.moe.layer``) keeps ``num_experts / ep_size`` *local*
experts per rank, named ``<layer>.deepspeed_moe.experts.deepspeed_experts.<local>.<param>``
on every rank alike. ``engine.save_checkpoint`` (``_save_moe_checkpoint``) writes:

* ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt``: the module copy of global expert
  ``E`` of the ``L``-th MoE layer (in ``named_modules`` order), its keys renamed to the
  global id ``E = ep_rank * num_local_experts + local``;
* ``mp_rank_00_model_states.pt``: everything else (gates included), ``num_experts`` (one
  count per MoE layer) and rank 0's ``param_shapes`` (local names);
* one ``zero_pp_rank_<R>_mp_rank_00_optim_states.pt`` per rank (ZeRO-1/2): per parameter
  group a flat fp32 partition and its moments. A group flagged ``moe`` (named
  ``ep_size_<N>``) holds only the rank's local experts, partitioned over the
  *expert-data-parallel* group (``partition_count`` = world / ep), its
  ``param_slice_mappings`` in local names;
* ``expp_rank_<R>_mp_rank_00_optim_states.pt`` (older DeepSpeed, or no ZeRO): the expert
  optimizer state outside ZeRO.

The rank layout is DeepSpeed's (``deepspeed.utils.groups._create_expert_and_data_parallel``,
no model or pipeline parallelism): by default expert-parallel groups are consecutive ranks,
so rank ``R`` is expert-parallel rank ``R % ep`` and expert-data-parallel rank ``R // ep``;
with ``use_data_before_expert_parallelism`` the expert-data-parallel groups are
consecutive: expert-parallel rank ``R // (world / ep)``, expert-data-parallel rank
``R % (world / ep)``. Either way, the ranks holding one expert, in numeric order, hold its
partitions in order.

:class:`ExpertLayout` turns a rank's local parameter name into the global one. It never
joins two ranks' local expert 0 as slices of one tensor (what ``ds_to_universal`` does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptionError, LayoutError

EXPERT_MARK = ".deepspeed_moe.experts.deepspeed_experts."
_LOCAL = re.compile(re.escape(EXPERT_MARK) + r"(\d+)\.")
_GROUP_NAME = re.compile(r"^ep_size_(\d+)$")


def expert_prefix(name: str) -> tuple[str, int] | None:
    """``(MoE layer prefix, expert index)`` of an expert parameter's name, else None."""
    m = _LOCAL.search(name)
    return None if m is None else (name[: m.start()], int(m.group(1)))


@dataclass
class ExpertLayout:
    """The expert placement of a DeepSpeed MoE checkpoint of ``world`` ranks.

    ``ep``: expert-parallel degree of each ``moe`` parameter group (by group index);
    ``experts``: global expert count of each MoE layer (by its name prefix);
    ``data_first``: DeepSpeed's ``use_data_before_expert_parallelism``."""

    world: int
    ep: dict[int, int]
    experts: dict[str, int]
    data_first: bool = False
    layer_ids: dict[str, int] = field(default_factory=dict)

    def ep_rank(self, rank: int, group: int) -> int:
        """Expert-parallel rank of ``rank`` for the experts of parameter group ``group``."""
        ep = self.ep[group]
        return rank // (self.world // ep) if self.data_first else rank % ep

    def global_name(self, rank: int, group: int, name: str, where: str) -> str:
        """The global name of parameter ``name`` of group ``group`` as rank ``rank`` holds it
        (unchanged outside ``moe`` groups)."""
        if group not in self.ep:
            return name
        found = expert_prefix(name)
        if found is None:
            raise CorruptionError(f"{where}: parameter {name!r} of an expert (moe) group is not named as a DeepSpeed expert "
                                  f"('...{EXPERT_MARK}<i>...')")
        prefix, local = found
        total = self.experts.get(prefix)
        if total is None:
            raise CorruptionError(f"{where}: expert parameter {name!r} of MoE layer {prefix!r}, which has no "
                                  "layer_<L>_expert_<E>_mp_rank_00_model_states.pt files")
        ep = self.ep[group]
        if total % ep:
            raise CorruptionError(f"{where}: MoE layer {prefix!r} has {total} expert files, not a multiple of its "
                                  f"expert-parallel degree {ep}")
        num_local = total // ep
        if local >= num_local:
            raise CorruptionError(f"{where}: local expert {local} of {prefix!r}, but each of the {ep} expert-parallel "
                                  f"ranks holds {num_local}")
        return _LOCAL.sub(f"{EXPERT_MARK}{self.ep_rank(rank, group) * num_local + local}.", name, count=1)

    def describe(self) -> dict[str, Any]:
        """A plain description for the manifest's provenance."""
        return {"expert_parallel": sorted(set(self.ep.values())), "world_size": self.world,
                "data_before_expert_parallel": self.data_first,
                "layers": {p: {"moe_layer_id": self.layer_ids.get(p), "num_experts": n} for p, n in sorted(self.experts.items())}}


def expert_layout(tag_dir: str, world: int, param_groups: Any, partition_count: Any, files: dict[str, list[str]],
                  num_experts: Any, ds_config: Any) -> ExpertLayout:
    """The layout from rank 0's optimizer file (``param_groups`` of the base optimizer,
    ``partition_count``), the expert model files' keys (``files``: file name -> keys),
    ``num_experts`` and ``ds_config`` of ``mp_rank_00_model_states.pt``."""
    groups = param_groups if isinstance(param_groups, list) else []
    counts = partition_count if isinstance(partition_count, list) else [partition_count] * len(groups)
    ep: dict[int, int] = {}
    for g, group in enumerate(groups):
        if not (isinstance(group, dict) and group.get("moe")):
            continue
        count = counts[g] if g < len(counts) else None
        if not isinstance(count, int) or count <= 0 or world % count:
            raise CorruptionError(f"{tag_dir}: expert group {g} has partition count {count!r} for {world} ranks")
        ep[g] = world // count
        named = _GROUP_NAME.match(str(group.get("name", "")))
        if named and int(named.group(1)) != ep[g]:
            raise CorruptionError(f"{tag_dir}: expert group {g} is named {group.get('name')!r} but is partitioned "
                                  f"over {count} of {world} ranks (ep {ep[g]})")
    if not ep:
        raise LayoutError(f"{tag_dir}: a DeepSpeed MoE checkpoint whose optimizer has no expert ('moe') parameter "
                          "group: its expert optimizer state is not in the ZeRO files, nothing was read")
    per_layer: dict[int, dict[int, str]] = {}
    for fname, keys in files.items():
        m = re.match(r"^layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$", fname)
        if m is None:
            raise LayoutError(f"{tag_dir}: expert file {fname} of a model-parallel rank other than 0: DeepSpeed MoE with "
                              "tensor or pipeline parallelism is not supported, nothing was read")
        layer, expert = int(m.group(1)), int(m.group(2))
        found = [expert_prefix(k) for k in keys]
        if not found or any(f is None or f[1] != expert for f in found) or len({f[0] for f in found if f}) != 1:
            raise CorruptionError(f"{tag_dir}/{fname}: its keys {sorted(keys)[:3]} are not all parameters of global "
                                  f"expert {expert} of one MoE layer")
        per_layer.setdefault(layer, {})[expert] = found[0][0]  # type: ignore[index]
    experts: dict[str, int] = {}
    layer_ids: dict[str, int] = {}
    declared = num_experts if isinstance(num_experts, list) else None
    for layer, by_expert in sorted(per_layer.items()):
        if sorted(by_expert) != list(range(len(by_expert))):
            raise CorruptionError(f"{tag_dir}: MoE layer {layer} has expert files of experts {sorted(by_expert)} "
                                  "(some are missing)")
        prefixes = set(by_expert.values())
        if len(prefixes) != 1:
            raise CorruptionError(f"{tag_dir}: the expert files of MoE layer {layer} name experts of different layers "
                                  f"{sorted(prefixes)}")
        prefix = prefixes.pop()
        if declared is not None and (layer >= len(declared) or declared[layer] != len(by_expert)):
            raise CorruptionError(f"{tag_dir}: MoE layer {layer} has {len(by_expert)} expert files, the checkpoint "
                                  f"declares num_experts={declared}")
        experts[prefix] = len(by_expert)
        layer_ids[prefix] = layer
    if declared is not None and len(declared) != len(per_layer):
        raise CorruptionError(f"{tag_dir}: expert files of {len(per_layer)} MoE layers, the checkpoint declares "
                              f"num_experts={declared} (missing files?)")
    data_first = bool(ds_config.get("use_data_before_expert_parallelism")) if isinstance(ds_config, dict) else False
    return ExpertLayout(world, ep, experts, data_first, layer_ids)
