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
  ``deepspeed.clip_grad`` and ``optim.param_groups`` (the hyperparameters of each group).

ZeRO-1/2: each rank's optimizer file holds, per parameter group, one flat fp32 partition
(and flat ``exp_avg`` / ``exp_avg_sq``); ``param_slice_mappings`` gives each parameter's
``(start, numel)`` inside it. A parameter's fragments follow one another in *numeric* rank
order (rank 10 after rank 9), alignment padding is never addressed. ZeRO-3: parameter
``i`` of a group is split alone into ``ceil(numel / dp)`` elements per rank, the last rank's
tail padded; rank ``r`` holds elements ``[r * part, min(numel, (r + 1) * part))``.

Not read (refused with an error or left out): tensor- and pipeline-parallel DeepSpeed
checkpoints (more than one ``mp_rank``), MoE expert files, NVMe-offloaded state, and the
``universal_checkpoint_info`` merge rules (they matter only for tp > 1).
"""

from __future__ import annotations

import os
import re
from math import prod
from typing import Any

from ..errors import CorruptionError, LayoutError, NotACheckpointError, UnickptError
from ..format.dtypes import itemsize
from ..format.manifest import Fragment, Manifest, TensorEntry
from ..format.values import encode_value
from ..plan.box import Box
from ..plan.piece import flat_pieces, whole_piece
from ..storage.local import LocalStorage
from .torch_archive import StoredTensor, read_archive


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


class TensorTypeMarker:
    """Stands in for ``torch.Tensor`` / ``torch.nn.Parameter`` named as the type of a rebuilt
    tensor (``_rebuild_from_type_v2``); the tensor itself is rebuilt as a StoredTensor."""


def _zero_stage(value: Any) -> int:
    return int(value)


ALLOWED = {
    ("deepspeed.utils.tensor_fragment", "fragment_address"): FragmentAddress,
    ("deepspeed.runtime.bf16_optimizer", "fragment_address"): FragmentAddress,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScalerRecord,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): LossScalerRecord,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _zero_stage,
    ("torch", "Tensor"): TensorTypeMarker,
    ("torch.nn.parameter", "Parameter"): TensorTypeMarker,
}

OPTIM_FILE = re.compile(r"^(?:(?:bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MARKERS = ("latest", "latest_universal")


# ----------------------------------------------------------------------------- detection

def _kind(root: str) -> str | None:
    """``"zero"`` or ``"universal"`` for a checkpoint tag directory, else None."""
    storage = LocalStorage(root)
    names = storage.names()
    if any(OPTIM_FILE.match(n) for n in names) and any(MODEL_FILE.match(n) or ZERO3_MODEL_FILE.match(n) for n in names):
        return "zero"
    if storage.exists("zero/optimizer_state.pt"):
        return "universal"
    return None


def _resolve(path: str) -> tuple[str, str, str] | None:
    """(tag prefix relative to ``path`` ('' or 'tag/'), tag directory, kind) or None."""
    kind = _kind(path)
    if kind:
        return "", path, kind
    storage = LocalStorage(path)
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

def _plain(obj: Any) -> Any:
    """A JSON-encodable copy of a pickled value (records become dicts, tensors are dropped)."""
    if isinstance(obj, StoredTensor):
        return None
    if isinstance(obj, DeepSpeedRecord):
        return {k: _plain(v) for k, v in vars(obj).items()}
    if isinstance(obj, dict):
        return {str(k) if not isinstance(k, (int, str)) else k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    if isinstance(obj, (list, set, frozenset)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    return str(obj)


class _Builder:
    """Collects entries, values and files of the manifest being built."""

    def __init__(self, root: str, prefix: str) -> None:
        self.storage = LocalStorage(root)
        self.prefix = prefix
        self.manifest = Manifest()

    def rel(self, name: str) -> str:
        return self.prefix + name

    def archive(self, name: str) -> Any:
        rel = self.rel(name)
        self.manifest.files[rel] = self.storage.size(rel)
        return read_archive(self.storage, rel, allowed=ALLOWED)

    def value(self, key: str, value: Any) -> None:
        try:
            self.manifest.values[key] = encode_value(_plain(value), key)
        except Exception:  # a value DeepSpeed stores that has no plain form: left out
            pass

    def entry(self, name: str, shape: tuple[int, ...], dtype: str, layout: str) -> TensorEntry:
        e = self.manifest.tensors.get(name)
        if e is None:
            e = self.manifest.tensors[name] = TensorEntry(name, tuple(shape), dtype, [], layout)
        elif e.shape != tuple(shape) or e.dtype != dtype:
            raise CorruptionError(f"{name!r}: fragments disagree on shape or dtype ({e.shape}/{e.dtype} vs {shape}/{dtype})")
        return e

    def whole(self, name: str, t: StoredTensor, layout: str, rank: int = 0) -> None:
        if not isinstance(t, StoredTensor):
            raise CorruptionError(f"{name!r}: expected a tensor, found {type(t).__name__}")
        if not t.is_contiguous():
            raise CorruptionError(f"{name!r}: a non-contiguous tensor in {t.file}")
        e = self.entry(name, t.shape, t.dtype, layout)
        if t.numel:
            e.fragments.append(Fragment(t.file, t.offset, t.shape, [whole_piece(t.shape)], [], itemsize(t.dtype), rank))

    def flat(self, name: str, shape: tuple[int, ...], flat: StoredTensor, at: int, start: int, numel: int,
             layout: str, rank: int) -> None:
        """Elements ``[start, start + numel)`` of parameter ``name`` stored at element ``at``
        of the 1-D tensor ``flat``."""
        if not isinstance(flat, StoredTensor) or len(flat.shape) != 1 or (flat.numel > 1 and flat.stride[0] != 1):
            raise CorruptionError(f"{name!r}: the flat partition in {getattr(flat, 'file', '?')} is not a 1-D contiguous tensor")
        if at < 0 or at + numel > flat.numel or start < 0 or start + numel > prod(shape):
            raise CorruptionError(
                f"{name!r}: slice ({at}, {numel}) lies outside the partition of {flat.numel} elements in {flat.file} "
                f"or outside the parameter's {prod(shape)} elements"
            )
        e = self.entry(name, shape, flat.dtype, layout)
        if numel:
            size = itemsize(flat.dtype)
            pieces = flat_pieces(Box.whole(shape), start, start + numel)
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
        "ds_version": _plain(model.get("ds_version")), "step": steps if isinstance(steps, int) else None,
    })


def _module_entries(b: _Builder, module: Any, master: set[str], master_dtype: dict[str, str]) -> None:
    """The module copy: ``module.<p>`` where it differs in dtype from the master, ``model.<n>``
    for what the optimizer does not own; zero-size ZeRO-3 placeholders are skipped."""
    if not isinstance(module, dict):
        return
    for name, t in module.items():
        if not isinstance(t, StoredTensor):
            continue
        if name in master:
            if t.numel and t.dtype != master_dtype.get(name):
                b.whole(f"module.{name}", t, "deepspeed module copy")
        elif f"model.{name}" not in b.manifest.tensors:
            b.whole(f"model.{name}", t, "deepspeed module (not optimized)")


def _step(b: _Builder, name: str, step: Any) -> None:
    """The optimizer step of a parameter's group, recorded once (the first rank holding it)."""
    key = f"optim.state.{name}.step"
    if key in b.manifest.tensors or key in b.manifest.values:
        return
    if isinstance(step, StoredTensor) and step.numel == 1:
        b.whole(key, step, "deepspeed per-group step")
    elif isinstance(step, (int, float)):
        b.value(key, step)


