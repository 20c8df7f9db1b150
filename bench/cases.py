"""What each rank runs (module level, so spawned ranks can import it). Rank 0 appends one
JSON line per measurement to ``out``; times are wall seconds between barriers."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import unickpt

from . import state as S


def _emit(out: str, **row) -> None:
    if dist.get_rank() == 0:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print("  ", json.dumps(row), flush=True)


def _clear(path: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


SAVERS = {
    "unickpt": lambda sd, p: unickpt.save(sd, p, overwrite=True),
    "dcp": lambda sd, p: dcp.save(sd, checkpoint_id=p),
}
LOADERS = {
    "unickpt": lambda sd, p: unickpt.load(sd, p),
    "dcp": lambda sd, p: dcp.load(sd, checkpoint_id=p),
}


def sync_save_load(rank: int, world: int, cfg: dict) -> None:
    """Sync save and cold load of each state size, unickpt and DCP, best of ``reps``."""
    for total in cfg["sizes"]:
        sd = S.build(total, "rows", fill=True)
        target = S.build(total, "rows", fill=False)
        gbytes = sum(v.numel() * v.element_size() for v in sd.values()) / 1e9
        for lib in ("unickpt", "dcp"):
            path = os.path.join(cfg["root"], f"{lib}_w{world}_{total}")
            saves, loads, was_cold = [], [], True
            for _ in range(cfg["reps"]):
                _clear(path)
                saves.append(S.timed(lambda: SAVERS[lib](sd, path)))
                for v in target.values():
                    v.to_local().zero_()
                was_cold &= S.cold()
                loads.append(S.timed(lambda: LOADERS[lib](target, path)))
            S.check(target, total, "rows")
            _emit(cfg["out"], kind="sync", lib=lib, world=world, bytes=total, save_s=min(saves), load_s=min(loads),
                  save_gbs=gbytes / min(saves), load_gbs=gbytes / min(loads), cold=was_cold, all_save_s=saves, all_load_s=loads)
        sd = target = None  # free before the next size
        if world == 4 and cfg.get("stall"):
            stall(rank, world, cfg, total)


def _train_until(done) -> None:
    """Stand-in for training between saves: small collectives on the default group and
    idle time (as when the GPU computes) until the background save is done."""
    x = torch.ones(256)
    while True:
        dist.all_reduce(x)
        flag = torch.tensor([0 if done() else 1])
        dist.all_reduce(flag)  # every rank stops in the same iteration
        if flag.item() == 0:
            return
        time.sleep(0.02)


def _memcpy_bound(sd: dict) -> float:
    """Seconds to copy this rank's shards into a preallocated, already touched buffer
    (all ranks at once): the floor for staging."""
    locals_ = [v.to_local().reshape(-1) for v in sd.values()]
    buf = torch.empty(sum(t.numel() for t in locals_))
    buf.zero_()
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        at = 0
        for t in locals_:
            buf[at : at + t.numel()].copy_(t)
            at += t.numel()
        times.append(S.max_over_ranks(time.perf_counter() - t0))
    return statistics.median(times)


def _stall_series(cfg: dict, name: str, start, saves: int) -> list[float]:
    """Stall (seconds the training loop is blocked, max over ranks) of ``saves`` saves."""
    stalls = []
    for i in range(saves):
        path = os.path.join(cfg["root"], f"async_{name}_{i}")
        _clear(path)
        dist.barrier()
        t0 = time.perf_counter()
        blocked, done, finish = start(path)
        stalls.append(S.max_over_ranks(time.perf_counter() - t0 - blocked))
        _train_until(done)
        finish()
        _clear(path)
    return stalls


def stall(rank: int, world: int, cfg: dict, total: int) -> None:
    """Training stall per save: unickpt async_save (eager, lazy) vs DCP async_save."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    sd = S.build(total, "rows", fill=True)
    gloo = dist.new_group(backend="gloo")  # DCP must not use the training group (it hangs)
    n = cfg["stall_saves"]
    bound = _memcpy_bound(sd)
    _emit(cfg["out"], kind="memcpy_bound", world=world, bytes=total, rank_bytes=S.local_bytes(sd), seconds=bound)

    def uni(path):
        h = unickpt.async_save(sd, path, overwrite=True)
        return 0.0, h.done, h.result

    def uni_lazy(path):
        h = unickpt.async_save(sd, path, overwrite=True, lazy=True)
        t = time.perf_counter()
        time.sleep(cfg["compute_s"])  # forward/backward on the GPU: the copy runs meanwhile
        slept = time.perf_counter() - t
        h.wait_staged()
        return slept, h.done, h.result

    def dcp_thread(path):
        f = dcp.async_save(sd, checkpoint_id=path, process_group=gloo)
        return 0.0, f.done, f.result

    writer = dcp.FileSystemWriter(cfg["root"], cache_staged_state_dict=True)

    def dcp_cached(path):
        f = dcp.async_save(sd, checkpoint_id=path, storage_writer=writer, process_group=gloo)
        return 0.0, f.done, f.result

    def dcp_process(path):
        f = dcp.async_save(sd, checkpoint_id=path, process_group=gloo, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        return 0.0, f.done, f.result

    modes = [("unickpt", uni), ("unickpt_lazy", uni_lazy), ("dcp_thread", dcp_thread),
             ("dcp_thread_cached", dcp_cached), ("dcp_process", dcp_process)]
    for name, start in modes:
        try:
            stalls = _stall_series(cfg, name, start, n)
        except Exception as e:  # report and go on: one peer mode failing must not end the run
            msg = str(e).splitlines()[0] if str(e) else ""
            _emit(cfg["out"], kind="stall", mode=name, world=world, bytes=total, error=f"{type(e).__name__}: {msg}"[:200])
            continue
        _emit(cfg["out"], kind="stall", mode=name, world=world, bytes=total, first_s=stalls[0],
              steady_s=statistics.median(stalls[1:]) if len(stalls) > 1 else stalls[0], all_s=stalls)
        if name == "unickpt_lazy":
            unickpt.engine.background_save.release_staging()


def reshard_load(rank: int, world: int, cfg: dict) -> None:
    """Load what 4 ranks saved (Shard(0) everywhere) on ``world`` ranks with weights
    Shard(1) and vectors replicated, cold, unickpt vs DCP."""
    for total in cfg["sizes"]:
        target = S.build(total, "cols", fill=False)
        gbytes = sum(v.numel() * v.element_size() for v in target.values()) / 1e9
        for lib in ("unickpt", "dcp"):
            path = os.path.join(cfg["root"], f"{lib}_w4_{total}")
            times, was_cold = [], True
            for _ in range(cfg["reps"]):
                for v in target.values():
                    v.to_local().zero_()
                was_cold &= S.cold()
                times.append(S.timed(lambda: LOADERS[lib](target, path)))
            S.check(target, total, "cols")
            _emit(cfg["out"], kind="reshard", lib=lib, world=world, bytes=total, load_s=min(times),
                  load_gbs=gbytes / min(times), cold=was_cold, all_s=times)
        target = None


def replicated_reads(rank: int, world: int, cfg: dict) -> None:
    """Plain (replicated) tensors loaded on every rank: each rank reads all of them, or
    one rank reads each and broadcasts it (``broadcast_replicated=True``); cold and warm."""
    total = cfg["replicated_bytes"]
    width = 1024
    sd = {f"emb.{i}": torch.full((width, width), float(i)) for i in range(max(1, total // (width * width * 4)))}
    path = os.path.join(cfg["root"], "replicated")
    _clear(path)
    unickpt.save(sd, path, overwrite=True)
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    gbytes = sum(v.nbytes for v in sd.values()) / 1e9
    for cache in ("cold", "warm"):
        for mode in (False, True):
            times = []
            for _ in range(cfg["reps"]):
                if cache == "cold":
                    S.cold()
                times.append(S.timed(lambda: unickpt.load(target, path, broadcast_replicated=mode)))
            assert all(torch.equal(target[k], sd[k]) for k in sd)
            _emit(cfg["out"], kind="replicated", world=world, bytes=int(gbytes * 1e9), cache=cache,
                  mode="broadcast" if mode else "every rank reads", load_s=min(times), all_s=times)
    _clear(path)
