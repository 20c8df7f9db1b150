"""Layouts and rank functions for the multi-rank tests (module-level so spawn can import them).

Every tensor's true value is a deterministic function of its name, so any rank (or the
test process) can compute the reference and compare bitwise.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

import unickpt
from unickpt.api.load import load_into

SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w.rowcol": ((7, 5), torch.float32),          # uneven on both dims
    "w.rows": ((10, 3), torch.float32),           # uneven 3,3,3,1 on 4 ranks
    "w.empty": ((3, 2), torch.float32),           # 2 columns over 4 ranks: empty shards
    "w.replrows": ((9, 4), torch.bfloat16),
    "w.twice": ((13, 4), torch.float32),          # one dim sharded by two mesh dims
    "w.cube": ((4, 6, 5), torch.float16),
    "w.ids": ((11,), torch.int64),
    "w.mask": ((6, 3), torch.bool),
    "w.small": ((5,), torch.int8),
    "w.scalar": ((), torch.float32),
    "w.repl": ((3, 3), torch.float32),
}


def reference(name: str) -> torch.Tensor:
    """The true global value of tensor ``name``."""
    shape, dtype = SHAPES[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype in (torch.int64, torch.int8):
        return torch.randint(-100, 100, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


# Layouts per world size: name -> (mesh shape, placements). Placements use ("S", d) / ("R",).
LAYOUTS: dict[str, dict[str, tuple[tuple[int, ...], list[tuple]]]] = {
    "a4": {
        "w.rowcol": ((2, 2), [("S", 0), ("S", 1)]),
        "w.rows": ((4,), [("S", 0)]),
        "w.empty": ((4,), [("S", 1)]),
        "w.replrows": ((2, 2), [("R",), ("S", 0)]),
        "w.twice": ((2, 2), [("S", 0), ("S", 0)]),
        "w.cube": ((2, 2), [("S", 2), ("S", 1)]),
        "w.ids": ((2, 2), [("S", 0), ("R",)]),
        "w.mask": ((2, 2), [("S", 1), ("S", 0)]),
        "w.small": ((4,), [("R",)]),
        "w.scalar": ((2, 2), [("R",), ("R",)]),
        "w.repl": None,  # a plain tensor, identical on every rank
    },
    "b4": {  # another 4-rank layout, for loading what a4 saved
        "w.rowcol": ((2, 2), [("S", 1), ("S", 0)]),
        "w.rows": ((2, 2), [("R",), ("S", 1)]),
        "w.empty": ((2, 2), [("S", 0), ("S", 1)]),
        "w.replrows": ((4,), [("S", 1)]),
        "w.twice": ((4,), [("R",)]),
        "w.cube": ((2, 2), [("S", 0), ("S", 2)]),
        "w.ids": ((4,), [("S", 0)]),
        "w.mask": ((2, 2), [("R",), ("R",)]),
        "w.small": ((2, 2), [("S", 0), ("R",)]),
        "w.scalar": ((4,), [("R",)]),
        "w.repl": ((4,), [("S", 0)]),
    },
    "c3": {
        "w.rowcol": ((3,), [("S", 1)]),
        "w.rows": ((3,), [("S", 0)]),
        "w.empty": ((3,), [("S", 1)]),
        "w.replrows": ((3,), [("R",)]),
        "w.twice": ((3,), [("S", 1)]),
        "w.cube": ((3,), [("S", 0)]),
        "w.ids": ((3,), [("S", 0)]),
        "w.mask": ((3,), [("S", 0)]),
        "w.small": ((3,), [("S", 0)]),
        "w.scalar": ((3,), [("R",)]),
        "w.repl": ((3,), [("S", 0)]),
    },
    "d2": {
        "w.rowcol": ((2,), [("S", 0)]),
        "w.rows": ((2,), [("S", 1)]),
        "w.empty": ((2,), [("R",)]),
        "w.replrows": ((2,), [("S", 1)]),
        "w.twice": ((2,), [("S", 0)]),
        "w.cube": ((2,), [("S", 2)]),
        "w.ids": ((2,), [("R",)]),
        "w.mask": ((2,), [("S", 1)]),
        "w.small": ((2,), [("S", 0)]),
        "w.scalar": ((2,), [("R",)]),
        "w.repl": None,
    },
}

VALUES = {"step": 1234, "lr": 3.0e-4, "schedule": {"warmup": 10, "kind": "cosine"}, "betas": (0.9, 0.95), "note": None}


def _placements(spec: list[tuple]) -> list:
    return [Shard(p[1]) if p[0] == "S" else Replicate() for p in spec]


_MESHES: dict[tuple[int, ...], object] = {}


def _mesh(shape: tuple[int, ...]):
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def build_state(layout: str, fill: bool) -> dict:
    """A state dict in ``layout``: the reference values (fill=True) or zeros/placeholders."""
    sd: dict = {"model": {}, "meta": dict(VALUES) if fill else {k: None for k in VALUES}}
    for name, spec in LAYOUTS[layout].items():
        full = reference(name) if fill else torch.zeros_like(reference(name))
        if spec is None or not dist.is_initialized():
            sd["model"][name] = full
        else:
            mesh_shape, pl = spec
            sd["model"][name] = distribute_tensor(full, _mesh(mesh_shape), _placements(pl))
    return sd


def check_state(sd: dict, where: str) -> None:
    """Every tensor equals its reference bitwise, every value equals VALUES."""
    for name, t in sd["model"].items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        ref = reference(name)
        assert full.dtype == ref.dtype and torch.equal(full, ref), f"{where}: {name} differs after load"
    for k, v in VALUES.items():
        assert sd["meta"][k] == v and type(sd["meta"][k]) is type(v), f"{where}: value {k} = {sd['meta'][k]!r}"


def save_layout(rank: int, world: int, layout: str, path: str) -> None:
    unickpt.save(build_state(layout, fill=True), path)


def load_layout(rank: int, world: int, layout: str, path: str) -> dict:
    sd = build_state(layout, fill=False)
    record = load_into(sd, path)
    check_state(sd, f"rank {rank}/{world} layout {layout} from {path}")
    return record


def world4(rank: int, world: int, root: str) -> None:
    """4 ranks: save layout a4; load a4's checkpoint as b4; load the 3-rank and 1-process ones."""
    save_layout(rank, world, "a4", f"{root}/a4")
    load_layout(rank, world, "b4", f"{root}/a4")
    load_layout(rank, world, "b4", f"{root}/c3")
    load_layout(rank, world, "a4", f"{root}/c3")
    load_layout(rank, world, "b4", f"{root}/single")
    # a subgroup saves alone: ranks 0 and 1 only
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        unickpt.save({"x": torch.arange(6.0), "k": 7}, f"{root}/sub", process_group=sub)
    dist.barrier()
    # same layout: a rank reads exactly the bytes of its own shards, nothing of other shards
    record = load_layout(rank, world, "a4", f"{root}/a4")
    sd = build_state("a4", fill=False)
    needed = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in sd["model"].values())
    assert record.bytes_read == needed, (record, needed)


