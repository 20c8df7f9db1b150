"""``unickpt demo``: save a small Llama-like model's DTensor state on 4 ranks (2-D mesh,
Megatron-style tensor parallel + FSDP-style optimizer sharding) and load it back on 2
ranks with a different layout, checking every tensor bitwise.

Everything runs on CPU with gloo ranks (:func:`unickpt.testing.run_ranks`), forked from
one server that imported torch and unickpt once (a spawned rank spends seconds importing
them); no offline conversion happens between the save and the load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The model: a 2-layer Llama-like decoder, dim 64, grouped-query attention (4 query heads,
# 2 key/value heads), SwiGLU feed-forward. The vocabulary (250) does not divide by 4, so
# the 2-D sharded tensors below have uneven shards.
VOCAB, DIM, LAYERS, HEADS, KV_HEADS = 250, 64, 2, 4, 2
HEAD_DIM = DIM // HEADS
HIDDEN = 172  # Llama's 2/3 * 4 * dim, rounded up to a multiple of 4
STEP = 10
SAVE_WORLD, LOAD_WORLD = 4, 2
# imported once by the server the ranks are forked from
RANK_IMPORTS = ["torch", "torch.distributed", "torch.distributed.tensor", "unickpt", "unickpt.demo"]


# the table's legend: why one placement is stored as 1, 2 or 4 fragments
LEGEND = ("layouts: S(d) = Shard(d), R = Replicate(). frags: the fragments stored. Each shard is stored once, however "
          "many ranks hold it: its replicas lay the tensors they share end to end and each writes an equal part, so a "
          "tensor crossing a cut between parts is stored as several row ranges, and one placement can take 1, 2 or 4 "
          "fragments (docs/FORMAT.md, \"Who writes replicas\").")


@contextmanager
def demo_dir(directory: str | os.PathLike | None) -> Iterator[Path]:
    """``directory`` (created if needed, kept: the user asked for it), or else a fresh
    ``unickpt-demo-*`` temporary directory, removed however the demo ends (success,
    failure, Ctrl-C)."""
    if directory is not None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="unickpt-demo-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class Param:
    """One parameter: its name, shape and Megatron-style role."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "embedding" | "colwise" | "rowwise" | "norm"


def params() -> list[Param]:
    """The model's parameters, in torchtitan's naming."""
    out = [Param("tok_embeddings.weight", (VOCAB, DIM), "embedding")]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [
            Param(p + "attention_norm.weight", (DIM,), "norm"),
            Param(p + "attention.wq.weight", (HEADS * HEAD_DIM, DIM), "colwise"),
            Param(p + "attention.wk.weight", (KV_HEADS * HEAD_DIM, DIM), "colwise"),
            Param(p + "attention.wv.weight", (KV_HEADS * HEAD_DIM, DIM), "colwise"),
            Param(p + "attention.wo.weight", (DIM, HEADS * HEAD_DIM), "rowwise"),
            Param(p + "ffn_norm.weight", (DIM,), "norm"),
            Param(p + "feed_forward.w1.weight", (HIDDEN, DIM), "colwise"),
            Param(p + "feed_forward.w2.weight", (DIM, HIDDEN), "rowwise"),
            Param(p + "feed_forward.w3.weight", (HIDDEN, DIM), "colwise"),
        ]
    out += [Param("norm.weight", (DIM,), "norm"), Param("output.weight", (VOCAB, DIM), "colwise")]
    return out


