"""The measurements of ``python -m bench.gpu``, one function a part.

Each part runs in a child process of its own (``python -m bench.gpu_parts PART --out DIR
[--dry-run]``) and appends one JSON line per figure to ``DIR/part_PART.jsonl`` as soon as
it has it, so a part that fails or runs out of time still leaves what it measured.
``--dry-run`` runs the same code on the CPU at tiny sizes (no pinned memory, gloo instead
of NCCL): it checks the code paths, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_async_save.py"]


def scratch_dirs(make: bool = True) -> tuple[str, str]:
    """Where a part's scratch goes: in shared memory (``/dev/shm``, else the disk's) and on
    the disk (``$UNICKPT_BENCH_DISK``, else ``.bench_tmp``). ``make``: two fresh folders
    there (``bench.gpu`` makes them for each part, and removes them after it); else the
    two places themselves."""
    disk = os.environ.get("UNICKPT_BENCH_DISK") or os.path.join(ROOT, ".bench_tmp")
    os.makedirs(disk, exist_ok=True)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else disk
    if not make:
        return shm, disk
    return tempfile.mkdtemp(prefix="unickpt-gpu-part-", dir=shm), tempfile.mkdtemp(prefix="gpu_part_", dir=disk)


class Ctx:
    """What every part needs: where figures go, the device, the sizes, scratch folders."""

    def __init__(self, out: str, dry: bool, part: str) -> None:
        import torch

        self.out, self.dry, self.part = out, dry, part
        self.cuda = torch.cuda.is_available() and not dry
        self.dev = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.path = os.path.join(out, f"part_{part}.jsonl")
        shm, disk = scratch_dirs(make=False)
        self.disk = tempfile.mkdtemp(prefix="gpu_", dir=os.environ.get("UNICKPT_BENCH_SCRATCH_DISK") or disk)
        self.shm = tempfile.mkdtemp(prefix="unickpt-gpu-", dir=os.environ.get("UNICKPT_BENCH_SCRATCH_SHM") or shm)

    def sizes(self, full: list[int]) -> list[int]:
        """``full`` GiB on a GPU run; 1 and 4 MiB on a dry run."""
        return [MiB, 4 * MiB] if self.dry else [g * GiB for g in full]

    def emit(self, **figure: Any) -> None:
        """Append one figure (a flat dict) to this part's file."""
        with open(self.path, "a") as f:
            f.write(json.dumps(figure) + "\n")
        print(json.dumps(figure), flush=True)

    def sync(self) -> None:
        """Wait for the device."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> float:
        """Seconds ``fn`` takes, device work included."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def host(self, nbytes: int, pin: bool):
        """A touched uint8 host buffer, pinned when asked and on a GPU run."""
        import torch

        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin and self.cuda)
        buf.fill_(0)
        return buf

    def compute(self, seconds: float) -> None:
        """Stand-in for forward and backward: the device busy for ``seconds`` (the default
        stream, while a lazy copy runs on its side stream), and the host waiting for it as
        a loop that reads its loss does. Without that wait the host would reach
        ``wait_staged`` at once and time the whole copy (as the H200 runs of 2026-11-28 did)."""
        if self.cuda:
            import torch

            torch.cuda._sleep(int(seconds * 1.4e9))  # ~1.4-2 GHz: spins about ``seconds``
            torch.cuda.synchronize()
        else:
            time.sleep(seconds)

    def cleanup(self) -> None:
        """Remove the scratch folders."""
        shutil.rmtree(self.disk, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


def mem_available() -> int:
    """Host memory available now (bytes)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def free_bytes(path: str) -> int:
    """Free bytes of the file system holding ``path``."""
    return shutil.disk_usage(path).free


def make_state(nbytes: int, dev: Any) -> dict[str, Any]:
    """About ``nbytes`` of training state on ``dev``: eight bf16 weights and fp32 moments."""
    import torch

    per = nbytes // 8
    out: dict[str, Any] = {}
    g = torch.Generator(device=dev).manual_seed(0)
    for i in range(8):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        n = per // dtype.itemsize
        out[f"layers.{i}.{'weight' if i % 2 == 0 else 'exp_avg'}"] = torch.randn(n, device=dev, dtype=dtype, generator=g)
    return out


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of the tensors of ``state``."""
    return sum(t.numel() * t.element_size() for t in state.values())


def init_group(ctx: Ctx, store_prefix: str = "gen0") -> Any:
    """A one-rank default group (NCCL for CUDA tensors beside gloo on a GPU run) on a fresh
    TCPStore; returns the store."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    backend = "cpu:gloo,cuda:nccl" if ctx.cuda else "gloo"
    kw = {"device_id": ctx.dev} if ctx.cuda else {}
    dist.init_process_group(backend, store=dist.PrefixStore(store_prefix, store), rank=0, world_size=1, **kw)
    return store


def stage_copy(ctx: Ctx, state: dict[str, Any], buf: Any) -> float:
    """Seconds to copy every tensor of ``state`` into ``buf`` (the pinned limit)."""
    from unickpt.engine.staging import flat_bytes

    def go() -> None:
        off = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            buf[off: off + n].copy_(flat_bytes(t), non_blocking=ctx.cuda)
            off += n

    return min(ctx.timed(go) for _ in range(2))


# --- parts ------------------------------------------------------------------------------


def part_env(ctx: Ctx) -> None:
    """The machine: device, driver, torch, CUDA, NCCL, Python, memory, shm and disk."""
    import platform

    import torch

    fig: dict[str, Any] = {
        "what": "environment", "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count(),
        "host_mem_gib": round(mem_available() / GiB, 1), "shm_free_gib": round(free_bytes(ctx.shm) / GiB, 1),
        "disk_free_gib": round(free_bytes(ctx.disk) / GiB, 1), "dry_run": ctx.dry,
    }
    try:
        import unickpt

        fig["unickpt"] = unickpt.__version__
    except Exception as e:  # noqa: BLE001 - written down, the run goes on
        fig["unickpt"] = f"import failed: {e}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        fig.update(device=p.name, device_mem_gib=round(p.total_memory / GiB, 1), sms=p.multi_processor_count)
        try:
            fig["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001
            fig["nccl"] = f"unknown: {e}"
    try:
        fig["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        fig["driver"] = None
    ctx.emit(**fig)


def part_tests(ctx: Ctx) -> None:
    """The suite's CUDA tests (marker ``cuda``); on a CPU machine they skip and say so."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-o", "addopts=-ra", *CUDA_TESTS]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=float(os.environ.get("GPU_TESTS_TIMEOUT", 600)))
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " skipped" in ln or " failed" in ln
                    or " error" in ln or "no tests ran" in ln), lines[-1] if lines else "")
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    ctx.emit(what="cuda tests", rc=p.returncode, summary=summary.strip("= "), seconds=round(time.perf_counter() - t0, 1),
             failures=failures[:20], tail="\n".join(lines[-40:]) if p.returncode not in (0, 5) else "")
    if p.returncode not in (0, 5):
        raise SystemExit(f"CUDA tests failed: {summary}")