def _check_complete(b: _Builder, names: list[str]) -> None:
    for name in names:
        e = b.manifest.tensors.get(name)
        if e is None:
            continue
        got = sum(prod(f.shape) for f in e.fragments)
        if got != prod(e.shape):
            raise CorruptionError(
                f"{name!r}: the DeepSpeed checkpoint holds {got} of its {prod(e.shape)} elements (missing rank files?)"
            )


# ----------------------------------------------------------------------------- ZeRO 1/2/3

def _rank_files(names: list[str], pattern: re.Pattern[str]) -> dict[int, str]:
    found: dict[int, str] = {}
    mps = set()
    for n in names:
        m = pattern.match(n)
        if m:
            mps.add(int(m.group(2)))
            if int(m.group(2)) == 0:
                found[int(m.group(1))] = n
    if mps - {0}:
        raise LayoutError("DeepSpeed checkpoints with tensor/pipeline model parallelism (mp_rank > 0) are not read yet")
    return dict(sorted(found.items()))  # numeric rank order


def _read_zero(b: _Builder, tag_dir: str) -> Manifest:
    names = LocalStorage(tag_dir).names()
    optim = _rank_files(names, OPTIM_FILE)
    world = len(optim)
    if sorted(optim) != list(range(world)):
        raise CorruptionError(f"{tag_dir}: optimizer files of ranks {sorted(optim)} (some are missing)")
    first = b.archive(optim[0])
    osd0 = first.get("optimizer_state_dict", {}) if isinstance(first, dict) else {}
    stage = int(osd0.get("zero_stage", 1)) if isinstance(osd0, dict) else 1
    if stage >= 3:
        return _read_zero3(b, names, optim, stage)
    model_name = "mp_rank_00_model_states.pt"
    if model_name not in names:
        raise CorruptionError(f"{tag_dir}: {model_name} is missing")
    model = b.archive(model_name)
    shapes: dict[str, tuple[int, ...]] = {}
    for group in model.get("param_shapes") or []:
        for name, shape in group.items():
            shapes[name] = tuple(int(x) for x in shape)
    layout = f"deepspeed zero-{stage} flat partition"
    filled: dict[str, int] = {}
    master_dtype: dict[str, str] = {}
    for rank, fname in optim.items():
        sd = first if rank == 0 else b.archive(fname)
        osd = sd["optimizer_state_dict"]
        fp32 = osd.get("single_partition_of_fp32_groups")
        mappings = osd.get("param_slice_mappings")
        if fp32 is None or mappings is None:
            raise CorruptionError(f"{fname}: no single_partition_of_fp32_groups / param_slice_mappings (not a ZeRO-1/2 file)")
        base = osd.get("base_optimizer_state", {})
        for g, (flat, mapping) in enumerate(zip(fp32, mappings)):
            state = _group_state(base, g)
            flats = {k: v for k, v in state.items() if isinstance(v, StoredTensor) and len(v.shape) == 1 and v.numel == flat.numel}
            for name, addr in mapping.items():
                if name not in shapes:
                    raise CorruptionError(f"{fname}: parameter {name!r} has no shape in {model_name}")
                # in_flat: where the slice lies in this rank's partition; in_param: where it
                # lies in the flattened parameter (after the slices of all lower ranks)
                in_flat, numel = int(getattr(addr, "start", 0)), int(getattr(addr, "numel", 0))
                in_param = filled.get(name, 0)
                b.flat(f"model.{name}", shapes[name], flat, in_flat, in_param, numel, layout, rank)
                master_dtype[name] = flat.dtype
                for key, t in flats.items():
                    b.flat(f"optim.state.{name}.{key}", shapes[name], t, in_flat, in_param, numel, layout, rank)
                _step(b, name, state.get("step"))
                filled[name] = in_param + numel
    _check_complete(b, [f"model.{n}" for n in shapes])
    _module_entries(b, model.get("module"), set(shapes), master_dtype)
    _param_groups_value(b, first["optimizer_state_dict"].get("base_optimizer_state", {}).get("param_groups"))
    for key in ("clip_grad", "partition_count", "group_paddings"):
        if key in osd0:
            b.value(f"deepspeed.{key}", osd0[key])
    _model_values(b, model, stage, world)
    return b.manifest


