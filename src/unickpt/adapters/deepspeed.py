"""Reading DeepSpeed checkpoints in place: ZeRO stage 1, 2 and 3 and universal checkpoints.

A DeepSpeed checkpoint is described by an in-memory manifest whose fragments point into
DeepSpeed's own ``*.pt`` files (nothing is copied, no checksums: ``crc32c == []``), so
``unickpt.load``, ``convert``, ``verify``, ``inspect`` and ``write_universal`` read it with the
same planner as unickpt's own format. The pickles are opened with the allow-listing
unpickler of :mod:`unickpt.adapters.torch_archive`: DeepSpeed's few metadata classes
(``fragment_address``, ``ZeroStageEnum``, loss scalers) are rebuilt as inert stand-ins, any
other class is refused, and DeepSpeed need not be installed.

Accepted paths: a tag directory (``global_step4``), its parent holding DeepSpeed's
``latest`` (or, without one, ``latest_universal``) file naming the tag, or a universal
directory written by ``ds_to_universal`` or :func:`unickpt.adapters.deepspeed_writer.write_universal`.

Names in the manifest (those of the torch-native example trainer, ``unickpt.examples.train``,
so a DeepSpeed checkpoint loads into it and the other way round):

* ``model.<param>``: the fp32 master weights (the highest-precision copy);
* ``optim.state.<param>.exp_avg``, ``.exp_avg_sq``, ``.step``: Adam's state (any other
  per-parameter key of the flat optimizer state is named the same way);
* ``module.<param>``: the module's low-precision copy, only when it differs in dtype from
  the master weights (bf16 / fp16 runs);
* ``model.<name>``: module entries that the optimizer does not own (buffers, frozen
  parameters), from the module copy;
* values: ``train.step`` (= ``deepspeed.global_steps``), ``deepspeed.global_samples``,
  ``deepspeed.skipped_steps``, ``deepspeed.zero_stage``, ``deepspeed.dp_world_size``,
  ``deepspeed.ds_version``, ``deepspeed.lr_scheduler``, ``deepspeed.ds_config``,
  ``deepspeed.clip_grad``, ``deepspeed.num_experts`` (MoE) and ``optim.param_groups`` (the
  hyperparameters of each group);
* ``deepspeed.client_state.<key>``: the job's ``client_state`` (every key of the model-states
  file that DeepSpeed's engine does not write: Megatron-DeepSpeed's ``args``, ``iteration``,
  ``tokens``, ``checkpoint_version``, ``checkpoint_info``) as values, the tensors inside it as
  ``deepspeed.client_state.<key>.<path>``; its per-rank ``rng_state`` is reported skipped. The
  data classes Megatron pickles there (``argparse.Namespace``, its enums, NumPy's RNG arrays)
  are allowed by the list the legacy Megatron-LM reader uses (:mod:`.megatron_pickles`).

ZeRO-1/2: each rank's optimizer file holds, per parameter group, one flat fp32 partition
(and flat ``exp_avg`` / ``exp_avg_sq``); ``param_slice_mappings`` gives each parameter's
``(start, numel)`` inside it. A parameter's fragments follow one another in *numeric* rank
order (rank 10 after rank 9), alignment padding is never addressed (the fp32 partition is
saved without ``group_paddings``, the moments with it). ZeRO-3: parameter ``i`` of a group
is split alone into ``ceil(numel / dp)`` elements per rank, the last rank's tail padded;
rank ``r`` holds elements ``[r * part, min(numel, (r + 1) * part))``; frozen parameters are
partitioned the same way into each rank's ``frozen_param_fragments``. Pipeline parallel
(ZeRO-1): each stage (``mp_rank_XX``) is read as above, the module copy comes from the
``layer_XX-model_states.pt`` files. Tensor parallel (ZeRO-1/2): each tensor-parallel rank's
shard of a parameter is a box of the global tensor, given by the checkpoint's
``universal_checkpoint_info`` (affine map or name patterns); its flat slices are pieces of
that box.

MoE (expert parallel, ZeRO-1/2, no tensor or pipeline parallelism): each rank's local
expert names become global ones (expert ``ep_rank * num_local_experts + local``,
:mod:`unickpt.adapters.deepspeed_moe`) before its flat slices are placed; the
``layer_L_expert_E`` files' module copies are replicas of the master weights (or
``module.`` entries in bf16/fp16 runs).

Refused with a LayoutError naming the reason (never half-read): tensor-parallel checkpoints
without ``universal_checkpoint_info`` or with layouts it describes that are not boxes
(fused, averaged, vocabulary-padded), tensor and pipeline parallelism together, MoE under
ZeRO-3, without ZeRO or with tensor or pipeline parallelism, parameters tied across
pipeline stages. Not read: NVMe-offloaded state.
Tensors of the source left out of the manifest are listed with the reason in
``manifest.provenance["skipped"]`` (placeholders without data, optimizer state that is
not a flat partition), further copies of data read once from another copy (module copies
duplicating the master weights, tensor-parallel replicas) in ``manifest.provenance["replicas"]``.
Byte by byte: every ``*.pt`` file read is declared to the ledger (``read_deepspeed(path,
regions)``): its zip records other than tensor storages are structure, alignment padding
inside a storage is structure, and the storages of skipped and replicated tensors are owned
by their reported names; a storage nothing claims is left for the ledger to flag.
"""

from __future__ import annotations

import argparse
import os
import re
from math import prod
from typing import Any

from ..errors import CorruptionError, LayoutError, NotACheckpointError, UnickptError
from ..format.dtypes import itemsize
from ..format.ledger import Region
from ..format.manifest import Fragment, Manifest, TensorEntry
from ..plan.box import Box, row_major_strides
from ..plan.piece import flat_pieces, whole_piece
from ..storage.open import open_storage
from .deepspeed_moe import ExpertLayout, expert_layout
from .megatron_pickles import MEGATRON_ALLOWED
from .manifest_builder import ManifestBuilder
from .torch_archive import StoredTensor, records_in, stored_tensors


class DeepSpeedRecord:
    """Inert stand-in for a plain DeepSpeed object in a pickle (its attributes only)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class FragmentAddress(DeepSpeedRecord):
    """``deepspeed.utils.tensor_fragment.fragment_address``: ``start`` and ``numel`` of a
    parameter inside a rank's flat partition."""

    start: int = 0
    numel: int = 0


class LossScalerRecord(DeepSpeedRecord):
    """DeepSpeed's (static or dynamic) loss scaler: ``cur_scale``, ``dynamic``, ..."""


def _zero_stage(value: Any) -> int:
    return int(value)


ALLOWED = {
    # Megatron-DeepSpeed's client_state (args with its enums and dtypes, the RNG state): the
    # legacy Megatron reader's own list of data classes
    **MEGATRON_ALLOWED,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): FragmentAddress,
    ("deepspeed.runtime.bf16_optimizer", "fragment_address"): FragmentAddress,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScalerRecord,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): LossScalerRecord,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _zero_stage,
}

