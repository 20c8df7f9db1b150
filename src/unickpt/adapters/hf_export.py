"""Export the model of a unickpt checkpoint as a Hugging Face safetensors folder.

    DST/model-00001-of-00003.safetensors ... model.safetensors.index.json [config.json]

Straight from any checkpoint ``unickpt.read_manifest`` opens (sharded on any layout,
consolidated, or a foreign format), streaming: tensors are read one at a time (assembled
from their fragments, every checksum verified), renamed (and, for q/k, reordered: see
``unickpt.rules.hf``), cast when asked, and written at offsets known up front (each
shard's safetensors header is computed from the manifest's shapes and dtypes before any
data). Memory is bounded by about three times the largest tensor (the tensor, its
reordered copy, its cast), whatever the size of the model.

Each shard is fsynced; ``config.json`` then ``model.safetensors.index.json`` are written
last, atomically: a folder whose index exists holds complete shards. Shards are cut like
``transformers``' ``save_pretrained``: tensors in checkpoint order, a new shard when the
next tensor would push the current one past ``max_shard_size`` (a larger tensor gets a
shard of its own).

Every tensor of the source is exported or reported. The model is the tensors named
``prefix...``: ``model.`` for a training checkpoint (the other tensors, optimizer state,
are *left out*, and listed), none for a checkpoint converted from a Hugging Face folder,
whose tensors all belong to the model (``model.*`` and ``lm_head.weight``). A tensor of
such a model that an explicit ``prefix`` leaves out is *dropped* data: the plan names it
and the command line refuses it unless ``--allow-skip`` is given.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch

from ..engine.tensor_reads import read_entry
from ..errors import UnickptError
from ..format.dtypes import dtype_from_name, itemsize
from ..format.ledger import Ledger
from ..format.manifest import MANIFEST_NAME, Manifest, TensorEntry
from ..format.safetensors_header import Entry, build_header
from ..format.values import decode_value
from ..rules.hf import MAPPINGS, HfMapping, heads_from_config, llama_config, rotary_to_hf, split_fused, split_shape
from ..storage.base import Storage
from ..storage.open import open_storage, same_location
from ..storage.output import OutputFolder, begin_output
from ..storage.files import cleans_up_output
from .hf import CONFIG_NAME, INDEX_NAME, HfError
from .checkpoint import OpenCheckpoint, open_checkpoint
from .regions import source_ledger

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_DTYPES = {"fp32": "F32", "float32": "F32", "f32": "F32", "fp16": "F16", "float16": "F16", "f16": "F16",
           "half": "F16", "bf16": "BF16", "bfloat16": "BF16", "fp64": "F64", "float64": "F64", "f64": "F64"}
_FLOATS = {"F64", "F32", "F16", "BF16"}
_TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_OLD_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def parse_size(text: str | int) -> int:
    """Bytes of a size such as ``5GB`` (10^9, as ``transformers``), ``500MiB`` (2^20) or ``1000``."""
    if isinstance(text, int):
        n = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
        if not m:
            raise HfError(f"invalid size {text!r}: write a number of bytes or e.g. 500MB, 5GB, 2GiB")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if n <= 0:
        raise HfError(f"invalid size {text!r}: it must be positive")
    return n


def parse_dtype(text: str | None) -> str | None:
    """The safetensors dtype name of ``bf16`` / ``fp16`` / ``fp32`` / ``fp64`` (and their long names)."""
    if text is None:
        return None
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise HfError(f"unknown dtype {text!r} (known: bf16, fp16, fp32, fp64)") from None


@dataclass
class OutTensor:
    """One exported tensor: its HF name, the checkpoint entry it comes from, its output
    dtype, the head count of its rotary row reordering (None: none), and, for a part of a
    fused entry (Megatron's QKV, SwiGLU's fc1), the split kind, part index and head counts."""

    hf_name: str
    entry: TensorEntry
    dtype: str
    rotary_heads: int | None = None
    split: str | None = None
    part: int = 0
    heads: dict[str, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The exported tensor's shape (a part's, for a fused entry)."""
        return self.entry.shape if self.split is None else split_shape(self.entry.shape, self.split, self.part, self.heads)

    @property
    def nbytes(self) -> int:
        """Bytes in the output file."""
        return prod(self.shape) * itemsize(self.dtype)


