"""Writing DeepSpeed's universal checkpoint layout from any checkpoint unickpt reads.

A DeepSpeed job started with ``"checkpoint": {"load_universal": true}`` and
``engine.load_checkpoint(dst_parent)`` then resumes from a unickpt checkpoint, a PyTorch
DCP checkpoint, a DeepSpeed ZeRO checkpoint of any stage and data-parallel degree, ...:

    dst/                                   (the "tag" directory)
      zero/<param>/fp32.pt                 {"cat_dim": 0, "param": fp32 tensor, full shape}
      zero/<param>/exp_avg.pt              {"cat_dim": 0, "param": ...}   (every optimizer
      zero/<param>/exp_avg_sq.pt           {"cat_dim": 0, "param": ...}    state key of it)
      zero/<param>/step.pt                 the step, a bare 0-dim tensor
      zero/optimizer_state.pt              global optimizer state and param_groups
      mp_rank_00_model_states.pt           step counters and parameter shapes (ZeRO-1/2 jobs)
      zero_pp_rank_0_mp_rank_00_model_states.pt   the same, for ZeRO-3 jobs
    <parent of dst>/latest_universal       the tag, written last

Source names (see :mod:`unickpt.adapters.deepspeed`): ``model.<param>`` is the fp32 master
weight (cast to fp32 if stored otherwise), ``optim.state.<param>.<key>`` the optimizer state;
``module.*`` low-precision copies are not needed. Values ``deepspeed.*`` (from a DeepSpeed
source), ``train.step`` and ``optim.param_groups`` fill the global files.

Differences from ``ds_to_universal`` (deliberate): the files have the layout of its ZeRO-1/2
output whatever the source (its ZeRO-3 output stores flat tensors, no ``step.pt`` and a
ZeRO-3-only ``optimizer_state.pt``, so a ZeRO-1/2 job cannot load it; ours loads into
stages 1, 2 and 3); DeepSpeed's own objects (loss scaler) are not written, so the loading
job keeps its own; ``module`` in the model-states file is empty (a universal load restores
weights from ``zero/`` only); nothing is staged in temporary per-fragment files.

Torch is not imported: whole tensors are assembled as bytes from the source's fragments
(:func:`unickpt.engine.byte_reads.read_whole`) and each file is written as ``torch.save``
writes it by :mod:`unickpt.adapters.torch_save` (``torch.load`` returns the same objects;
``unickpt convert --to deepspeed`` of a DeepSpeed checkpoint runs without torch).

Memory: at most ``max_bytes_in_flight`` of tensors (or the largest tensor) plus, per
thread, a reused buffer of at most ``max_bytes_in_flight / threads``, whatever the
model size. Files are written by several threads and fsynced
together once, before the marker.
"""

from __future__ import annotations

import collections
import mmap
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import LayoutError, SaveError, UnickptError
from ..format.ledger import no_equivalent
from ..format.manifest import Manifest, TensorEntry
from ..format.values import decode_value
from ..storage.files import DurableBatch
from ..storage.local import DIRECT_ALIGNMENT, fsync_path
from ..storage.open import open_storage
from ..storage.transaction import DirectoryWrite
from ..engine.byte_reads import check_whole, read_whole
from ..engine.reads import Scratch
from .checkpoint import OpenCheckpoint, open_checkpoint
from .torch_save import Size, TensorData, archive, write_archive

UNIVERSAL_CHECKPOINT_VERSION = 0.4
DS_VERSION_FALLBACK = "0.19.0"  # ds_version written when the source is not a DeepSpeed checkpoint
MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


@dataclass
class UniversalReport:
    """What :func:`write_universal` wrote."""

    src: str
    dst: str
    params: int
    files: int
    bytes_written: int
    step: int
    seconds: float
    warnings: list[str] = field(default_factory=list)  # what the universal format could not hold (left out)