OPTIM_FILE = re.compile(r"^(?:(?:bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
LAYER_FILE = re.compile(r"^layer_(\d+)-(?:.+-)?model_states\.pt$")  # a pipeline module's layer
EXPERT_MODEL_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EXPERT_OPTIM_FILE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MARKERS = ("latest", "latest_universal")
# the keys DeepSpeed's engine writes into a model-states file (_common_checkpoint_state,
# _checkpoint_parallel_metadata, MoE and AutoEP metadata); any other key is the job's
# client_state (engine.save_checkpoint(save_dir, client_state={...}))
ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
    "universal_checkpoint_info", "num_experts", "ds_autoep_layers", "folding", "sparse_tensor_module_names",
})
CLIENT_STATE = "deepspeed.client_state"


# ----------------------------------------------------------------------------- detection

def _kind(root: str) -> str | None:
    """``"zero"`` or ``"universal"`` for a checkpoint tag directory, else None."""
    storage = open_storage(root)
    names = storage.names()
    optim = any(OPTIM_FILE.match(n) or EXPERT_OPTIM_FILE.match(n) for n in names)
    if optim and any(MODEL_FILE.match(n) or ZERO3_MODEL_FILE.match(n) for n in names):
        return "zero"
    if storage.exists("zero/optimizer_state.pt"):
        return "universal"
    return None


def _resolve(path: str) -> tuple[str, str, str] | None:
    """(tag prefix relative to ``path`` ('' or 'tag/'), tag directory, kind) or None."""
    kind = _kind(path)
    if kind:
        return "", path, kind
    storage = open_storage(path)
    for marker in MARKERS:
        if not storage.exists(marker):
            continue
        try:
            tag = storage.read_small(marker).decode("utf-8", "replace").strip()
        except (OSError, UnickptError):
            continue
        if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or "\x00" in tag:
            continue
        d = os.path.join(path, tag)
        kind = _kind(d)
        if kind:
            return tag + "/", d, kind
    return None


def is_deepspeed(path: str) -> bool:
    """True for a DeepSpeed ZeRO checkpoint tag directory (``global_stepN``), its parent with
    a ``latest``/``latest_universal`` file, or a DeepSpeed universal checkpoint directory."""
    return _resolve(str(path)) is not None


# ----------------------------------------------------------------------------- helpers

class _Builder(ManifestBuilder):
    """The manifest being built from a DeepSpeed checkpoint: the base's accounts, and
    what the flat ZeRO partitions add (their alignment padding, flat slices)."""

    RECORDS = (DeepSpeedRecord, argparse.Namespace)  # a Namespace: Megatron-DeepSpeed's args

    def __init__(self, root: str, prefix: str) -> None:
        super().__init__(root, prefix, ALLOWED)
        self.group_paddings = 0  # elements of alignment padding of all flat groups (ZeRO-1/2 group_paddings)
        self.alignment = 0  # elements a flat group is padded to a multiple of, when group_paddings are not known

    def padding(self, t: Any, at: int, numel: int) -> None:
        """Elements ``[at, at + numel)`` of flat tensor ``t`` are alignment padding, no data."""
        self.own(None, t, at, numel)

    def same_plain(self, a: Any, b: Any) -> bool:
        """Whether two values have one plain form (False when either has none)."""
        try:
            return self.plain(a) == self.plain(b)
        except UnickptError:
            return False

    def whole(self, name: str, t: StoredTensor, layout: str, rank: int = 0) -> None:
        if not isinstance(t, StoredTensor):
            raise CorruptionError(f"{name!r}: expected a tensor, found {type(t).__name__}")
        if not t.is_contiguous():
            raise CorruptionError(f"{name!r}: a non-contiguous tensor in {t.file}")
        e = self.entry(name, t.shape, t.dtype, layout, t.file)
        if t.numel:
            e.fragments.append(Fragment(t.file, t.offset, t.shape, [whole_piece(t.shape)], [], itemsize(t.dtype), rank))

    def flat(self, name: str, shape: tuple[int, ...], flat: StoredTensor, at: int, start: int, numel: int,
             layout: str, rank: int, box: Box | None = None) -> None:
        """Elements ``[start, start + numel)`` of parameter ``name`` (of ``box`` of it, a
        tensor-parallel shard, when given) stored at element ``at`` of the 1-D tensor ``flat``."""
        box = box or Box.whole(shape)
        if not isinstance(flat, StoredTensor) or len(flat.shape) != 1 or (flat.numel > 1 and flat.stride[0] != 1):
            raise CorruptionError(f"{name!r}: the flat partition in {getattr(flat, 'file', '?')} is not a 1-D contiguous tensor")
        if at < 0 or at + numel > flat.numel or start < 0 or start + numel > box.volume:
            raise CorruptionError(
                f"{name!r}: slice ({at}, {numel}) lies outside the partition of {flat.numel} elements in {flat.file} "
                f"or outside the parameter's {box.volume} elements"
            )
        e = self.entry(name, shape, flat.dtype, layout, flat.file)
        if numel:
            size = itemsize(flat.dtype)
            pieces = flat_pieces(box, start, start + numel)
            e.fragments.append(Fragment(flat.file, flat.offset + at * size, (numel,), pieces, [], size, rank))


def _group_state(base: Any, g: int) -> dict[str, Any]:
    state = base.get("state", {}) if isinstance(base, dict) else {}
    if isinstance(state, dict):
        s = state.get(g, {})
    elif isinstance(state, (list, tuple)) and g < len(state):
        s = state[g]
    else:
        s = {}
    return s if isinstance(s, dict) else {}


def _param_groups_value(b: _Builder, groups: Any) -> None:
    if isinstance(groups, list):
        b.value("optim.param_groups", [{k: v for k, v in g.items()} for g in groups if isinstance(g, dict)])


def _model_values(b: _Builder, model: dict[str, Any], zero_stage: int, world: int) -> None:
    steps = model.get("global_steps")
    if isinstance(steps, int):
        b.value("train.step", steps)
    for key in ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size", "ds_version",
                "lr_scheduler", "ds_config", "buffer_names"):
        if key in model and model[key] is not None:
            b.value(f"deepspeed.{key}", model[key])
    b.value("deepspeed.zero_stage", zero_stage)
    b.manifest.world_size = world
    b.manifest.provenance.update({
        "format": "deepspeed", "framework": "deepspeed", "zero_stage": zero_stage, "world_size": world,
        "ds_version": version if isinstance(version := model.get("ds_version"), str) else None, "step": steps if isinstance(steps, int) else None,
    })


RNG_STATE = ("per-rank RNG state (Python, NumPy, torch and CUDA generators, Megatron's rng_tracker_states) the job "
             "saved in its client_state: not mapped onto another layout")