def reference(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The deterministic value of a tensor of the demo's state (seeded by its name)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g)
    if name.endswith("norm.weight") and name.startswith("model."):
        t = 1.0 + 0.1 * t
    elif name.startswith("optim."):
        t = 1e-3 * t
    return t


def _saved_placements(kind: str, optimizer: bool) -> tuple[Any, ...]:
    """Placements on the (dp, tp) mesh at save time."""
    from torch.distributed.tensor import Replicate, Shard

    tp = {"embedding": Shard(0), "colwise": Shard(0), "rowwise": Shard(1), "norm": Replicate()}[kind]
    # Parameters: tensor parallel, replicated over dp. Optimizer state (exp_avg): also
    # sharded over dp on dim 0, as FSDP2 x TP or ZeRO-1 would: (S(0), S(0)) is a 2-D
    # sharding of dim 0, (S(0), S(1)) a grid of blocks.
    return (Shard(0) if optimizer else Replicate(), tp)


def _loaded_placements(kind: str, optimizer: bool) -> tuple[Any, ...]:
    """Placements on the 1-D (fsdp,) mesh at load time: a different layout on fewer ranks."""
    from torch.distributed.tensor import Replicate, Shard

    if kind == "norm":
        return (Shard(0),) if optimizer else (Replicate(),)
    return (Shard(1),) if optimizer else (Shard(0),)


def tensor_specs() -> list[tuple[str, tuple[int, ...], str, bool]]:
    """Every tensor of the demo state: (flattened name, shape, kind, is optimizer state)."""
    out = []
    for p in params():
        out.append((f"model.{p.name}", p.shape, p.kind, False))
    for p in params():
        out.append((f"optim.exp_avg.{p.name}", p.shape, p.kind, True))
    return out


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"model.a.b": x} -> {"model": {"a": {"b": x}}}; flattening gives the names back."""
    root: dict[str, Any] = {}
    for name, v in flat.items():
        *path, last = name.split(".")
        d = root
        for k in path:
            d = d.setdefault(k, {})
        d[last] = v
    return root


def _values() -> dict[str, Any]:
    return {
        "train": {"step": STEP, "tokens_seen": STEP * 8 * 128},
        "optim": {"param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}]},
    }


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            _merge(a[k], v)
        else:
            a[k] = v
    return a


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _save_rank(rank: int, world: int, path: str, result: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import unickpt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat: dict[str, Any] = {}
    for name, shape, kind, opt in tensor_specs():
        flat[name] = distribute_tensor(reference(name, shape), mesh, _saved_placements(kind, opt), src_data_rank=None)
    state = _merge(_nest(flat), _values())
    # Per-rank state (a data-loader position) is stored once per rank, not checked for agreement.
    state["dataloader"] = unickpt.PerRank({"rank": rank, "position": STEP * 8 * (rank + 1)})
    dist.barrier()
    t0 = time.perf_counter()
    unickpt.save(state, path, overwrite=True, metadata={"demo": "llama-like, 2 layers, dim 64", "step": STEP})
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        Path(result).write_text(json.dumps({"save_s": elapsed}))


def _load_rank(rank: int, world: int, path: str, result: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import unickpt
    from unickpt.engine.items import describe_placements

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    flat: dict[str, Any] = {}
    placements: dict[str, tuple[Any, ...]] = {}
    for name, shape, kind, opt in tensor_specs():
        placements[name] = _loaded_placements(kind, opt)
        # Targets start as NaN: anything load does not fill fails the bitwise check.
        flat[name] = distribute_tensor(torch.full(shape, float("nan")), mesh, placements[name], src_data_rank=None)
    target = _merge(_nest(flat), {"train": {"step": 0, "tokens_seen": 0}, "optim": {"param_groups": []}})
    dist.barrier()
    t0 = time.perf_counter()
    unickpt.load(target, path)
    dist.barrier()
    elapsed = time.perf_counter() - t0

    rows = []
    flags = []
    for name, shape, _kind, _opt in tensor_specs():
        d = target
        for k in name.split("."):
            d = d[k]
        ref = reference(name, shape)
        expected_local = distribute_tensor(ref, mesh, placements[name], src_data_rank=None).to_local()
        ok = _bitwise_equal(d.to_local(), expected_local) and _bitwise_equal(d.full_tensor(), ref)
        flags.append(1 if ok else 0)
        rows.append({"name": name, "shape": list(shape), "loaded_layout": describe_placements(placements[name], mesh)})
    agreed = torch.tensor(flags, dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    values_ok = target["train"] == _values()["train"] and target["optim"]["param_groups"] == _values()["optim"]["param_groups"]
    if rank == 0:
        for row, ok in zip(rows, agreed.tolist()):
            row["equal"] = bool(ok)
        Path(result).write_text(json.dumps({"load_s": elapsed, "rows": rows, "values_ok": values_ok}))


def compact_layout(text: str) -> str:
    """``(Replicate(), Shard(dim=0)) on mesh (2, 2)`` -> ``(R, S(0)) on mesh (2, 2)``."""
    text = re.sub(r"Shard\((?:dim=)?(\d+)\)", r"S(\1)", text)
    return text.replace("Replicate()", "R")


@dataclass
class DemoResult:
    """What the demo did: the checkpoint path, per-tensor rows and timings."""

    path: Path
    rows: list[dict[str, Any]]
    values_ok: bool
    verify_ok: bool
    timings: dict[str, float]

    @property
    def ok(self) -> bool:
        """True when every tensor and value came back bitwise equal and verify passed."""
        return self.values_ok and self.verify_ok and all(r["equal"] for r in self.rows)


def run_demo(directory: str | os.PathLike | None = None, console: Any = None) -> DemoResult:
    """Run the demo and print its report on ``console`` (a rich Console)."""
    from rich.console import Console
    from rich.table import Table

    import unickpt
    from unickpt.testing import run_ranks

    console = console or Console()
    keep = directory is not None
    with demo_dir(directory) as base, demo_dir(None) as scratch:
        path = base / f"step_{STEP:06d}"
        timings: dict[str, float] = {}
        console.print(
            f"[bold]unickpt demo[/]: Llama-like decoder ({LAYERS} layers, dim {DIM}, vocab {VOCAB}) "
            f"+ AdamW exp_avg, {len(tensor_specs())} DTensors"
        )
        console.print(f"save on {SAVE_WORLD} ranks, mesh (dp=2, tp=2) -> load on {LOAD_WORLD} ranks, mesh (fsdp=2)")
        with console.status(f"saving on {SAVE_WORLD} spawned ranks..."):
            t0 = time.perf_counter()
            run_ranks(_save_rank, SAVE_WORLD, str(path), os.path.join(scratch, "save.json"), preload=RANK_IMPORTS)
            timings["save_wall"] = time.perf_counter() - t0
        timings["save"] = json.loads(Path(scratch, "save.json").read_text())["save_s"]
        manifest = unickpt.read_manifest(str(path))
        with console.status(f"loading on {LOAD_WORLD} spawned ranks..."):
            t0 = time.perf_counter()
            run_ranks(_load_rank, LOAD_WORLD, str(path), os.path.join(scratch, "load.json"), preload=RANK_IMPORTS)
            timings["load_wall"] = time.perf_counter() - t0
        loaded = json.loads(Path(scratch, "load.json").read_text())
        timings["load"] = loaded["load_s"]
        t0 = time.perf_counter()
        report = unickpt.verify(str(path))
        timings["verify"] = time.perf_counter() - t0

        table = Table(title=f"{SAVE_WORLD} ranks -> {LOAD_WORLD} ranks, resharded on load")
        table.add_column("tensor", overflow="fold")
        table.add_column("shape")
        table.add_column("saved layout")
        table.add_column("frags", justify="right")
        table.add_column("loaded layout")
        table.add_column("equal", justify="center")
        rows = loaded["rows"]
        for row in rows:
            entry = manifest.tensors[row["name"]]
            row["saved_layout"] = entry.layout
            row["fragments"] = len(entry.fragments)
            table.add_row(
                row["name"], "x".join(str(n) for n in row["shape"]), compact_layout(entry.layout),
                str(len(entry.fragments)), compact_layout(row["loaded_layout"]), "[green]✓[/]" if row["equal"] else "[bold red]✗[/]",
            )
        console.print(table)
        console.print(LEGEND, soft_wrap=True)
        n_equal = sum(r["equal"] for r in rows)
        stored = sum(manifest.files.values())
        console.print(
            f"tensors bitwise equal: {n_equal}/{len(rows)}; plain values equal: {'yes' if loaded['values_ok'] else 'NO'}; "
            f"verify: {'OK' if report.ok else 'FAILED'} ({report.bytes_checked} bytes)"
        )
        console.print(
            f"timings: save {timings['save']:.3f} s ({SAVE_WORLD} ranks, {stored / 1024:.0f} KiB in {len(manifest.files)} files; "
            f"{timings['save_wall']:.1f} s with process start), load {timings['load']:.3f} s "
            f"({LOAD_WORLD} ranks; {timings['load_wall']:.1f} s with process start), verify {timings['verify']:.3f} s"
        )
        if keep:
            console.print(f"checkpoint kept at {path}  (try: unickpt inspect {path})")
        return DemoResult(path, rows, bool(loaded["values_ok"]), report.ok, timings)