@dataclass
class ExportPlan:
    """What an export writes: tensors (in order), the name mapping used, config.json."""

    tensors: list[OutTensor]
    names: str
    config: dict[str, Any] | None = None
    prefix: str = "model."
    left_out: dict[str, str] = field(default_factory=dict)  # not model weights: optimizer state, per-rank state
    dropped: dict[str, str] = field(default_factory=dict)  # model weights the prefix leaves out

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data written."""
        return sum(t.nbytes for t in self.tensors)


@dataclass
class ExportReport:
    """What :func:`export_hf` did."""

    dst: str
    tensors: int
    shards: list[str]
    bytes_written: int
    names: str
    config_written: bool
    seconds: float
    weight_map: dict[str, str] = field(default_factory=dict)
    ledger: Ledger | None = None  # the source's: exported, left out, skipped, unaccounted


def _architecture(manifest: Manifest, config: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, int] | None, dict[str, Any] | None]:
    """(model_args, head counts, config to write verbatim) from the user's config, the
    trainer's ``model_args`` values or an imported folder's ``metadata.hf_config``."""
    if config is not None:
        return None, _heads_or_none(config), config
    args = {k[len("model_args."):]: decode_value(v) for k, v in manifest.values.items() if k.startswith("model_args.")}
    if args:
        try:
            return args, {"heads": int(args["heads"]), "kv_heads": int(args.get("kv_heads") or args["heads"])}, None
        except (KeyError, TypeError, ValueError):
            raise HfError("the checkpoint's model_args give no valid head counts; pass --config") from None
    hf = decode_value(manifest.metadata["hf_config"]) if "hf_config" in manifest.metadata else None
    if isinstance(hf, dict):
        return None, _heads_or_none(hf), hf
    return None, None, None


def _heads_or_none(config: dict[str, Any]) -> dict[str, int] | None:
    """Head counts of an HF config; None when it has none (only q/k reordering needs them)."""
    try:
        return heads_from_config(config)
    except UnickptError:
        return None


def from_hf(manifest: Manifest) -> bool:
    """True when the checkpoint is a Hugging Face folder, or was converted from one: its
    tensor names are HF names, all of the model."""
    origin = manifest.provenance.get("consolidated_from")
    return manifest.provenance.get("format") == "hf" or (isinstance(origin, dict) and origin.get("format") == "hf")


def default_prefix(manifest: Manifest) -> str:
    """The prefix of the model's tensors: none for a Hugging Face model, ``model.`` else."""
    return "" if from_hf(manifest) else "model."