def _client_state(b: _Builder, fname: str, model: Any, read_from: str, first: Any = None) -> None:
    """The job's ``client_state`` in the model-states file ``fname``: every key DeepSpeed's
    engine does not write (:data:`ENGINE_KEYS`; Megatron-DeepSpeed's ``args``, ``iteration``,
    ``tokens``, ``checkpoint_version``, ``checkpoint_info``, ``rng_state``...). Read from the
    file ``read_from`` only: values as ``deepspeed.client_state.<key>`` (``args`` a dict, its
    enums and dtypes as text), tensors as ``deepspeed.client_state.<key>.<path>``. Skipped,
    with the reason: the RNG state (per rank), a value holding objects unickpt does not build,
    and another file's (each rank saves its own) tensors and values that differ from those
    of ``first``, the content of ``read_from``."""
    if not isinstance(model, dict):
        return
    for key, v in model.items():
        if key in ENGINE_KEYS:
            continue
        name = f"{CLIENT_STATE}.{key}"
        if key == "rng_state":
            b.skip(f"{fname}:rng_state", RNG_STATE, v)
        elif fname != read_from:
            theirs = first.get(key) if isinstance(first, dict) else None
            if stored_tensors(v) or records_in(v) or not b.same_plain(v, theirs):
                b.skip(f"{fname}:{key}", f"this rank's own client state {key!r} (the one in {read_from} is read as {name})", v)
        elif records_in(v):
            kinds = sorted({r.global_name for r in records_in(v)})
            b.skip(name, f"client state holding objects unickpt does not build ({', '.join(kinds[:3])}): not read", v)
        else:
            b.value(name, v)  # its tensors, None there, are read below
            for path, t in _tensor_paths(v, name):
                if t.is_contiguous():
                    b.whole(path, t, "deepspeed client state")
                else:
                    b.skip(path, f"a non-contiguous view in {fname}'s client state: not read", t)


def _module_entries(b: _Builder, module: Any, master: set[str], master_dtype: dict[str, str], source: str,
                    zero3: bool = False, buffers: set[str] = frozenset()) -> None:
    """The module copy: ``module.<p>`` where it differs in dtype from the master, ``model.<n>``
    for what the optimizer does not own. ZeRO-3's zero-size placeholders of partitioned
    parameters hold no data; a placeholder whose parameter was read from nowhere else, and a
    module copy in the master's own dtype (a duplicate), are accounted for as skipped."""
    if not isinstance(module, dict):
        return
    _module_buffer_padding(b, module)
    for name, t in module.items():
        if not isinstance(t, StoredTensor):
            continue
        if name in master:
            if not t.numel:
                continue
            if t.dtype != master_dtype.get(name):
                b.whole(f"module.{name}", t, "deepspeed module copy")
            else:
                b.replica(f"module.{name}", f"the module's copy of model.{name} in {source}, in the dtype of the master "
                          "weights: a duplicate (the master weights are read)", t)
        elif f"model.{name}" in b.manifest.tensors:
            # a frozen ZeRO-3 parameter (read from its partitions) or a tied alias
            if t.numel:
                b.replica(f"module.{name}", f"the module's copy of model.{name} in {source} (model.{name} is read "
                          "from its own partitions or from the parameter it is tied to)", t)
        elif zero3 and not t.numel and name not in buffers:
            b.skip(f"model.{name}", f"a zero-size ZeRO-3 placeholder in {source}: the parameter's data is not in this "
                   "checkpoint", t)
        else:
            b.whole(f"model.{name}", t, "deepspeed module (not optimized)")


def _storage_numel(t: StoredTensor) -> int:
    """Elements of ``t``'s storage record from the tensor's first element on."""
    return t.storage_bytes // itemsize(t.dtype) - t.storage_offset


def _module_buffer_padding(b: _Builder, module: dict[str, Any]) -> None:
    """ZeRO-1/2 module parameters are views of one flat buffer per group, saved whole: the
    buffer's bytes past its last view, no more than the groups' alignment padding
    (``group_paddings``; in a universal checkpoint, which keeps rank 0's only: less than
    the alignment, the buffer a multiple of it), are that padding."""
    ends: dict[tuple[str, int], tuple[StoredTensor, int]] = {}
    for t in module.values():
        if isinstance(t, StoredTensor) and t.numel and t.is_contiguous():
            key = (t.file, t.storage_at)
            end = t.storage_offset + t.numel
            if key not in ends or end > ends[key][1]:
                ends[key] = (t, end)
    for t, end in ends.values():
        total = t.storage_bytes // itemsize(t.dtype)
        tail = total - end
        if 0 < tail <= b.group_paddings or (0 < tail < b.alignment and total % b.alignment == 0):
            b.padding(t, end - t.storage_offset, tail)


def _aliases(b: _Builder, model: dict[str, Any]) -> None:
    """``shared_params`` (tied parameters, ``alias -> source``): the alias names the source's
    data, as ``zero_to_fp32`` restores it."""
    shared = model.get("shared_params")
    for alias, src in (shared.items() if isinstance(shared, dict) else ()):
        e = b.manifest.tensors.get(f"model.{src}")
        if e is not None and f"model.{alias}" not in b.manifest.tensors:
            b.manifest.tensors[f"model.{alias}"] = TensorEntry(f"model.{alias}", e.shape, e.dtype, list(e.fragments),
                                                               e.layout + " (tied)")


def _step(b: _Builder, name: str, step: Any, where: str) -> None:
    """The optimizer step of a parameter's group, recorded once (the first rank holding it);
    the other ranks' copies of it (``where``: the group state holding one) are replicas."""
    key = f"optim.state.{name}.step"
    if key in b.manifest.tensors or key in b.manifest.values:
        read = b.manifest.tensors[key].fragments if key in b.manifest.tensors else []
        if isinstance(step, StoredTensor) and not any(f.file == step.file and f.offset == step.offset for f in read):
            b.replica(f"{where}.step", "a copy of the group's optimizer step (read once, from the first rank holding "
                      "the group)", step)
        return
    if isinstance(step, StoredTensor) and step.numel == 1:
        b.whole(key, step, "deepspeed per-group step")
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        b.value(key, step)
    elif step is not None:  # never dropped without a word
        b.skip(f"{where}.step", f"an optimizer step that is not one number ({type(step).__name__}"
               f"{f' of shape {list(step.shape)}' if isinstance(step, StoredTensor) else ''})",
               step if isinstance(step, StoredTensor) else None)


def _check_complete(b: _Builder) -> None:
    """Every entry's fragments hold all its elements (flat slices can leave gaps)."""
    for name, e in b.manifest.tensors.items():
        got = sum(prod(f.shape) for f in e.fragments)
        if got != prod(e.shape):
            raise CorruptionError(
                f"{name!r}: the DeepSpeed checkpoint holds {got} of its {prod(e.shape)} elements (missing rank files?)"
            )


# ----------------------------------------------------------------------------- ZeRO 1/2/3