def world3(rank: int, world: int, root: str) -> None:
    """3 ranks: save layout c3 (before world4 runs)."""
    save_layout(rank, world, "c3", f"{root}/c3")


def world2(rank: int, world: int, root: str) -> None:
    """2 ranks: load every checkpoint as d2; check errors that need several ranks."""
    for src in ("a4", "c3", "single"):
        load_layout(rank, world, "d2", f"{root}/{src}")
    save_layout(rank, world, "d2", f"{root}/d2")
    load_layout(rank, world, "d2", f"{root}/d2")

    # a plain value that differs between ranks is refused, naming the key, on every rank
    try:
        unickpt.save({"step": rank, "same": 1}, f"{root}/bad_value")
    except unickpt.InconsistentStateError as e:
        assert "'step'" in str(e) and "'same'" not in str(e), str(e)
    else:
        raise AssertionError("differing values were saved silently")
    # so is a plain tensor that differs
    try:
        unickpt.save({"t": torch.full((3,), float(rank))}, f"{root}/bad_tensor")
    except unickpt.InconsistentStateError as e:
        assert "'t'" in str(e), str(e)
    else:
        raise AssertionError("differing plain tensors were saved silently")
    dist.barrier()
    import os
    assert not os.path.exists(f"{root}/bad_value/manifest.json")

    # per-rank state round-trips per rank, and can be read whole for resharding
    unickpt.save({"loader": unickpt.PerRank({"pos": rank * 10}), "rng": unickpt.PerRank(torch.full((2,), rank))}, f"{root}/per_rank")
    target = {"loader": unickpt.PerRank(None), "rng": unickpt.PerRank(torch.zeros(2, dtype=torch.int64))}
    unickpt.load(target, f"{root}/per_rank")
    assert target["loader"].value == {"pos": rank * 10}
    assert torch.equal(target["rng"].value, torch.full((2,), rank))
    assert unickpt.load_rank_values(f"{root}/per_rank", "loader") == [{"pos": 0}, {"pos": 10}]

    # a failure on one rank fails the save everywhere and commits nothing
    bad = {"x": torch.zeros(2), "obj": object() if rank == 1 else 3}
    try:
        unickpt.save(bad, f"{root}/one_rank_fails")
    except unickpt.SaveError as e:
        assert "rank 1" in str(e) and "'obj'" in str(e), str(e)
    else:
        raise AssertionError("a failing rank did not fail the save")


_KEPT: list = []


def start_manager(rank: int, world: int, out: str) -> None:
    """Leave a multiprocessing Manager server running, as Megatron-Core's async writer
    does, and write its pid to ``out/rank<r>.pid``."""
    import multiprocessing

    manager = multiprocessing.get_context("spawn").Manager()
    _KEPT.append(manager.Queue())  # referenced from a global, so never shut down by collection
    with open(f"{out}/rank{rank}.pid", "w") as f:
        f.write(str(manager._process.pid))


def loaded_before_fn(rank: int, world: int, names: list[str], out: str) -> None:
    """Rank 0 writes which of ``names`` were imported before fn ran (by the fork server)."""
    import json
    import sys

    if rank == 0:
        with open(out, "w") as f:
            json.dump({n: n in sys.modules for n in names}, f)