def _read_zero3(b: _Builder, names: list[str], optim: dict[int, str], stage: int) -> Manifest:
    models = _rank_files(names, ZERO3_MODEL_FILE)
    if 0 not in models:
        raise CorruptionError("ZeRO-3 checkpoint without zero_pp_rank_0_mp_rank_00_model_states.pt")
    model = b.archive(models[0])
    groups = [{n: tuple(int(x) for x in s) for n, s in g.items()} for g in model.get("param_shapes") or []]
    world = len(optim)
    layout = f"deepspeed zero-{stage} partition"
    all_names: list[str] = []
    master_dtype: dict[str, str] = {}
    first_osd = None
    for rank, fname in optim.items():
        osd = b.archive(fname)["optimizer_state_dict"]
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
            moments = {k: v for k, v in state.items() if isinstance(v, StoredTensor) and len(v.shape) == 1 and v.numel == flat.numel}
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
                _step(b, name, state.get("step"))
                if rank == 0:
                    all_names.append(name)
                offset += part
    _check_complete(b, [f"model.{n}" for n in all_names])
    _module_entries(b, model.get("module"), set(all_names), master_dtype)
    if first_osd is not None:
        _param_groups_value(b, first_osd.get("optimizer_state_dict", {}).get("param_groups"))
        for key in ("clip_grad", "partition_count"):
            if key in first_osd:
                b.value(f"deepspeed.{key}", first_osd[key])
    _model_values(b, model, stage, world)
    return b.manifest


