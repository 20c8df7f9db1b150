"""The machine's own limits, measured in the benchmark's run: disk write with fsync,
disk read from a cold page cache, memory copy bandwidth."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from unickpt.storage.local import start_writeback

CHUNK = 16 << 20


def best_time(fn, reps: int = 3, before=None) -> float:
    """Best wall time of ``reps`` calls of ``fn`` (``before`` runs untimed before each)."""
    out = float("inf")
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache (needs root); False if not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False



def _each(one, offs: range, threads: int) -> None:
    """Call ``one(off)`` for every offset, inline or from ``threads`` threads."""
    if threads == 1:
        for off in offs:
            one(off)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, offs))


def _write(paths: list[str], data: memoryview, threads: int, kick: bool) -> float:
    """GB/s writing ``data`` split over ``paths`` (one file each) in 16 MiB pwrites from
    ``threads`` threads, then fsync of every file."""
    part = -(-data.nbytes // len(paths) // CHUNK) * CHUNK
    fds = []
    for i, p in enumerate(paths):
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, max(0, min(part, data.nbytes - i * part)))
        fds.append(fd)
    t0 = time.perf_counter()

    def one(off: int) -> None:
        fd = fds[off // part]
        view = data[off : off + CHUNK]
        os.pwrite(fd, view, off % part)
        if kick:
            start_writeback(fd, off % part, view.nbytes)

    _each(one, range(0, data.nbytes, CHUNK), threads)
    for fd in fds:
        os.fsync(fd)
        os.close(fd)
    return data.nbytes / (time.perf_counter() - t0) / 1e9


def _read(paths: list[str], buf: memoryview, threads: int) -> float:
    """GB/s reading the files back into ``buf`` in 16 MiB preads from ``threads`` threads."""
    part = -(-buf.nbytes // len(paths) // CHUNK) * CHUNK
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    t0 = time.perf_counter()

    def one(off: int) -> None:
        os.preadv(fds[off // part], [buf[off : off + CHUNK]], off % part)

    _each(one, range(0, buf.nbytes, CHUNK), threads)
    for fd in fds:
        os.close(fd)
    return buf.nbytes / (time.perf_counter() - t0) / 1e9


def measure(directory: str, nbytes: int, reps: int = 2) -> dict[str, float]:
    """Best-of-``reps`` GB/s of: write+fsync in one stream (as ``dd conv=fsync``); in 4
    threads with early writeback, into one file and into 4 files (as 4 ranks do); cold
    reads (page cache dropped) in one stream, 4 threads on one file, 4 threads on 4 files;
    page-cache reads; memcpy into a touched buffer and into fresh memory."""
    os.makedirs(directory, exist_ok=True)
    one = [os.path.join(directory, "machine.bin")]
    four = [os.path.join(directory, f"machine{i}.bin") for i in range(4)]
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    data = memoryview(src.numpy())
    dst = torch.empty_like(src)
    dst.fill_(0)
    buf = memoryview(dst.numpy())
    out: dict[str, float] = {k: 0.0 for k in (
        "write_fsync_1", "write_fsync_4_writeback", "write_fsync_4files", "read_cold_1", "read_cold_4",
        "read_cold_4files", "read_warm_4", "memcpy", "memcpy_fresh")}
    out["cold"] = 1.0
    for _ in range(reps):
        out["write_fsync_1"] = max(out["write_fsync_1"], _write(one, data, 1, False))
        out["write_fsync_4_writeback"] = max(out["write_fsync_4_writeback"], _write(one, data, 4, True))
        out["write_fsync_4files"] = max(out["write_fsync_4files"], _write(four, data, 4, True))
        for key, paths, threads in (("read_cold_1", one, 1), ("read_cold_4", one, 4), ("read_cold_4files", four, 4)):
            if not drop_caches():
                out["cold"] = 0.0
            out[key] = max(out[key], _read(paths, buf, threads))
        out["read_warm_4"] = max(out["read_warm_4"], _read(four, buf, 4))  # just read: in the page cache
    for p in one + four:
        os.unlink(p)
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        out["memcpy"] = max(out["memcpy"], nbytes / (time.perf_counter() - t0) / 1e9)
    fresh = torch.empty_like(src)
    t0 = time.perf_counter()
    fresh.copy_(src)
    out["memcpy_fresh"] = nbytes / (time.perf_counter() - t0) / 1e9
    return out


def write_bandwidth(directory: str, nbytes: int, reps: int = 2) -> float:
    """Best-of-``reps`` GB/s of writing ``nbytes`` with fsync (4 threads, early writeback),
    the disk's write limit for a benchmark that needs no other figure of this module."""
    os.makedirs(directory, exist_ok=True)
    path = [os.path.join(directory, "machine.bin")]
    data = memoryview(torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy())
    try:
        return max(_write(path, data, 4, True) for _ in range(reps))
    finally:
        os.unlink(path[0])