def part_limits(ctx: Ctx) -> None:
    """Device-to-host into pinned and pageable memory, host-to-device, and the cost of
    pinning, at 1 and 4 GiB."""
    import torch

    for n in ctx.sizes([1, 4]):
        src = torch.empty(n, dtype=torch.uint8, device=ctx.dev).fill_(1)
        t0 = time.perf_counter()
        pinned = ctx.host(n, pin=True)
        pin_s = time.perf_counter() - t0
        pageable = ctx.host(n, pin=False)
        d2h_pin = min(ctx.timed(lambda: pinned.copy_(src, non_blocking=ctx.cuda)) for _ in range(3))
        d2h_page = min(ctx.timed(lambda: pageable.copy_(src)) for _ in range(2))
        h2d_pin = min(ctx.timed(lambda: src.copy_(pinned, non_blocking=ctx.cuda)) for _ in range(3))
        h2d_page = min(ctx.timed(lambda: src.copy_(pageable)) for _ in range(2))
        other = ctx.host(n, pin=False)
        memcpy = min(ctx.timed(lambda: other.copy_(pageable)) for _ in range(2))
        gbs = lambda s: round(n / s / 1e9, 2)  # noqa: E731
        ctx.emit(what="limits", mib=n // MiB, d2h_pinned_gbs=gbs(d2h_pin), d2h_pageable_gbs=gbs(d2h_page),
                 h2d_pinned_gbs=gbs(h2d_pin), h2d_pageable_gbs=gbs(h2d_page), host_memcpy_gbs=gbs(memcpy),
                 pin_alloc_gbs=gbs(pin_s), pinned=bool(pinned.is_pinned()))
        src = pinned = pageable = other = None  # freed before the next size