def plan_hf_export(
    manifest: Manifest, *, names: str = "auto", prefix: str | None = None, dtype: str | None = None,
    config: dict[str, Any] | None = None,
) -> ExportPlan:
    """Choose the tensors (those named ``prefix...``, prefix removed; ``prefix`` None:
    :func:`default_prefix`), their HF names (``names``: ``"llama"``, ``"keep"``, or
    ``"auto"`` = llama when every name fits it), output dtypes (``dtype``:
    ``bf16``/``fp16``/``fp32`` casts floating tensors) and the config.json (``config``
    verbatim; else built from the checkpoint's ``model_args`` for a known architecture;
    else an imported folder's config; else none). Every other tensor is listed in the
    plan's ``left_out`` (not model weights) or ``dropped`` (a Hugging Face model's)."""
    out_dtype = parse_dtype(dtype)
    if prefix is None:
        prefix = default_prefix(manifest)
    picked = [(n[len(prefix):], e) for n, e in manifest.tensors.items() if n.startswith(prefix)]
    left_out: dict[str, str] = {}
    dropped: dict[str, str] = {}
    for n in manifest.tensors:
        if not n.startswith(prefix):
            if from_hf(manifest):
                dropped[n] = f"it is not named {prefix!r}... (--prefix), yet every tensor of a Hugging Face model is a model weight"
            else:
                left_out[n] = f"export writes the model only: the tensors named {prefix!r}... (--prefix)"
    for n in manifest.rank_tensors:
        left_out[n] = "export writes the model only, not per-rank state"
    if not picked:
        raise HfError(f"the checkpoint holds no tensor named {prefix!r}...; pass --prefix (e.g. --prefix '' for all)")
    if names not in ("auto", "keep") and names not in MAPPINGS:
        raise HfError(f"unknown name mapping {names!r} (known: auto, keep, {', '.join(MAPPINGS)})")
    mapping: HfMapping | None = None
    if names != "keep":
        for cand in [MAPPINGS[names]] if names in MAPPINGS else list(MAPPINGS.values()):
            unknown = [n for n, _ in picked if cand.hf_name(n) is None]
            if not unknown:
                mapping = cand
                break
            if names != "auto":
                raise HfError(f"{len(unknown)} tensors do not fit the {cand.name} names, e.g. {prefix + unknown[0]!r}")
    args, heads, verbatim = _architecture(manifest, config)
    tensors = []
    for name, e in picked:
        parts = mapping.hf_parts(name) if mapping else [(name, None, None, 0)]
        for hf_name, rotary, split, part in parts:  # type: ignore[union-attr]
            if (rotary is not None or split == "qkv") and heads is None:
                raise HfError(
                    f"{prefix}{name} needs its rows reordered for HF's layout, which needs the head counts: "
                    "the checkpoint has no model_args (older trainer?); pass --config with num_attention_heads "
                    "and num_key_value_heads"
                )
            cast = out_dtype if out_dtype and e.dtype in _FLOATS else e.dtype
            tensors.append(OutTensor(hf_name, e, cast, None if rotary is None else heads[rotary],  # type: ignore[index]
                                     split, part, heads))
    seen: set[str] = set()
    for t in tensors:
        if t.hf_name in seen:
            raise HfError(f"two tensors map to the HF name {t.hf_name!r}")
        seen.add(t.hf_name)
    plan = ExportPlan(tensors, mapping.name if mapping else "keep", verbatim, prefix, left_out, dropped)
    if plan.config is None and args is not None and mapping is not None and mapping.name == "llama":
        float_dtypes = [t.dtype for t in tensors if t.dtype in _FLOATS]
        plan.config = llama_config(args, {t.hf_name: t.entry.shape for t in tensors}, _TORCH_NAMES[float_dtypes[0]] if float_dtypes else "float32")
    return plan