def _rank_files(names: list[str], pattern: re.Pattern[str]) -> dict[int, dict[int, str]]:
    """model-parallel rank -> {data-parallel rank -> file name}, both in numeric order."""
    found: dict[int, dict[int, str]] = {}
    for n in names:
        m = pattern.match(n)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = n
    return {mp: dict(sorted(d.items())) for mp, d in sorted(found.items())}


def _expert_files(names: list[str]) -> list[str]:
    return sorted(n for n in names if EXPERT_MODEL_FILE.match(n) or EXPERT_OPTIM_FILE.match(n))


def _refuse_experts(tag_dir: str, names: list[str], model: dict[str, Any], why: str) -> None:
    """Refuse a DeepSpeed MoE checkpoint whole when its layout is one unickpt does not map to
    global experts (``why``); a checkpoint without experts passes."""
    experts = _expert_files(names)
    if experts or model.get("num_experts"):
        shown = ", ".join(experts[:3]) + (", ..." if len(experts) > 3 else "")
        raise LayoutError(
            f"{tag_dir}: a DeepSpeed MoE (expert-parallel) checkpoint (expert files: {shown or 'none'}; "
            f"num_experts={model.get('num_experts', '?')!r}) {why} is not supported: unickpt maps expert "
            "parameters to global experts for ZeRO-1/2 without tensor or pipeline parallelism only; nothing was read"
        )


def _read_expert_layout(b: _Builder, tag_dir: str, names: list[str], osd0: dict[str, Any], model: dict[str, Any],
                        world: int) -> tuple[ExpertLayout, dict[str, dict[str, Any]]]:
    """The expert placement of a ZeRO-1/2 MoE checkpoint and its expert model files (name ->
    state dict, keyed by global expert names); ``expp_rank_*`` optimizer files, which hold no
    ZeRO state, are opened and any tensor in them reported as skipped."""
    expert_sds = {}
    for fname in _expert_files(names):
        sd = b.archive(fname)
        if EXPERT_OPTIM_FILE.match(fname):
            for path, t in _tensor_paths(sd, ""):
                b.skip(f"{fname}:{path}", "optimizer state outside ZeRO in an expert-parallel optimizer file (its "
                       "parameters are indices, not names): ZeRO's own partitions are read", t)
            continue
        if not isinstance(sd, dict):
            raise CorruptionError(f"{fname}: not a state dict of one expert")
        expert_sds[fname] = sd
    base = osd0.get("base_optimizer_state") if isinstance(osd0.get("base_optimizer_state"), dict) else {}
    layout = expert_layout(tag_dir, world, base.get("param_groups"), osd0.get("partition_count"),
                           {f: list(sd) for f, sd in expert_sds.items()}, model.get("num_experts"), model.get("ds_config"))
    return layout, expert_sds


def _parallel_degrees(model: dict[str, Any], mps: list[int], has_layer_files: bool) -> tuple[int, int]:
    """(pipeline, tensor) parallel degrees of a ZeRO-1/2 checkpoint."""
    dims = model.get("checkpoint_parallel_dimensions")
    if isinstance(dims, dict):
        return int(dims.get("pp_degree") or 1), int(dims.get("tp_degree") or 1)
    mp_world = int(model.get("mp_world_size") or len(mps))
    return (mp_world, 1) if has_layer_files else (1, mp_world)


def _refuse_tensor_parallel(tag_dir: str, tp: int, pp: int, model: dict[str, Any], why: str = "") -> None:
    if why:
        pass
    elif not isinstance(model.get("universal_checkpoint_info"), dict):
        why = ("merging its tensor-parallel slices needs DeepSpeed's universal_checkpoint_info (which parameters are "
               "row-parallel, replicated, vocabulary-padded, fused), and this checkpoint carries none")
    else:
        why = "tensor and pipeline parallelism together are not read by unickpt yet"
    raise LayoutError(
        f"{tag_dir}: a tensor-parallel DeepSpeed checkpoint (tp_degree={tp}, pp_degree={pp}, files mp_rank_00 .. "
        f"mp_rank_{tp * pp - 1:02d}) is not supported: {why}; nothing was read"
    )


def _flat_moments(b: _Builder, state: dict[str, Any], flat: StoredTensor, padding: int, where: str) -> dict[str, StoredTensor]:
    """The flat per-element optimizer states of one group partition. DeepSpeed saves the
    fp32 partition without its alignment padding (``group_paddings``, the last rank's tail)
    but the moments with it: both lengths are the partition; the tail is never addressed."""
    out = {}
    for key, v in state.items():
        if key == "step" or not isinstance(v, StoredTensor):
            continue
        if len(v.shape) == 1 and v.numel in (flat.numel, flat.numel + padding):
            out[key] = v
        else:
            b.skip(f"{where}.{key}", f"an optimizer state of shape {list(v.shape)} that is not a flat partition "
                   f"({flat.numel} elements, or {flat.numel + padding} with the alignment padding)", v)
    return out


PARAM_PADDING_MAX = 15  # elements DeepSpeed's parameter_alignment may leave after a parameter (16 bytes of 1-byte items)


def _check_slices(fname: str, g: int, mapping: dict[str, Any], order: list[str] | None) -> None:
    """The slice addresses of group ``g`` in one rank's partition are where DeepSpeed puts
    them; a CorruptionError otherwise (a slice moved, or swapped with another of its size,
    would load another parameter's values): no two overlap, and with ``order`` (the group's
    ``param_shapes`` names: the order of the flat group, which ``zero_to_fp32`` reads it in)
    they follow one another in that order, at most the padding of ``parameter_alignment``
    apart."""
    got = {name: (int(a.start), int(a.numel)) for name, a in mapping.items()}
    spans = sorted((start, start + numel, name) for name, (start, numel) in got.items() if numel)
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise CorruptionError(f"{fname}: group {g}: the slices of {first!r} and {second!r} overlap in the partition")
    if order is None or not set(got) <= set(order):
        return
    end, before = 0, "the partition's start"
    for name in (n for n in order if n in got and got[n][1]):
        start, numel = got[name]
        if not end <= start <= end + PARAM_PADDING_MAX:
            raise CorruptionError(
                f"{fname}: group {g}: parameter {name!r} is mapped to elements {start}..{start + numel} of the "
                f"partition, not right after {before} (element {end}): a flat group holds its parameters one after "
                "another in param_shapes order")
        end, before = start + numel, repr(name)