def _wait(resp: Any) -> None:
    """Wait for a DCP async_save's upload (a Future or an AsyncSaveResponse)."""
    done = getattr(resp, "upload_completion", resp)
    done.result()


def part_async_save(ctx: Ctx) -> None:
    """The training stall of one ``async_save`` of 1, 4 and 16 GiB of device state (eager:
    the call; lazy: the call plus ``wait_staged`` after a stand-in for forward/backward),
    the first save (pins its staging buffer) against later ones (reuse it), against a
    pinned copy of the same bytes and DCP's ``async_save`` with its pinned stager."""
    import torch
    import torch.distributed.checkpoint as dcp

    import unickpt
    from unickpt.engine.background_save import staging_bytes

    init_group(ctx)
    sizes = ctx.sizes([1, 4, 16])
    where = ctx.shm if free_bytes(ctx.shm) > 1.3 * sizes[-1] else ctx.disk
    limit_buf = None
    for n in sizes:
        if mem_available() < 3.5 * n or free_bytes(where) < 1.3 * n:
            ctx.emit(what="skipped", mib=n // MiB, why=f"host memory {mem_available() / GiB:.0f} GiB or scratch space "
                     f"{free_bytes(where) / GiB:.0f} GiB too small")
            continue
        state = make_state(n, ctx.dev)
        nb = state_bytes(state)
        if limit_buf is None or limit_buf.numel() < nb:
            limit_buf = None
            limit_buf = ctx.host(nb, pin=True)
        copy_s = stage_copy(ctx, state, limit_buf)
        base = dict(mib=n // MiB, pinned_copy_s=round(copy_s, 4))
        for i in range(3):
            path = os.path.join(where, f"eager_{i}")
            ctx.sync()
            t0 = time.perf_counter()
            h = unickpt.async_save(state, path, overwrite=True)
            stall = time.perf_counter() - t0
            h.result()
            total = time.perf_counter() - t0
            ctx.emit(what="unickpt async_save eager", save=i + 1, stall_s=round(stall, 4), x_pinned_copy=round(stall / copy_s, 2),
                     save_s=round(total, 2), staging_gib=round(staging_bytes() / GiB, 2), **base)
            shutil.rmtree(path, ignore_errors=True)
        for i in range(2):
            path = os.path.join(where, f"lazy_{i}")
            ctx.sync()
            t0 = time.perf_counter()
            h = unickpt.async_save(state, path, overwrite=True, lazy=True)
            call = time.perf_counter() - t0
            ctx.compute(max(0.05, 1.5 * copy_s))
            t1 = time.perf_counter()
            h.wait_staged()
            wait = time.perf_counter() - t1
            h.result()
            ctx.emit(what="unickpt async_save lazy", save=i + 1, stall_s=round(call + wait, 4), call_s=round(call, 4),
                     wait_staged_s=round(wait, 4), x_pinned_copy=round((call + wait) / copy_s, 2), **base)
            shutil.rmtree(path, ignore_errors=True)
        _dcp_stalls(ctx, dcp, state, where, copy_s, base)
        del state
        torch.cuda.empty_cache() if ctx.cuda else None


def _dcp_stalls(ctx: Ctx, dcp: Any, state: dict[str, Any], where: str, copy_s: float, base: dict[str, Any]) -> None:
    """DCP's async_save with its pinned-memory stager (staging in the call), two saves."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as e:
        ctx.emit(what="dcp async_save", error=f"no DefaultStager in this torch: {e}", **base)
        return
    def new_stager() -> Any:
        return DefaultStager(StagingOptions(use_pinned_memory=ctx.cuda, use_shared_memory=False, use_async_staging=False,
                                            use_non_blocking_copy=ctx.cuda))

    stager, note = new_stager(), ""
    try:
        for i in range(2):
            path = os.path.join(where, f"dcp_{i}")
            ctx.sync()
            t0 = time.perf_counter()
            try:
                resp = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
            except Exception as e:  # noqa: BLE001 - torch 2.11's stager failed its second save on an H200
                ctx.emit(what="dcp async_save (pinned stager)", save=i + 1, error=f"{type(e).__name__}: {e}"[:200], **base)
                stager.close()
                stager, note = new_stager(), "a fresh stager (the reused one failed)"
                ctx.sync()
                t0 = time.perf_counter()
                resp = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
            stall = time.perf_counter() - t0
            _wait(resp)
            total = time.perf_counter() - t0
            ctx.emit(what="dcp async_save (pinned stager)", save=i + 1, stall_s=round(stall, 4),
                     x_pinned_copy=round(stall / copy_s, 2), save_s=round(total, 2), note=note, **base)
            shutil.rmtree(path, ignore_errors=True)
    finally:
        stager.close()


def _committed(path: str, t0: float, timeout: float = 120.0) -> float:
    """Seconds from ``t0`` until the file at ``path`` (a snapshot's manifest: the commit) exists."""
    while not os.path.exists(path):
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{path} not written after {timeout} s")
        time.sleep(0.0005)
    return time.perf_counter() - t0


def part_snapshot(ctx: Ctx) -> None:
    """The training stall of an in-memory snapshot (``CheckpointManager(snapshot_every=1)``)
    of 1, 4 and 16 GiB of device state: ``maybe_save`` plus ``before_update`` after a
    stand-in for forward/backward, and with no compute to hide the copy behind; and the
    time until the snapshot is committed in the keeper's shared memory (its manifest
    written) against the pinned device-to-host copy of the same bytes. The first step is
    the first snapshot: the ring was made and pinned in the background at ``restore``."""
    import torch

    import unickpt
    from unickpt.snapshot import job_id

    init_group(ctx)
    os.environ["UNICKPT_SHM_ROOT"] = os.path.join(ctx.shm, "snap")
    for n in ctx.sizes([1, 4, 16]):
        if mem_available() < 5 * n or free_bytes(ctx.shm) < 3.5 * n:
            ctx.emit(what="skipped", mib=n // MiB, why=f"host memory {mem_available() / GiB:.0f} GiB or shm "
                     f"{free_bytes(ctx.shm) / GiB:.0f} GiB too small")
            continue
        state = make_state(n, ctx.dev)
        buf = ctx.host(state_bytes(state), pin=True)
        copy_s = stage_copy(ctx, state, buf)
        del buf
        ckpt = os.path.join(ctx.disk, "snap_ckpt")
        mgr = unickpt.CheckpointManager(ckpt, snapshot_every=1, parity=0,
                                        snapshot_max_bytes=int(3.5 * n))  # a ring of 3 slots of the state
        jdir = os.path.join(os.environ["UNICKPT_SHM_ROOT"], "unickpt", job_id(ckpt))

        def manifest(step: int) -> str:
            return os.path.join(jdir, f"step_{step:08d}", "manifest.json")

        try:
            mgr.restore(state)
            for step in range(1, 5):
                overlap = step % 2 == 1
                ctx.sync()
                t0 = time.perf_counter()
                mgr.maybe_save(state, step)
                call = time.perf_counter() - t0
                if overlap:
                    ctx.compute(max(0.05, 1.5 * copy_s))
                t1 = time.perf_counter()
                mgr.before_update()
                wait = time.perf_counter() - t1
                written = _committed(manifest(step), t0)  # the whole snapshot in the keeper's shared memory
                rate = {} if overlap else {  # behind compute, the commit's time includes the compute
                    "written_s": round(written, 4), "written_gbs": round(n / written / 1e9, 2),
                    "written_x_pinned_d2h": round(copy_s / written, 2)}
                ctx.emit(what="snapshot" + (" behind compute" if overlap else " (no compute)"), mib=n // MiB, step=step,
                         stall_s=round(call + wait, 4), call_s=round(call, 4), before_update_s=round(wait, 4),
                         pinned_copy_s=round(copy_s, 4), x_pinned_copy=round((call + wait) / copy_s, 2), **rate)
            stats = mgr.stats()
            ctx.emit(what="snapshot stats", mib=n // MiB, **{k: stats.get(k) for k in ("snapshots", "snapshots_failed",
                                                                                      "snapshots_skipped", "last_error")})
        finally:
            mgr.close()
        del state
        torch.cuda.empty_cache() if ctx.cuda else None