def split_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into consecutive shards of at most ``max_bytes`` each
    (a larger item alone in its shard)."""
    shards: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if cur and total + n > max_bytes:
            shards.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur or not shards:
        shards.append(cur)
    return shards


def _read(storage: Storage, t: OutTensor, threads: int) -> torch.Tensor:
    """The whole tensor, assembled from its fragments (checksums verified), in HF form."""
    e = t.entry
    out = read_entry(storage, e, threads)
    if t.split is not None:
        out = split_fused(out, t.split, t.heads)[t.part]
    if t.rotary_heads is not None:
        out = rotary_to_hf(out, t.rotary_heads)
    if t.dtype != e.dtype:
        out = out.to(dtype_from_name(t.dtype))
    return out.contiguous()


def _check_dst(src: str, dst: str, overwrite: bool, storage_options: dict[str, Any] | None) -> None:
    if same_location(src, dst):
        raise HfError("export: the destination must differ from the source")
    present = open_storage(dst, storage_options).names()
    if MANIFEST_NAME in present:
        raise HfError(f"{dst} holds a unickpt checkpoint; export into another folder")
    old = [f for f in present if f == INDEX_NAME or _OLD_SHARD.fullmatch(f)]
    if old and not overwrite:
        raise HfError(f"{dst} already holds a Hugging Face export ({old[0]}); pass --overwrite to replace it")


@cleans_up_output
def export_hf(
    src: str | OpenCheckpoint,
    dst: str,
    *,
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    names: str = "auto",
    prefix: str | None = None,
    config: dict[str, Any] | None = None,
    threads: int = 4,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ExportReport:
    """Write the model of checkpoint ``src`` as a Hugging Face folder ``dst`` (see the
    module docstring and :func:`plan_hf_export` for ``names``, ``prefix``, ``dtype`` and
    ``config``). ``progress(n)`` gets the bytes of each tensor written. The report's
    ledger lists what was exported and every tensor of the source that was not (left out,
    dropped by the prefix, or skipped by the source's reader); the caller decides whether
    that is acceptable (the command line refuses dropped or skipped tensors). ``src`` and
    ``dst`` may be URLs (``storage_options`` for their file system). The index, written
    last, completes the export; on a local file system an old export in ``dst`` stays
    whole until then (:mod:`unickpt.storage.output`), files of other names stay."""
    t0 = time.perf_counter()
    max_bytes = parse_size(max_shard_size)
    ckpt = src if isinstance(src, OpenCheckpoint) else open_checkpoint(src, storage_options)
    source = ckpt.storage
    folder: OutputFolder | None = None
    try:
        manifest = ckpt.manifest
        plan = plan_hf_export(manifest, names=names, prefix=prefix, dtype=dtype, config=config)
        _check_dst(ckpt.location, str(dst), overwrite, storage_options)
        with_config = plan.config is not None
        folder = begin_output(str(dst), INDEX_NAME, lambda n: n == INDEX_NAME or bool(_OLD_SHARD.fullmatch(n))
                              or (with_config and n == CONFIG_NAME), storage_options)
        out = folder.storage
        groups = split_shards([t.nbytes for t in plan.tensors], max_bytes)
        shard_names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        weight_map: dict[str, str] = {}
        written = 0
        for fname, group in zip(shard_names, groups):
            items = [plan.tensors[i] for i in group]
            head, offsets = build_header([Entry(t.hf_name, t.dtype, t.shape, t.nbytes) for t in items], {"format": "pt"})
            writer = out.open_writer(fname, len(head) + sum(t.nbytes for t in items))
            try:
                writer.pwrite(0, head)
                for t, at in zip(items, offsets):
                    data = _read(source, t, threads)
                    if data.numel():
                        writer.pwrite(at, memoryview(data.reshape(-1).view(torch.uint8).numpy()))
                    del data
                    written += t.nbytes
                    weight_map[t.hf_name] = fname
                    if progress is not None:
                        progress(t.nbytes)
            except BaseException:
                writer.close(durable=False)
                out.remove(fname)
                raise
            writer.close(durable=True)
        documents = {CONFIG_NAME: (json.dumps(plan.config, indent=2) + "\n").encode()} if with_config else {}
        index = {"metadata": {"total_size": written, "total_parameters": sum(prod(t.shape) for t in plan.tensors)},
                 "weight_map": weight_map}
        documents[INDEX_NAME] = (json.dumps(index, indent=2) + "\n").encode()
        folder.commit(documents)
    except BaseException:
        if folder is not None:
            folder.abort()
        raise
    finally:
        source.close()
    return ExportReport(str(dst), len(plan.tensors), shard_names, written, plan.names, plan.config is not None,
                        time.perf_counter() - t0, weight_map, export_ledger(ckpt, manifest, plan))


def export_ledger(src: str | OpenCheckpoint, manifest: Manifest, plan: ExportPlan) -> Ledger:
    """The source's ledger as an export sees it: the exported tensors read; the others
    left out, or skipped (dropped by the prefix, or skipped by the source's reader)."""
    ledger = source_ledger(src)
    ledger.tensors = len({t.entry.name for t in plan.tensors})
    ledger.per_rank = 0  # per-rank state is never exported: it is among the left-out items
    ledger.bytes_read = sum({t.entry.name: t.entry.nbytes for t in plan.tensors}.values())  # a fused entry once
    ledger.left_out = dict(plan.left_out)
    ledger.skipped.update(plan.dropped)
    return ledger