def _param_states(manifest: Manifest) -> dict[str, dict[str, TensorEntry | Any]]:
    """``param -> {"fp32": entry, "<key>": entry or value}`` in the source's order."""
    out: dict[str, dict[str, Any]] = collections.OrderedDict()
    for name, e in manifest.tensors.items():
        if name.startswith("model."):
            out.setdefault(name[len("model."):], {})["fp32"] = e
    for name, e in manifest.tensors.items():
        if name.startswith("optim.state."):
            param, _, key = name[len("optim.state."):].rpartition(".")
            if param in out and key:
                out[param][key] = e
    for name, v in manifest.values.items():
        if name.startswith("optim.state."):
            param, _, key = name[len("optim.state."):].rpartition(".")
            if param in out and key and key not in out[param]:
                out[param][key] = decode_value(v)
    return out


# the source's values the universal files carry (as global_steps, optimizer and model-state fields)
_DS_VALUES = ("global_steps", "ds_version", "clip_grad", "zero_stage", "partition_count", "group_paddings",
              "lr_scheduler", "skipped_steps", "global_samples", "dp_world_size", "ds_config",
              "mp_world_size", "buffer_names")  # the last two describe the source's layout, rewritten for the new one
_CARRIED_VALUES = {"optim.param_groups", "train.step"} | {f"deepspeed.{k}" for k in _DS_VALUES}


def left_out(manifest: Manifest) -> list[str]:
    """What :func:`write_universal` leaves out of ``manifest``'s checkpoint, one line per
    kind (empty: everything is written); DeepSpeed's universal format holds parameters,
    their optimizer state and a few fields of the training run, nothing else. It can be
    asked before writing anything."""
    params = _param_states(manifest)
    kept = {f"model.{p}" for p in params} | {f"optim.state.{p}.{k}" for p, st in params.items() for k in st}
    kinds = [
        ("tensors that are neither model.<param> nor its optim.state", True, [n for n in manifest.tensors if n not in kept]),
        ("values", True, [n for n in manifest.values if n not in kept and n not in _CARRIED_VALUES]),
        ("per-rank state", False, sorted(set(manifest.rank_values) | set(manifest.rank_tensors))),
    ]
    out = [no_equivalent(what, plural, "DeepSpeed universal", names) for what, plural, names in kinds if names]
    user_metadata = sorted(k for k in manifest.metadata if k != "deepspeed")  # "deepspeed": the source's own tag
    if user_metadata:
        out.append(f"the checkpoint's metadata= ({', '.join(user_metadata)}) has no DeepSpeed universal equivalent "
                   "and was left out")
    return out


def _check_param_name(param: str) -> str:
    p = PurePosixPath(param)
    if not param or "/" in param or "\\" in param or param in (".", "..") or "\x00" in param or p.is_absolute():
        raise SaveError(f"parameter name {param!r} cannot be a DeepSpeed universal directory name")
    return param


def _value(manifest: Manifest, key: str, default: Any = None) -> Any:
    return decode_value(manifest.values[key]) if key in manifest.values else default


def _save(batch: DurableBatch, name: str, obj: Any) -> int:
    with batch.file(name) as f:
        return write_archive(f, obj)


# a file's image in memory: its zip headers (4 KiB-aligned, at most HEAD_ROOM), the tensor's
# bytes, the records after them (at most TAIL_ROOM less the rounding to 4 KiB)
HEAD_ROOM = 16 << 10
TAIL_ROOM = 12 << 10
DIRECT_MIN = 1 << 20  # smaller files go through the page cache (a direct write waits for the disk)


def _anonymous(nbytes: int) -> mmap.mmap:
    """Private anonymous memory (page-aligned; not shared memory, which faults more slowly)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _image(buffers: threading.local, nbytes: int, limit: int) -> mmap.mmap:
    """Page-aligned memory for a file image around a tensor of ``nbytes`` (the tensor at
    ``HEAD_ROOM``): this thread's reused memory when the tensor is at most ``limit`` bytes
    (writing into touched pages is about 3x faster here than into fresh ones), else fresh
    (unmapped when the last view of it goes). Valid until the thread's next call."""
    need = HEAD_ROOM + nbytes + TAIL_ROOM
    if nbytes > limit:
        return _anonymous(need)
    own = getattr(buffers, "image", None)
    if own is None:  # room for the largest reused tensor at once: pages are touched as tensors need them
        own = buffers.image = _anonymous(HEAD_ROOM + limit + TAIL_ROOM)
    return own