def _read_cold(ctx: Ctx, path: str) -> float:
    """GB/s reading every file of ``path`` from a cold page cache (the disk limit)."""
    from .machine import drop_caches

    drop_caches()
    total, t0 = 0, time.perf_counter()
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb", buffering=0) as f:
            while chunk := f.read(16 * MiB):
                total += len(chunk)
    return total / (time.perf_counter() - t0) / 1e9


def part_load(ctx: Ctx) -> None:
    """``unickpt.load`` straight into device tensors of 1 and 4 GiB, from a cold and a warm
    page cache, against the disk's cold read and the pinned host-to-device copy."""
    import torch

    import unickpt

    from .machine import drop_caches

    for n in ctx.sizes([1, 4]):
        if mem_available() < 3 * n or free_bytes(ctx.disk) < 1.3 * n:
            ctx.emit(what="skipped", mib=n // MiB, why="host memory or disk too small")
            continue
        ref = make_state(n, "cpu")
        path = os.path.join(ctx.disk, f"load_{n}")
        unickpt.save(ref, path, overwrite=True)
        disk_gbs = _read_cold(ctx, path)
        pinned = ctx.host(state_bytes(ref), pin=True)
        dev_buf = torch.empty(state_bytes(ref), dtype=torch.uint8, device=ctx.dev)
        h2d = min(ctx.timed(lambda: dev_buf.copy_(pinned, non_blocking=ctx.cuda)) for _ in range(3))
        h2d_gbs = state_bytes(ref) / h2d / 1e9
        pinned = dev_buf = None
        target = {k: torch.empty_like(v, device=ctx.dev) for k, v in ref.items()}
        for temp in ("cold", "warm", "warm"):
            cold = drop_caches() if temp == "cold" else False
            s = ctx.timed(lambda: unickpt.load(target, path))
            gbs = state_bytes(ref) / s / 1e9
            equal = all(torch.equal(target[k].cpu(), ref[k]) for k in ref)
            ctx.emit(what=f"load into {ctx.dev.type} ({temp})", mib=n // MiB, seconds=round(s, 3), gbs=round(gbs, 2),
                     disk_cold_gbs=round(disk_gbs, 2), h2d_pinned_gbs=round(h2d_gbs, 2),
                     x_limit=round(gbs / (min(disk_gbs, h2d_gbs) if temp == "cold" else h2d_gbs), 2),
                     caches_dropped=cold, bitwise_equal=equal)
            for t in target.values():
                t.zero_()
        shutil.rmtree(path, ignore_errors=True)
        ref = target = None


def part_restart(ctx: Ctx) -> None:
    """What live recovery saves: a fresh 1-rank process's import -> device context ->
    process group -> first step, against re-forming the group inside the same process
    (tear-down, new group on a fresh store prefix, first step) — by hand with torch, and
    through ``unickpt.run``'s re-forming where this unickpt has it."""
    for _ in range(1 if ctx.dry else 2):  # the first also warms the file cache of torch's libraries (a dry run: once)
        cmd = [sys.executable, "-m", "bench.gpu_parts", "restart_child", "--out", ctx.out, "--spawned", repr(time.time()),
               *(["--dry-run"] if ctx.dry else [])]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
        if p.returncode:
            raise SystemExit(f"restart child failed:\n{p.stderr[-3000:]}")


def restart_child(out: str, dry: bool, spawned: float, started: float) -> None:
    """The child of :func:`part_restart`: times its own start, then re-forms in place."""
    t = {"spawn": spawned, "start": started}
    import torch

    t["import_torch"] = time.time()
    ctx = Ctx(out, dry, "restart")
    import torch.distributed as dist

    import unickpt  # noqa: F401
    from unickpt.api import manager  # noqa: F401  (what a trainer imports)

    t["import_unickpt"] = time.time()
    if ctx.cuda:
        torch.zeros(1, device=ctx.dev)
    t["device_context"] = time.time()
    store = init_group(ctx, "gen0")
    x = torch.ones(1, device=ctx.dev)
    dist.all_reduce(x)
    ctx.sync()
    t["process_group"] = time.time()
    model, opt = _tiny_model(ctx)
    _step(ctx, model, opt)
    t["first_step"] = time.time()
    try:
        _reform_in_process(ctx, t, store, model, opt)
    finally:
        ctx.cleanup()


def _reform_in_process(ctx: Ctx, t: dict[str, float], store: Any, model: Any, opt: Any) -> None:
    """Figures of the fresh start in ``t``, then two re-formings by hand and one by unickpt.run."""
    import torch
    import torch.distributed as dist

    phases = ["start", "import_torch", "import_unickpt", "device_context", "process_group", "first_step"]
    fig = {f"{b}_s": round(t[b] - t[a], 3) for a, b in zip(["spawn", *phases], phases)}
    ctx.emit(what="fresh process (1 rank)", total_s=round(t["first_step"] - t["spawn"], 3), **fig)
    for gen in (1, 2):
        t0 = time.perf_counter()
        _tear_down(ctx)
        t1 = time.perf_counter()
        backend = "cpu:gloo,cuda:nccl" if ctx.cuda else "gloo"
        kw = {"device_id": ctx.dev} if ctx.cuda else {}
        dist.init_process_group(backend, store=dist.PrefixStore(f"gen{gen}", store), rank=0, world_size=1, **kw)
        x = torch.ones(1, device=ctx.dev)
        dist.all_reduce(x)
        ctx.sync()
        t2 = time.perf_counter()
        _step(ctx, model, opt)
        t3 = time.perf_counter()
        ctx.emit(what="re-form in process (torch)", generation=gen, total_s=round(t3 - t0, 3), tear_down_s=round(t1 - t0, 3),
                 new_group_s=round(t2 - t1, 3), first_step_s=round(t3 - t2, 3))
    _tear_down(ctx)
    _reform_with_run(ctx)


def _tear_down(ctx: Ctx) -> None:
    """Drop the default group: NCCL's is aborted (never destroyed after a fault), gloo's destroyed."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if ctx.cuda and abort is not None:
        abort()
    else:
        dist.destroy_process_group()


def _reform_with_run(ctx: Ctx) -> None:
    """Time ``unickpt.run``'s own tear-down and re-forming (its parts: the membership on a
    control plane hosted here as ``unickpt launch`` hosts it, ``regroup``'s tear-down and
    forming): generation 0 formed, then generations 1 and 2 published for the same member,
    as a re-forming publishes them."""
    import torch.distributed as dist

    from unickpt.live import control, membership, regroup
    from unickpt.store_client import connect

    host = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    store, worker = connect(f"127.0.0.1:{host.port}"), "0.0"
    backend = "cpu:gloo,cuda:nccl" if ctx.cuda else "gloo"
    if ctx.cuda:
        import torch

        torch.cuda.set_device(ctx.dev)
    # published and read on one connection: a TCPStore's set is not answered, so a read on
    # another connection could pass it (the newest generation not there yet: the read of
    # generation -1 waited for ever, 1 run in ~10 under load); the launcher's workers read
    # a generation only after its mail, which follows the publish on the same connection
    control.publish(store, control.Generation(0, [worker]))
    gen = membership.newer(store, worker)
    membership.arrive(store, gen)
    regroup.form(store, gen.number, 0, 1, backend)
    model, opt = _tiny_model(ctx)
    _step(ctx, model, opt)
    for number in (1, 2):
        control.publish(store, control.Generation(number, [worker], cause="grow", joined=[]))
        t0 = time.perf_counter()
        regroup.teardown(crashed=True)
        t1 = time.perf_counter()
        gen = membership.newer(store, worker)
        membership.arrive(store, gen)
        regroup.form(store, gen.number, 0, 1, backend)
        t2 = time.perf_counter()
        _step(ctx, model, opt)
        t3 = time.perf_counter()
        ctx.emit(what="re-form in process (unickpt.run)", generation=number, total_s=round(t3 - t0, 3),
                 tear_down_s=round(t1 - t0, 3), new_group_s=round(t2 - t1, 3), first_step_s=round(t3 - t2, 3))
    regroup.teardown(crashed=False)


def _tiny_model(ctx: Ctx):
    """A small MLP and its AdamW: the first step's cost (kernels, optimizer state)."""
    import torch

    torch.manual_seed(0)
    width = 256 if ctx.dry else 4096
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(ctx.dev)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(ctx: Ctx, model: Any, opt: Any) -> None:
    """One training step with a gradient all-reduce."""
    import torch
    import torch.distributed as dist

    x = torch.randn(8, model[0].in_features, device=ctx.dev)
    model(x).square().mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    ctx.sync()


PARTS: dict[str, Callable[[Ctx], None]] = {
    "env": part_env, "tests": part_tests, "limits": part_limits, "async_save": part_async_save,
    "snapshot": part_snapshot, "load": part_load, "restart": part_restart,
}


def main(argv: list[str] | None = None) -> None:
    """Run one part (see the module's docstring)."""
    started = time.time()
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_parts")
    ap.add_argument("part", choices=[*PARTS, "restart_child"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--spawned", type=float, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    if args.part == "restart_child":
        restart_child(args.out, args.dry_run, args.spawned or started, started)
    else:
        ctx = Ctx(args.out, args.dry_run, args.part)
        try:
            PARTS[args.part](ctx)
        finally:
            ctx.cleanup()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