def _read_zero12_ranks(b: _Builder, files: dict[int, str], shapes: dict[str, tuple[int, ...]], stage: int, rank_base: int,
                       loaded: dict[str, Any], master_dtype: dict[str, str],
                       tp_shards: dict[str, tuple[tuple[int, ...], Box | None]] | None = None,
                       experts: ExpertLayout | None = None, orders: list[list[str]] | None = None) -> None:
    """The fp32 partitions and flat optimizer states of one set of data-parallel ranks (the
    whole job, one pipeline stage, or one tensor-parallel rank: then ``tp_shards`` maps each
    parameter to its global shape and the box of it this rank's shard holds, None for a
    replica that a lower tensor-parallel rank holds too). With ``experts`` (an MoE
    checkpoint), the local expert names of each rank's expert groups are made global first:
    an expert's partitions are those of the ranks holding it, in numeric order. ``orders``:
    each group's parameter names in ``param_shapes`` order, to check the slices against
    (:func:`_check_slices`)."""
    layout = f"deepspeed zero-{stage} flat partition"
    filled: dict[str, int] = {}
    for dp, fname in files.items():
        sd = loaded.get(fname) or b.archive(fname)
        osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
        fp32 = osd.get("single_partition_of_fp32_groups") if isinstance(osd, dict) else None
        mappings = osd.get("param_slice_mappings") if isinstance(osd, dict) else None
        if fp32 is None or mappings is None or len(fp32) != len(mappings):
            raise CorruptionError(f"{fname}: no single_partition_of_fp32_groups / param_slice_mappings (not a ZeRO-1/2 file)")
        paddings = osd.get("group_paddings") or []
        base = osd.get("base_optimizer_state", {})
        for g, (flat, mapping) in enumerate(zip(fp32, mappings)):
            pad = int(paddings[g]) if g < len(paddings) else 0
            b.group_paddings += pad
            state = _group_state(base, g)
            where = f"{fname}:base_optimizer_state.state.{g}"
            moments = _flat_moments(b, state, flat, pad, where)
            step = state.get("step", osd.get("base_optimizer_state_step"))
            _check_slices(fname, g, mapping, orders[g] if orders and g < len(orders) else None)
            end = max((int(getattr(a, "start", 0)) + int(getattr(a, "numel", 0)) for a in mapping.values()), default=0)
            for t in (flat, *moments.values()):
                # past the last parameter: the group's alignment padding (group_paddings; the fp32
                # partition is saved as a view without it, its storage record holds it)
                if _storage_numel(t) - end <= pad:
                    b.padding(t, end, _storage_numel(t) - end)
            for name, addr in mapping.items():
                if name not in shapes:
                    raise CorruptionError(f"{fname}: parameter {name!r} has no shape in param_shapes")
                local_name = name
                if experts is not None:
                    name = experts.global_name(rank_base + dp, g, name, fname)
                # in_flat: where the slice lies in this rank's partition; in_param: where it
                # lies in the flattened parameter (after the slices of all lower ranks)
                in_flat, numel = int(getattr(addr, "start", 0)), int(getattr(addr, "numel", 0))
                in_param = filled.get(name, 0)
                shape, box = tp_shards[name] if tp_shards else (shapes[local_name], None)
                filled[name] = in_param + numel
                if tp_shards and box is None:
                    for key, t in (("fp32", flat), *moments.items()):
                        b.replica(f"{fname}:{name}.{key}", "a tensor-parallel replica of a lower tensor-parallel rank's shard",
                                  t, in_flat, numel)
                    _step(b, name, step, where)
                    continue
                b.flat(f"model.{name}", shape, flat, in_flat, in_param, numel, layout, rank_base + dp, box)
                master_dtype[name] = flat.dtype
                for key, t in moments.items():
                    b.flat(f"optim.state.{name}.{key}", shape, t, in_flat, in_param, numel, layout, rank_base + dp, box)
                _step(b, name, step, where)


def _read_zero(b: _Builder, tag_dir: str) -> Manifest:
    names = open_storage(tag_dir).names()
    optim = _rank_files(names, OPTIM_FILE)
    if not optim:
        _refuse_experts(tag_dir, names, {}, "without ZeRO (no zero_pp_rank_* optimizer files)")
        raise NotACheckpointError(f"{tag_dir}: no zero_pp_rank_*_optim_states.pt files")
    mps = list(optim)
    if mps != list(range(len(mps))):
        raise CorruptionError(f"{tag_dir}: optimizer files of model-parallel ranks {mps} (some are missing)")
    dp_world = len(optim[0])
    for mp, files in optim.items():
        if sorted(files) != list(range(dp_world)):
            raise CorruptionError(f"{tag_dir}: optimizer files of ranks {sorted(files)} for mp_rank_{mp:02d} (some are missing)")
    first_name = optim[0][0]
    first = b.archive(first_name)
    osd0 = first.get("optimizer_state_dict", {}) if isinstance(first, dict) else {}
    stage = int(osd0.get("zero_stage", 1)) if isinstance(osd0, dict) else 1
    if stage >= 3:
        if len(mps) > 1:
            _refuse_tensor_parallel(tag_dir, len(mps), 1, {}, "ZeRO-3 with tensor parallelism is not read by unickpt yet")
        return _read_zero3(b, tag_dir, names, optim[0], stage, first)
    models = {}
    for mp in mps:
        model_name = f"mp_rank_{mp:02d}_model_states.pt"
        if model_name not in names:
            raise CorruptionError(f"{tag_dir}: {model_name} is missing")
        models[mp] = b.archive(model_name)
        _client_state(b, model_name, models[mp], "mp_rank_00_model_states.pt", models[0])
    model = models[0]
    layer_files: dict[int, list[str]] = {}
    for n in names:
        m = LAYER_FILE.match(n)
        if m:
            layer_files.setdefault(int(m.group(1)), []).append(n)
    pp, tp = _parallel_degrees(model, mps, bool(layer_files))
    experts: ExpertLayout | None = None
    expert_sds: dict[str, dict[str, Any]] = {}
    if len(mps) > 1 or layer_files:
        _refuse_experts(tag_dir, names, model, f"with tensor or pipeline parallelism (tp_degree={tp}, pp_degree={pp})")
    elif _expert_files(names) or model.get("num_experts"):
        experts, expert_sds = _read_expert_layout(b, tag_dir, names, osd0, model, dp_world)
    if tp > 1 and pp == 1 and not layer_files and isinstance(model.get("universal_checkpoint_info"), dict):
        return _read_tensor_parallel(b, tag_dir, optim, models, stage, first_name, first, osd0, tp)
    if tp > 1 or any(len(v) > 1 for v in layer_files.values()):
        _refuse_tensor_parallel(tag_dir, max(tp, 2), pp, model)
    if pp != len(mps):
        raise CorruptionError(f"{tag_dir}: pp_degree {pp} but files of {len(mps)} model-parallel ranks")
    master_dtype: dict[str, str] = {}
    owner: dict[str, int] = {}
    for mp in mps:
        shapes = {n: tuple(int(x) for x in s) for g in models[mp].get("param_shapes") or [] for n, s in g.items()}
        for n in shapes:
            if n in owner or (pp > 1 and n.startswith("tied_modules.")):
                raise LayoutError(f"{tag_dir}: parameter {n!r} is tied across pipeline stages (a pipeline-replicated "
                                  "parameter); such DeepSpeed pipeline checkpoints are not supported, nothing was read")
            owner[n] = mp
        orders = None if experts is not None else [list(g) for g in models[mp].get("param_shapes") or []]
        _read_zero12_ranks(b, optim[mp], shapes, stage, mp * dp_world, {first_name: first}, master_dtype, experts=experts,
                           orders=orders)
    _check_complete(b)
    if pp > 1:
        for idx, (fname,) in sorted(layer_files.items()):
            layer = b.archive(fname)
            if not isinstance(layer, dict):
                raise CorruptionError(f"{fname}: not a module state dict")
            _module_entries(b, {f"{idx}.{k}": v for k, v in layer.items()}, set(owner), master_dtype, fname)
    else:
        _aliases(b, model)
        _module_entries(b, model.get("module"), set(master_dtype), master_dtype, "mp_rank_00_model_states.pt")
        for fname, sd in expert_sds.items():  # keyed by global names: replicas of the master weights, or module copies
            _module_entries(b, sd, set(master_dtype), master_dtype, fname)
    _param_groups_value(b, osd0.get("base_optimizer_state", {}).get("param_groups"))
    for key in ("clip_grad", "partition_count", "group_paddings"):
        if key in osd0:
            b.value(f"deepspeed.{key}", osd0[key])
    _model_values(b, model, stage, dp_world * pp)
    if pp > 1:
        b.manifest.provenance["pipeline_parallel"] = pp
        b.manifest.provenance["data_parallel"] = dp_world
    if experts is not None:
        b.value("deepspeed.num_experts", model.get("num_experts"))
        b.manifest.provenance["experts"] = experts.describe()
    return b.manifest