def _write_image(batch: DurableBatch, name: str, image: mmap.mmap, t: TensorData, obj: Any) -> int | None:
    """Write ``obj`` (holding ``t``, whose bytes lie at ``HEAD_ROOM`` of ``image``) as the
    archive ``name`` from ``image``, its headers and trailing records put around the
    tensor: one direct write, no copy of the tensor (None when they do not fit around it)."""
    a = archive(obj, data_alignment=DIRECT_ALIGNMENT)
    if len(a.storages) != 1 or memoryview(t.data).nbytes != a.chunks[a.storages[0]].nbytes:
        return None
    head = b"".join(a.chunks[: a.storages[0]])
    tail = b"".join(a.chunks[a.storages[0] + 1 :])
    if len(head) > HEAD_ROOM or len(tail) > TAIL_ROOM - DIRECT_ALIGNMENT or len(head) % DIRECT_ALIGNMENT:
        return None
    start, end = HEAD_ROOM - len(head), HEAD_ROOM + t.nbytes
    image[start:HEAD_ROOM] = head
    image[end : end + len(tail)] = tail
    whole = -(-a.size // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT
    batch.write_whole(name, memoryview(image)[start : start + whole], a.size)
    return a.size


def _as_float32(data: Any, dtype: str) -> Any:
    """The elements of ``data`` (of dtype ``dtype``) as float32 bytes, as torch's
    ``.float()`` converts them (bf16 widened bit for bit; others by the C cast)."""
    import numpy as np

    if dtype == "BF16":
        return (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
    kinds = {"F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
             "U8": np.uint8, "BOOL": np.bool_, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64}
    if dtype in kinds:
        return np.frombuffer(data, kinds[dtype]).astype(np.float32)
    import torch  # float8: numpy has no such dtype

    from ..format.dtypes import dtype_from_name

    return torch.frombuffer(bytearray(data), dtype=dtype_from_name(dtype)).float().numpy()


_SCALARS = {"F32": "<f", "F64": "<d", "F16": "<e", "I64": "<q", "I32": "<i", "I16": "<h", "I8": "<b", "U8": "<B"}


def _scalar(t: TensorData) -> float:
    """The value of a one-element tensor (as ``.item()``)."""
    raw = bytes(memoryview(t.data).cast("B"))
    if t.numel != 1:
        raise LayoutError(f"a step of {t.numel} elements, expected one")
    if t.dtype == "BF16":
        return struct.unpack("<f", b"\0\0" + raw)[0]
    if t.dtype == "BOOL":
        return float(raw != b"\0")
    if t.dtype not in _SCALARS:
        raise LayoutError(f"a step of dtype {t.dtype}")
    return struct.unpack(_SCALARS[t.dtype], raw)[0]


def _float_scalar(x: float) -> TensorData:
    """A 0-d float32 tensor (as ``torch.tensor(x)``)."""
    return TensorData("F32", (), struct.pack("<f", x))


class _ByteBudget:
    """Bounds the bytes of tensors held at once by the writer threads: a holder waits
    until its bytes fit, except when nothing else is held (a tensor larger than the
    budget is then written alone)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of the budget for the ``with`` block."""
        with self._cond:
            self._cond.wait_for(lambda: self.used == 0 or self.used + nbytes <= self.limit)
            self.used += nbytes
        try:
            yield
        finally:
            with self._cond:
                self.used -= nbytes
                self._cond.notify_all()


def _write_documents(batch: DurableBatch, manifest: Manifest, shapes: collections.OrderedDict, first_step: TensorData | None,
                     step: int | None, param_groups: list[dict[str, Any]] | None) -> tuple[int, int, int]:
    """Write ``zero/optimizer_state.pt`` and the model-states files (what a DeepSpeed job
    reads besides the parameters' states); (``global_steps``, files, bytes written)."""
    global_steps = step
    if global_steps is None:
        global_steps = _value(manifest, "deepspeed.global_steps", _value(manifest, "train.step"))
    if global_steps is None and first_step is not None:
        global_steps = int(_scalar(first_step))
    global_steps = int(global_steps or 0)

    groups = param_groups if param_groups is not None else _value(manifest, "optim.param_groups")
    if not isinstance(groups, list) or not groups:
        groups = [{"params": [0]}]
    groups = [dict(g) for g in groups]
    for g in groups:
        g.setdefault("params", [0])
    ds_version = _value(manifest, "deepspeed.ds_version", DS_VERSION_FALLBACK)
    optim_state: dict[str, Any] = {}
    for key in ("clip_grad", "zero_stage", "partition_count", "group_paddings"):
        v = _value(manifest, f"deepspeed.{key}")
        if v is not None:
            optim_state[key] = v
    optim_state["ds_version"] = ds_version
    optim_state["param_groups"] = groups
    step_tensor = first_step if first_step is not None else _float_scalar(float(global_steps))
    # what a ZeRO-3 job reads (the step and the hyperparameters of the first group)
    optim_state["optimizer_state_dict"] = {"state": {0: {"step": step_tensor}}, "param_groups": groups}
    written = _save(batch, "zero/optimizer_state.pt", optim_state)
    files = 1

    lr_scheduler = _value(manifest, "deepspeed.lr_scheduler")
    model_state = {
        "module": collections.OrderedDict(),
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [shapes],
        "frozen_param_shapes": collections.OrderedDict(),
        "shared_params": {},
        "frozen_param_fragments": collections.OrderedDict(),
        "lr_scheduler": lr_scheduler if isinstance(lr_scheduler, dict) else None,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": int(_value(manifest, "deepspeed.skipped_steps", 0) or 0),
        "global_steps": global_steps,
        "global_samples": int(_value(manifest, "deepspeed.global_samples", 0) or 0),
        "dp_world_size": int(_value(manifest, "deepspeed.dp_world_size", manifest.world_size) or 1),
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_version": ds_version,
        "universal_checkpoint_info": {"universal_checkpoint_version": UNIVERSAL_CHECKPOINT_VERSION},
    }
    ds_config = _value(manifest, "deepspeed.ds_config")
    if isinstance(ds_config, dict):
        model_state["ds_config"] = ds_config
    for name in MODEL_FILES:
        written += _save(batch, name, model_state)
        files += 1
    return global_steps, files, written


def write_universal(
    src: str | OpenCheckpoint,
    dst: str,
    *,
    progress: Callable[[int], None] | None = None,
    threads: int = 4,
    max_bytes_in_flight: int = 256 << 20,
    param_groups: list[dict[str, Any]] | None = None,
    step: int | None = None,
    overwrite: bool = False,
    verify: bool = True,
) -> UniversalReport:
    """Write the DeepSpeed universal checkpoint of checkpoint ``src`` (any format unickpt
    reads) to directory ``dst``, then ``latest_universal`` in its parent.

    ``param_groups`` (hyperparameters per optimizer group, DeepSpeed sets them on the
    loading job's groups) defaults to the source's ``optim.param_groups`` value; without one
    a single group with no hyperparameters is written, so the loading job keeps its own.
    ``step`` (DeepSpeed's ``global_steps``) defaults to ``deepspeed.global_steps``, then
    ``train.step``, then the optimizer step of the first parameter. ``progress(n)`` gets
    the bytes of each tensor written.

    ``threads`` files are read and written at once, holding at most ``max_bytes_in_flight``
    bytes of tensors (a larger tensor alone); the files are fsynced together at the end,
    before the marker. The first failure stops the files not yet started and is raised.

    The files are written into a hidden staging directory inside ``dst`` under its lock
    and swapped in at the end (:meth:`~unickpt.storage.transaction.DirectoryWrite.swap_in`):
    a failure or a crash before that leaves an old universal checkpoint in ``dst`` and its
    marker as they were.
    """
    if threads < 1:
        raise UnickptError("write_universal: threads must be >= 1")
    t0 = time.perf_counter()
    ckpt = src if isinstance(src, OpenCheckpoint) else open_checkpoint(src)
    manifest, source, src = ckpt.manifest, ckpt.storage, ckpt.location
    dst_path = Path(dst)
    if dst_path.resolve() == Path(src).resolve():
        raise SaveError("write_universal: the destination must differ from the source")
    if (dst_path / "zero" / "optimizer_state.pt").exists() and not overwrite:
        raise SaveError(f"{dst} already holds a universal checkpoint; pass overwrite=True to replace it")
    params = _param_states(manifest)
    if not params:
        raise UnickptError(f"{src}: no model.<param> tensors to write (names: {sorted(manifest.tensors)[:5]} ...)")
    for p in params:
        _check_param_name(p)
    # the files go to a staging directory inside dst, under dst's lock; the old checkpoint
    # stays whole until swap_in below
    write = DirectoryWrite.begin(dst, "zero/optimizer_state.pt", overwrite, lambda _: False, in_place=True)
    marker_dir = write.root.parent
    tag = write.root.name
    marker = marker_dir / "latest_universal"

    def uncommit() -> None:
        """Remove the marker when it names dst (durably): a crash while the new entries go
        in must not leave a marker naming a half-swapped directory."""
        if marker.is_file() and marker.read_text().strip() == tag:
            marker.unlink()
            fsync_path(marker_dir)

    try:
        jobs = [(param, key, e) for param, states in params.items() for key, e in states.items()]
        for _, _, e in jobs:
            if isinstance(e, TensorEntry):
                check_whole(e)  # before a buffer is sized by it
        shapes = collections.OrderedDict((p, Size(st["fp32"].shape)) for p, st in params.items())
        batch = DurableBatch(write.staging, threads=max(8, threads))
        budget = _ByteBudget(max_bytes_in_flight)
        reuse_limit = max_bytes_in_flight // threads
        buffers = threading.local()
        scratch = Scratch()
        lock = threading.Lock()
        steps: dict[int, TensorData] = {}

        def write_one(index: int) -> int | None:
            """Write one state file; its size, or None for a value that is not a number."""
            param, key, e = jobs[index]
            if isinstance(e, TensorEntry):
                with budget.hold(e.nbytes + (prod(e.shape) * 4 if key == "fp32" and e.dtype != "F32" else 0)):
                    image = _image(buffers, e.nbytes, reuse_limit)
                    data = memoryview(image)[HEAD_ROOM : HEAD_ROOM + e.nbytes]
                    if e.nbytes:
                        read_whole(source, [(e, data)], 16 << 20, verify, None, scratch)
                    if key == "fp32" and e.dtype != "F32":
                        return _write_state(param, key, TensorData("F32", e.shape, _as_float32(data, e.dtype)), index)
                    t = TensorData(e.dtype, e.shape, data)
                    size = _write_image(batch, f"zero/{param}/{key}.pt", image, t, {"cat_dim": 0, "param": t}) \
                        if key != "step" and e.nbytes >= DIRECT_MIN else None
                    if size is None:
                        return _write_state(param, key, t, index)
                    if progress is not None:
                        with lock:
                            progress(t.nbytes)
                    return size
            if isinstance(e, (int, float)):
                return _write_state(param, key, _float_scalar(float(e)), index)
            return None

        def _write_state(param: str, key: str, t: TensorData, index: int) -> int:
            if key == "step":  # a copy, kept after the buffer is reused
                t = TensorData(t.dtype, () if t.numel == 1 else t.shape, bytes(memoryview(t.data).cast("B")))
                steps[index] = obj = t
            else:
                obj: Any = {"cat_dim": 0, "param": t}
            size = _save(batch, f"zero/{param}/{key}.pt", obj)
            if progress is not None:
                with lock:
                    progress(t.nbytes)
            return size

        try:
            with ThreadPoolExecutor(max_workers=threads) as writers:
                futures = [writers.submit(write_one, i) for i in range(len(jobs))]
                try:
                    sizes = [f.result() for f in futures]
                except BaseException:
                    writers.shutdown(cancel_futures=True)
                    raise
        finally:
            source.close()
        written = sum(n for n in sizes if n is not None)
        files = sum(n is not None for n in sizes)
        first_step = steps[min(steps)] if steps else None

        global_steps, doc_files, doc_bytes = _write_documents(batch, manifest, shapes, first_step, step, param_groups)
        files += doc_files
        written += doc_bytes
        batch.commit()
    except BaseException:
        write.abort()
        raise
    write.swap_in(uncommit)
    # the marker last: DeepSpeed follows it only once every file above is durable
    open_storage(marker_dir).write_atomic("latest_universal", tag.encode())
    return UniversalReport(str(src), str(dst), len(params), files + 1, written, global_steps, time.perf_counter() - t0,
                           left_out(manifest))