# ----------------------------------------------------------------------------- universal

UNIVERSAL_STATES = {"fp32": "model.{}", "exp_avg": "optim.state.{}.exp_avg", "exp_avg_sq": "optim.state.{}.exp_avg_sq",
                    "step": "optim.state.{}.step"}


def _read_universal(b: _Builder, tag_dir: str) -> Manifest:
    names = LocalStorage(tag_dir).names()
    model_file = next((n for n in names if MODEL_FILE.match(n)), None) or next((n for n in names if ZERO3_MODEL_FILE.match(n)), None)
    model = b.archive(model_file) if model_file else {}
    model = model if isinstance(model, dict) else {}
    shapes = {n: tuple(int(x) for x in s) for g in model.get("param_shapes") or [] for n, s in g.items()}
    osd = b.archive("zero/optimizer_state.pt")
    osd = osd if isinstance(osd, dict) else {}
    inner = osd.get("optimizer_state_dict") if isinstance(osd.get("optimizer_state_dict"), dict) else {}
    zero = os.path.join(tag_dir, "zero")
    layout = "deepspeed universal"
    for param in LocalStorage(zero).names():
        for fname in LocalStorage(os.path.join(zero, param)).names():
            if not fname.endswith(".pt"):
                continue
            key = fname[:-3]
            name = UNIVERSAL_STATES.get(key, "optim.state.{}." + key).format(param)
            obj = b.archive(f"zero/{param}/{fname}")
            t = obj.get("param") if isinstance(obj, dict) else obj
            shape = shapes.get(param)
            if isinstance(t, StoredTensor) and shape is not None and t.shape != shape and len(t.shape) == 1 and t.numel == prod(shape):
                b.flat(name, shape, t, 0, 0, t.numel, layout, 0)  # ds_to_universal's ZeRO-3 output is flat
            elif isinstance(t, StoredTensor):
                b.whole(name, t, layout)
            elif isinstance(t, (int, float)):
                b.value(name, t)
        # ds_to_universal writes no step.pt for ZeRO-3: the step is that of the first group
        if f"model.{param}" in b.manifest.tensors:
            _step(b, param, _group_state(inner, 0).get("step"))
    groups = osd.get("param_groups")
    if groups is None:
        groups = inner.get("param_groups")
    _param_groups_value(b, groups)
    stage = int(osd.get("zero_stage", 0) or 0)
    for key in ("clip_grad", "partition_count"):
        if key in osd:
            b.value(f"deepspeed.{key}", osd[key])
    _model_values(b, model, stage, 1)
    b.manifest.provenance["universal"] = True
    return b.manifest


def read_deepspeed(path: str) -> Manifest:
    """The manifest of a DeepSpeed checkpoint (ZeRO 1/2/3 tag directory, its parent with a
    ``latest`` file, or a universal directory); fragments point into DeepSpeed's files."""
    found = _resolve(str(path))
    if found is None:
        raise NotACheckpointError(f"{path}: not a DeepSpeed checkpoint (no *_optim_states.pt / *_model_states.pt, "
                                  "no zero/optimizer_state.pt, no latest file naming one)")
    prefix, tag_dir, kind = found
    b = _Builder(str(path), prefix)
    try:
        m = _read_universal(b, tag_dir) if kind == "universal" else _read_zero(b, tag_dir)
    finally:
        b.storage.close()
    m.metadata.setdefault("deepspeed", {"tag": prefix.rstrip("/") or os.path.basename(os.path.abspath(tag_dir)), "kind": kind})
    return m