def _unsupported_tp(tag_dir: str, name: str, why: str) -> LayoutError:
    return LayoutError(f"{tag_dir}: tensor-parallel parameter {name!r} {why}: not supported, nothing was read")


def _tp_layout(tag_dir: str, rules: dict[str, Any], name: str, shards: dict[int, tuple[int, ...]]
               ) -> tuple[tuple[int, ...], dict[int, Box]]:
    """The global shape of a tensor-parallel parameter and the box of it each tensor-parallel
    rank's shard holds, from DeepSpeed's ``universal_checkpoint_info``: its ``affine_map``
    (one unscaled row-major box per rank), ``tp_replicated_parameter_patterns`` (the whole
    tensor on every rank), ``parameter_with_row_parallelism_patterns`` (slices joined on dim
    1) or else, as DeepSpeed's default, slices joined on dim 0. Averaged, vocabulary-padded
    and fused (sub-parameter) layouts are refused."""
    def matching(key: str) -> list[str]:
        return [p for p in rules.get(key) or [] if re.match(p, name)]

    affine = ((rules.get("affine_map") or {}).get("params") or {})
    found = [p for p in affine if re.match(p, name)]
    if len(found) > 1:
        raise _unsupported_tp(tag_dir, name, f"matches several affine maps {found}")
    if found:
        spec = affine[found[0]]
        shape = tuple(int(x) for x in spec["logical_shape"])
        ranks = spec.get("ranks") or {}
        boxes = {}
        for t, shard in shards.items():
            info = ranks.get(t, ranks.get(str(t)))
            pieces = (info or {}).get("pieces") or []
            if len(pieces) != 1:
                raise _unsupported_tp(tag_dir, name, f"is held by tensor-parallel rank {t} in {len(pieces)} pieces "
                                      "(fused sub-parameters)")
            piece = pieces[0]
            (src, src_strides), (dst, dst_strides) = piece["source"], piece["dest"]
            lengths = tuple(int(x) for x in piece["shape"])
            if (float(piece.get("scale", 1.0)) != 1.0 or lengths != shard or int(dst) != 0
                    or tuple(dst_strides) != row_major_strides(shard) or tuple(src_strides) != row_major_strides(shape)):
                raise _unsupported_tp(tag_dir, name, f"has an affine map piece on rank {t} that is not one unscaled "
                                      f"box of the whole shard ({piece})")
            offsets, rest = [], int(src)
            for stride in row_major_strides(shape):
                offsets.append(rest // stride)
                rest %= stride
            box = Box(tuple(offsets), lengths)
            if not Box.whole(shape).contains(box):
                raise CorruptionError(f"{tag_dir}: affine map of {name!r} on rank {t} lies outside {shape}")
            boxes[t] = box
        return shape, boxes
    for key in ("parameter_to_average_patterns", "vocabulary_parameter_patterns", "parameter_with_2_sub_params_cat_dim_0"):
        if matching(key):
            raise _unsupported_tp(tag_dir, name, f"matches {key} (merge rule not applied by unickpt)")
    if any(re.match(p, name) for sub in rules.get("parameter_with_sub_params") or [] for p in (sub or {}).get("patterns", [])):
        raise _unsupported_tp(tag_dir, name, "matches parameter_with_sub_params (merge rule not applied by unickpt)")
    first = shards[min(shards)]
    if matching("tp_replicated_parameter_patterns"):
        if any(s != first for s in shards.values()):
            raise CorruptionError(f"{tag_dir}: replicated parameter {name!r} has shards of different shapes")
        return first, {t: Box.whole(first) for t in shards}
    dim = 1 if matching("parameter_with_row_parallelism_patterns") else 0
    if not first or any(len(s) != len(first) or s[:dim] + s[dim + 1:] != first[:dim] + first[dim + 1:] for s in shards.values()):
        raise _unsupported_tp(tag_dir, name, f"has shards {list(shards.values())} that do not join on dim {dim}")
    boxes, at = {}, 0
    for t, shard in sorted(shards.items()):
        offsets = [0] * len(shard)
        offsets[dim] = at
        boxes[t] = Box(tuple(offsets), shard)
        at += shard[dim]
    return first[:dim] + (at,) + first[dim + 1:], boxes


def _read_tensor_parallel(b: _Builder, tag_dir: str, optim: dict[int, dict[int, str]], models: dict[int, Any], stage: int,
                          first_name: str, first: Any, osd0: dict[str, Any], tp: int) -> Manifest:
    """ZeRO-1/2 with tensor parallelism (no pipeline): tensor-parallel rank ``t`` is
    ``mp_rank_{t:02d}``; each parameter's shard on it is a box of the global tensor given by
    the checkpoint's ``universal_checkpoint_info`` (:func:`_tp_layout`); within the shard the
    data-parallel ranks' flat slices follow one another as without tensor parallelism."""
    rules = models[0]["universal_checkpoint_info"]
    if sorted(models) != list(range(tp)):
        raise CorruptionError(f"{tag_dir}: model-states files of model-parallel ranks {sorted(models)} for tp_degree {tp}")
    shards: dict[str, dict[int, tuple[int, ...]]] = {}
    for t, model in models.items():
        for g in model.get("param_shapes") or []:
            for n, s in g.items():
                shards.setdefault(n, {})[t] = tuple(int(x) for x in s)
    layouts = {}
    for name, per_rank in shards.items():
        if sorted(per_rank) != list(range(tp)):
            raise _unsupported_tp(tag_dir, name, f"is held by tensor-parallel ranks {sorted(per_rank)} only")
        layouts[name] = _tp_layout(tag_dir, rules, name, per_rank)
    dp_world = len(optim[0])
    master_dtype: dict[str, str] = {}
    for t in range(tp):
        shard_of = {}
        for name, (shape, boxes) in layouts.items():
            lower = [boxes[u] for u in range(t)]
            shard_of[name] = (shape, None if boxes[t] in lower else boxes[t])
        shapes = {n: s[t] for n, s in shards.items()}
        _read_zero12_ranks(b, optim[t], shapes, stage, t * dp_world, {first_name: first}, master_dtype, shard_of)
    _check_complete(b)
    for t, model in models.items():
        module = model.get("module")
        for name, v in (module.items() if isinstance(module, dict) else ()):
            if not isinstance(v, StoredTensor):
                continue
            if name not in layouts:
                raise LayoutError(f"{tag_dir}: module entry {name!r} of mp_rank_{t:02d} is not an optimized parameter "
                                  "(a buffer or frozen parameter) of a tensor-parallel checkpoint, whose split is not "
                                  "recorded: not supported, nothing was read")
            b.replica(f"mp_rank_{t:02d}_model_states.pt:module.{name}", "the module's tensor-parallel shard of "
                      f"model.{name} (the fp32 master weights are read)", v)
    _param_groups_value(b, osd0.get("base_optimizer_state", {}).get("param_groups"))
    for key in ("clip_grad", "partition_count", "group_paddings"):
        if key in osd0:
            b.value(f"deepspeed.{key}", osd0[key])
    _model_values(b, models[0], stage, dp_world * tp)
    b.manifest.provenance["tensor_parallel"] = tp
    b.manifest.provenance["data_parallel"] = dp_world
    return b.manifest


def _read_zero3(b: _Builder, tag_dir: str, names: list[str], optim: dict[int, str], stage: int, first: Any) -> Manifest:
    models = _rank_files(names, ZERO3_MODEL_FILE).get(0, {})
    world = len(optim)
    if sorted(models) != list(range(world)):
        raise CorruptionError(f"ZeRO-3 checkpoint with model-states files of ranks {sorted(models)} for {world} optimizer files")
    model = b.archive(models[0])
    _client_state(b, models[0], model, models[0])
    _refuse_experts(tag_dir, names, model, "under ZeRO-3")
    groups = [{n: tuple(int(x) for x in s) for n, s in g.items()} for g in model.get("param_shapes") or []]
    layout = f"deepspeed zero-{stage} partition"
    all_names: list[str] = []
    master_dtype: dict[str, str] = {}
    first_osd = None
    for rank, fname in optim.items():
        osd = (first if rank == 0 else b.archive(fname))["optimizer_state_dict"]
        first_osd = first_osd or osd
        flats = osd.get("fp32_flat_groups")
        inner = osd.get("optimizer_state_dict", {})
        parts = osd.get("ds_zero_partition_groups") or []
        if flats is None:
            raise CorruptionError(f"{fname}: no fp32_flat_groups (not a ZeRO-3 file)")
        for idx, shapes in enumerate(groups):
            flat = flats[idx]
            state = _group_state(inner, idx)
            meta = parts[idx] if idx < len(parts) and isinstance(parts[idx], dict) else {}
            count, prank = int(meta.get("partition_count", world)), int(meta.get("partition_rank", rank))
            where = f"{fname}:optimizer_state_dict.state.{idx}"
            moments = _flat_moments(b, state, flat, 0, where)
            offset = 0
            for name, shape in shapes.items():
                numel = prod(shape)
                part = -(-numel // count)
                start = prank * part
                n = max(0, min(part, numel - start))
                b.flat(f"model.{name}", shape, flat, offset, min(start, numel), n, layout, rank)
                master_dtype[name] = flat.dtype
                for key, t in moments.items():
                    b.flat(f"optim.state.{name}.{key}", shape, t, offset, min(start, numel), n, layout, rank)
                for t in (flat, *moments.values()):  # the last rank's tail of the parameter's partition
                    b.padding(t, offset + n, min(part, t.numel - offset) - n)
                _step(b, name, state.get("step"), where)
                if rank == 0:
                    all_names.append(name)
                offset += part
            if offset != flat.numel:  # as zero_to_fp32 refuses it: every later parameter would be read shifted
                raise CorruptionError(
                    f"{fname}: fp32_flat_groups[{idx}] holds {flat.numel} elements, where the partitions of its "
                    f"parameters (param_shapes, {count} partitions) take {offset}: the shapes do not describe it")
            for t in (flat, *moments.values()):  # a view's storage past its elements
                b.padding(t, offset, _storage_numel(t) - offset)
    _read_zero3_frozen(b, models, model)
    _check_complete(b)
    _aliases(b, model)
    _module_entries(b, model.get("module"), set(all_names), master_dtype, models[0], zero3=True,
                    buffers=set(model.get("buffer_names") or []))
    if first_osd is not None:
        _param_groups_value(b, first_osd.get("optimizer_state_dict", {}).get("param_groups"))
        for key in ("clip_grad", "partition_count"):
            if key in first_osd:
                b.value(f"deepspeed.{key}", first_osd[key])
    _model_values(b, model, stage, world)
    return b.manifest


def _read_zero3_frozen(b: _Builder, models: dict[int, str], model0: dict[str, Any]) -> None:
    """Parameters the optimizer does not own (``requires_grad=False``): each rank's model-states
    file holds its partition of each in ``frozen_param_fragments`` (``ceil(numel / dp)``
    elements, the last rank's tail padded); the ranks' partitions follow one another in
    numeric rank order, as ``zero_to_fp32`` concatenates them. The copies of rank 0's module
    entries in the other ranks' files are accounted for as replicas."""
    frozen = model0.get("frozen_param_shapes") or {}
    filled: dict[str, int] = {}
    for rank, fname in models.items():
        mr = model0 if rank == 0 else b.archive(fname)
        if rank:
            _client_state(b, fname, mr, models[0], model0)
            for k, t in (mr.get("module") or {}).items():
                if isinstance(t, StoredTensor) and t.numel:
                    b.replica(f"{fname}:module.{k}", f"a replica of the module entry {k!r} of {models[0]}", t)
        if not frozen:
            continue
        frags = mr.get("frozen_param_fragments") or {}
        for name, shape in frozen.items():
            shape = tuple(int(x) for x in shape)
            t = frags.get(name)
            if not isinstance(t, StoredTensor):
                raise CorruptionError(f"{fname}: frozen parameter {name!r} has no entry in frozen_param_fragments")
            at = filled.get(name, 0)
            numel = prod(shape)
            n = max(0, min(t.numel, numel - at))
            b.flat(f"model.{name}", shape, t, 0, min(at, numel), n, "deepspeed zero-3 frozen partition", rank)
            b.padding(t, n, t.numel - n)  # the last rank's tail
            filled[name] = at + t.numel


# ----------------------------------------------------------------------------- universal

UNIVERSAL_STATES = {"fp32": "model.{}", "exp_avg": "optim.state.{}.exp_avg", "exp_avg_sq": "optim.state.{}.exp_avg_sq",
                    "step": "optim.state.{}.step"}


def _read_universal(b: _Builder, tag_dir: str) -> Manifest:
    names = open_storage(tag_dir).names()
    model_file = next((n for n in names if MODEL_FILE.match(n)), None) or next((n for n in names if ZERO3_MODEL_FILE.match(n)), None)
    model = b.archive(model_file) if model_file else {}
    model = model if isinstance(model, dict) else {}
    _client_state(b, model_file or "", model, model_file or "")
    shapes = {n: tuple(int(x) for x in s) for g in model.get("param_shapes") or [] for n, s in g.items()}
    osd = b.archive("zero/optimizer_state.pt")
    osd = osd if isinstance(osd, dict) else {}
    inner = osd.get("optimizer_state_dict") if isinstance(osd.get("optimizer_state_dict"), dict) else {}
    zero = os.path.join(tag_dir, "zero")
    layout = "deepspeed universal"
    for param in open_storage(zero).names():
        for fname in open_storage(os.path.join(zero, param)).names():
            if not fname.endswith(".pt"):
                continue
            key = fname[:-3]
            name = UNIVERSAL_STATES.get(key, "optim.state.{}." + key).format(param)
            where = f"zero/{param}/{fname}"
            obj = b.archive(where)
            t = obj.get("param") if isinstance(obj, dict) else obj
            shape = shapes.get(param)
            if isinstance(t, StoredTensor) and shape is not None and t.shape != shape and len(t.shape) == 1 and t.numel == prod(shape):
                b.flat(name, shape, t, 0, 0, t.numel, layout, 0)  # ds_to_universal's ZeRO-3 output is flat
            elif isinstance(t, StoredTensor):
                b.whole(name, t, layout)
            elif isinstance(t, (int, float)) and not isinstance(t, bool) and key not in ("fp32", "exp_avg", "exp_avg_sq"):
                b.value(name, t)
            elif key in ("fp32", "exp_avg", "exp_avg_sq"):
                raise CorruptionError(f"{where}: its 'param' is {type(t).__name__}, not the parameter's {key} tensor")
            else:
                b.skip(where, f"an optimizer state {key!r} that is neither a tensor nor a number ({type(t).__name__})")
        # ds_to_universal writes no step.pt for ZeRO-3: the step is that of the first group
        if f"model.{param}" in b.manifest.tensors:
            _step(b, param, _group_state(inner, 0).get("step"), "zero/optimizer_state.pt:optimizer_state_dict.state.0")
    groups = osd.get("param_groups")
    if groups is None:
        groups = inner.get("param_groups")
    _param_groups_value(b, groups)
    stage = int(osd.get("zero_stage", 0) or 0)
    counts = osd.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    # DeepSpeed pads each flat group to a multiple of 2 (nccl_start_alignment_factor) x its partition count
    b.alignment = 2 * max((int(c) for c in counts if isinstance(c, int)), default=0)
    read = {n[len("model."):]: e.dtype for n, e in b.manifest.tensors.items() if n.startswith("model.")}
    _module_entries(b, model.get("module"), set(read), read, model_file or "", zero3=stage >= 3,
                    buffers=set(model.get("buffer_names") or []))
    _universal_leftovers(b, osd, model, model_file or "")
    for key in ("clip_grad", "partition_count"):
        if key in osd:
            b.value(f"deepspeed.{key}", osd[key])
    _model_values(b, model, stage, 1)
    b.manifest.provenance["universal"] = True
    return b.manifest


def _universal_leftovers(b: _Builder, osd: dict[str, Any], model: dict[str, Any], model_file: str) -> None:
    """What ``ds_to_universal`` copies beside the merged ``zero/<param>/`` files: rank 0's
    flat partitions and moments in ``zero/optimizer_state.pt`` (ZeRO-3) are replicas of
    what those files hold; rank 0's ``frozen_param_fragments`` in the model-states file are
    part of the frozen parameters reported as skipped."""
    read = {(f.file, f.offset) for e in b.manifest.tensors.values() for f in e.fragments}
    for path, t in _tensor_paths(osd, ""):
        if (t.file, t.offset) not in read:
            b.replica(f"zero/optimizer_state.pt:{path}", "rank 0's flat partition as DeepSpeed saved it, a copy of part "
                      "of the merged zero/<param>/ files (those are read)", t)
    frags = model.get("frozen_param_fragments")
    for name, t in (frags.items() if isinstance(frags, dict) else ()):
        if f"model.{name}" in b.skipped:
            b.own(f"model.{name}", t)


def _tensor_paths(obj: Any, path: str) -> list[tuple[str, StoredTensor]]:
    """Every stored tensor inside nested dicts, lists and Namespaces, with its dotted path."""
    if isinstance(obj, StoredTensor):
        return [(path, obj)]
    if isinstance(obj, argparse.Namespace):
        obj = vars(obj)
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return [found for k, v in items for found in _tensor_paths(v, f"{path}.{k}" if path else str(k))]


def read_deepspeed(path: str, regions: dict[str, list[Region]] | None = None) -> Manifest:
    """The manifest of a DeepSpeed checkpoint (ZeRO 1/2/3 tag directory, its parent with a
    ``latest`` file, or a universal directory); fragments point into DeepSpeed's files.
    ``regions``, when given, receives the declared regions of each ``*.pt`` file read (its
    zip structure, alignment padding, the storages of skipped and replicated tensors) for
    the ledger (:func:`unickpt.adapters.regions.source_ledger`)."""
    found = _resolve(str(path))
    if found is None:
        raise NotACheckpointError(f"{path}: not a DeepSpeed checkpoint (no *_optim_states.pt / *_model_states.pt, "
                                  "no zero/optimizer_state.pt, no latest file naming one)")
    prefix, tag_dir, kind = found
    b = _Builder(str(path), prefix)
    try:
        m = _read_universal(b, tag_dir) if kind == "universal" else _read_zero(b, tag_dir)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
        # a field of the unpickled state is not of the kind DeepSpeed writes (a number as text, a
        # list where a dict belongs, a partition count of 0): named here, not deep inside
        raise CorruptionError(f"{tag_dir}: a field of its state is not what DeepSpeed writes "
                              f"({type(e).__name__}: {e}); nothing was read") from None
    finally:
        b.storage.close()
    b.account(m, regions)
    m.metadata.setdefault("deepspeed", {"tag": prefix.rstrip("/") or os.path.basename(os.path.abspath(tag_dir)), "kind": kind})
    return m
