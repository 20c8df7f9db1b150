"""A rank's data file written straight into a ring slot (:mod:`unickpt.engine.ring`):
one copy of every byte, its CRC-32C computed while the piece is still in cache.

The save's items are copied to their offsets in the slot (the safetensors layout of
:func:`~unickpt.engine.writer.data_file_layout`) by ``threads`` threads, each taking
whole checksum blocks: a CPU source is copied 1 MiB at a time and each piece's CRC-32C
folded into its block's while it is in the cache (numpy's copy and crc32c both release
the GIL; torch's copy of small pieces would start its own thread pool for each); a CUDA source is copied device-to-host into the (pinned) slot on a side stream,
an event after each item, and the threads checksum each item once its event has passed.
No xxh3 identity is computed (the fragments carry none: a snapshot is never the base of
an incremental save). The slot is then hard-linked into the step directory.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import crc32c as _crc
import numpy as np
import torch

from ..format.manifest import Fragment
from .items import TensorItem
from .ring import Slot
from .staging import flat_bytes

PIECE_BYTES = 1 << 20  # copied, then checksummed while in the L2 cache
TASK_BYTES = 16 << 20  # the blocks one thread task takes


def _tasks(sizes: list[int], block_bytes: int) -> list[list[tuple[int, int, int]]]:
    """The thread tasks: each a list of (item, lo, hi) ranges of whole checksum blocks,
    about ``TASK_BYTES`` in all. A large item is cut into several tasks; small ones share
    one (a task per 16 KiB tensor cost more in futures and wake-ups than its copy: 34 ms
    of a snapshot of 1,600 tensors)."""
    per = max(1, TASK_BYTES // block_bytes) * block_bytes
    out: list[list[tuple[int, int, int]]] = []
    task: list[tuple[int, int, int]] = []
    held = 0
    for k, n in enumerate(sizes):
        for lo in range(0, max(n, 1), per):
            hi = min(n, lo + per)
            if task and held + hi - lo > per:
                out.append(task)
                task, held = [], 0
            task.append((k, lo, hi))
            held += hi - lo
    if task:
        out.append(task)
    return out


def stage_into_slot(items: list[TensorItem], layout: tuple[bytes, list[int], int], slot: Slot, block_bytes: int,
                    threads: int, events: list, streams: dict,
                    on_copied: Callable[[], None] | None = None) -> list[list[int]]:
    """Copy ``items`` into ``slot`` with their header, at the offsets of ``layout`` (the
    rank's :func:`~unickpt.engine.writer.data_file_layout` of them, which sized the slot);
    returns each item's block CRC-32Cs. ``events`` are the training streams' positions
    (:func:`~unickpt.engine.staging.record_streams`); CUDA copies wait for them.
    ``on_copied`` is called once no source is read any more: when every item is on CUDA,
    as soon as the device-to-host copies are over, while the checksums still run on the
    slot (the training loop's stall is then the copy alone)."""
    prefix, offsets, size = layout
    buf = slot.buf
    if buf.numel() != size:
        raise ValueError(f"ring slot {slot.path} holds {buf.numel()} bytes, the data file needs {size}")
    buf[: len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    sources = [flat_bytes(i.local) if not i.local.is_cuda else i.local for i in items]
    sizes = [i.local.numel() * i.local.element_size() for i in items]
    done: dict[int, torch.cuda.Event] = {}
    waited: set[torch.device] = set()
    for k, src in enumerate(sources):  # device-to-host copies first: the DMA runs while CPU copies are checksummed
        if not src.is_cuda or not sizes[k]:
            continue
        stream = streams.get(src.device)
        if stream is None:
            stream = streams[src.device] = torch.cuda.Stream(src.device)
        if src.device not in waited:  # the copies see the state as of the call
            for dev, ev in events:
                if dev == src.device:
                    stream.wait_event(ev)
            waited.add(src.device)
        with torch.cuda.stream(stream):
            src.record_stream(stream)
            flat = flat_bytes(src)
            buf[offsets[k] : offsets[k] + sizes[k]].copy_(flat, non_blocking=True)
            done[k] = torch.cuda.Event()
            done[k].record(stream)

    view = buf.numpy()
    hosts = {k: src.numpy() for k, src in enumerate(sources) if not src.is_cuda}

    def one(task: list[tuple[int, int, int]]) -> list[list[int]]:
        return [one_range(*r) for r in task]

    def one_range(k: int, lo: int, hi: int) -> list[int]:
        at = offsets[k]
        if k in done:
            done[k].synchronize()
        crcs = []
        for b in range(lo, max(hi, lo + 1), block_bytes):
            end = min(hi, b + block_bytes)
            crc = 0
            for p in range(b, end, PIECE_BYTES):
                q = min(end, p + PIECE_BYTES)
                dst = view[at + p : at + q]
                if k not in done:  # numpy's copy: one thread's memcpy, the GIL released
                    np.copyto(dst, hosts[k][p:q])
                crc = _crc.crc32c(dst, crc)
            crcs.append(crc)
        return crcs

    tasks = _tasks(sizes, block_bytes)
    device_only = all(k in done or not n for k, n in enumerate(sizes))
    if threads > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(max_workers=min(threads, len(tasks)), thread_name_prefix="unickpt-ring") as pool:
            futures = [pool.submit(one, t) for t in tasks]
            if device_only and on_copied is not None:
                for ev in done.values():
                    ev.synchronize()
                on_copied()
            results = [f.result() for f in futures]
    else:
        results = [one(t) for t in tasks]
    if on_copied is not None:
        on_copied()
    out: list[list[int]] = [[] for _ in items]
    for task, task_crcs in zip(tasks, results):
        for (k, _, _), crcs in zip(task, task_crcs):
            out[k] += crcs
    return out


def fragments(items: list[TensorItem], offsets: list[int], rank: int, name: str, crcs: list[list[int]],
              block_bytes: int) -> list[Fragment]:
    """The fragments of a data file written by :func:`stage_into_slot` at ``offsets`` (no
    xxh3 identity)."""
    return [Fragment(name, off, tuple(i.local.shape), i.pieces, c, block_bytes, rank) for i, off, c in zip(items, offsets, crcs)]


_POLY = 0x82F63B78  # CRC-32C, reflected


def _times(mat: Sequence[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: Sequence[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


@functools.lru_cache(maxsize=16)
def _shift_operator(nbytes: int) -> tuple[int, ...]:
    """The GF(2) operator that appends ``nbytes`` zero bytes to a CRC-32C's register
    (zlib's ``crc32_combine``, for the Castagnoli polynomial)."""
    odd = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    even = _square(odd)  # two
    odd = _square(even)  # four
    result = [1 << n for n in range(32)]  # identity
    n = nbytes
    while n:  # odd: 8 zero bits (a byte), then squared as n's bits are consumed
        even = _square(odd)
        if n & 1:
            result = [_times(even, result[i]) for i in range(32)]
        n >>= 1
        if not n:
            break
        odd = _square(even)
        if n & 1:
            result = [_times(odd, result[i]) for i in range(32)]
        n >>= 1
    return tuple(result)


def whole_crc(block_crcs: list[int], nbytes: int, block_bytes: int) -> int:
    """The CRC-32C of ``nbytes`` bytes from the CRC-32Cs of their consecutive
    ``block_bytes`` blocks, without reading the bytes again (a replicated tensor's
    agreement digest, from the checksums computed while copying it)."""
    if nbytes == 0:
        return 0
    full = _shift_operator(block_bytes)
    crc = block_crcs[0]
    for i, c in enumerate(block_crcs[1:], 1):
        length = min(block_bytes, nbytes - i * block_bytes)
        crc = _times(full if length == block_bytes else _shift_operator(length), crc) ^ c
    return crc


def link_into(slot: Slot, target: str) -> None:
    """Hard-link the written slot as the step's rank file ``target`` (replacing any file
    there): the step then holds the slot, which the ring does not write again until the
    step is deleted."""
    try:
        os.unlink(target)
    except FileNotFoundError:
        pass
    os.link(slot.path, target)
