"""Host staging for async save: one reusable buffer per process, cut into batches.

A save copies ("stages") the bytes this rank writes into host memory so training can go
on changing its tensors. The :class:`StagingPool` owns one flat ``uint8`` buffer, pinned
when the sources live on CUDA (so device-to-host copies are real DMA, issued with
``non_blocking=True`` and finished by one synchronize per batch). The buffer is allocated
on first use and reused by every later save: host memory for staging stays at one copy
of the rank's shard however many saves run, and ``max_bytes`` caps it.

When a shard does not fit under the cap, :func:`plan_batches` cuts it into batches of
at most the capacity (tensors are split at checksum-block boundaries); the saver stages
one batch, writes it, stages the next into the same memory, and so on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Unit:
    """Bytes ``[lo, hi)`` of source tensor ``index`` (its flat row-major data), staged at
    byte ``slot`` of the buffer, or read in place from a CPU source when ``slot`` is -1."""

    index: int
    lo: int
    hi: int
    slot: int


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 tensor on its device (a view when contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def plan_batches(
    sizes: list[int], staged: list[bool], capacity: int | None, block_bytes: int
) -> tuple[list[list[Unit]], int]:
    """Cut sources of ``sizes`` bytes into batches that fit ``capacity`` buffer bytes
    (None: everything in one batch). Sources with ``staged[i]`` False take no buffer
    space (they are read in place). Returns the batches and the buffer size they need."""
    total = sum(_aligned(n) for n, s in zip(sizes, staged) if s)
    if capacity is None or total <= capacity:
        cap = total
        unit = max(total, block_bytes)
    else:
        cap = max(capacity, block_bytes + ALIGN)
        unit = max(block_bytes, (cap - ALIGN) // block_bytes * block_bytes)
    batches: list[list[Unit]] = [[]]
    used = 0
    for i, (n, s) in enumerate(zip(sizes, staged)):
        if not s:
            batches[-1].append(Unit(i, 0, n, -1))
            continue
        for lo in range(0, max(n, 1), unit):
            hi = min(n, lo + unit)
            if used + _aligned(hi - lo) > cap and batches[-1]:
                batches.append([])
                used = 0
            batches[-1].append(Unit(i, lo, hi, used))
            used += _aligned(hi - lo)
    return batches, cap


class StagingPool:
    """One reusable host buffer (pinned for CUDA sources). Not thread-safe: one save at a
    time uses it (async_save waits for the previous save before staging the next)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._preparing: threading.Thread | None = None

    def prepare(self, nbytes: int, pin: bool) -> None:
        """Allocate the buffer (pinned when ``pin``) in a background thread, so that the
        first save does not pay for it: page-locking 16 GiB takes seconds, which would
        otherwise land on a training step. The next :meth:`buffer` waits for it."""
        if self._preparing is not None or (self._buf is not None and self._buf.numel() >= nbytes):
            return

        def run() -> None:
            self._buf = None  # the old one freed first: two never coexist
            self._buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)

        self._preparing = threading.Thread(target=run, name="unickpt-staging-prepare", daemon=True)
        self._preparing.start()

    def _settle(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    @property
    def nbytes(self) -> int:
        """Bytes currently held."""
        return 0 if self._buf is None else self._buf.numel()

    @property
    def pinned(self) -> bool:
        """True when the buffer is page-locked."""
        return self._buf is not None and self._buf.is_pinned()

    def buffer(self, nbytes: int, pin: bool, limit: int | None = None) -> torch.Tensor:
        """A uint8 buffer of ``nbytes``: the held one when it is large enough, not much
        larger, within ``limit`` and pinned if asked; else a new one (the old one is
        freed first, so two never coexist)."""
        self._settle()
        buf = self._buf
        most = max(2 * nbytes, nbytes + (64 << 20))
        if limit is not None:
            most = min(most, max(limit, nbytes))
        fits = buf is not None and nbytes <= buf.numel() <= most
        if not fits or (pin and not buf.is_pinned()):
            self._buf = buf = None
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
            self._buf = buf
        return buf[:nbytes]

    def release(self) -> None:
        """Free the buffer."""
        self._settle()
        self._buf = None


def record_streams(sources: list[torch.Tensor]) -> list[tuple[torch.device, torch.cuda.Event]]:
    """Mark where each CUDA device's current stream stands now (call in the training
    thread); copies issued later wait for this point, so they see the state as of now."""
    events = []
    for dev in sorted({t.device for t in sources if t.is_cuda}, key=str):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        events.append((dev, ev))
    return events


def copy_batch(
    units: list[Unit], sources: list[torch.Tensor], buf: torch.Tensor,
    events: list[tuple[torch.device, torch.cuda.Event]], streams: dict[torch.device, torch.cuda.Stream],
) -> None:
    """Copy every staged unit of a batch into ``buf``: CPU sources with a plain copy,
    CUDA sources on a side stream (after ``events``) with ``non_blocking`` copies into the
    pinned buffer and one synchronize per device at the end."""
    waited: set[torch.device] = set()
    flat: dict[int, torch.Tensor] = {}
    for u in units:
        if u.slot < 0 or u.hi == u.lo:
            continue
        src = sources[u.index]
        dst = buf[u.slot : u.slot + (u.hi - u.lo)]
        if not src.is_cuda:
            if u.index not in flat:
                flat[u.index] = flat_bytes(src)
            dst.copy_(flat[u.index][u.lo : u.hi])
            continue
        stream = streams.get(src.device)
        if stream is None:
            stream = streams[src.device] = torch.cuda.Stream(src.device)
        if src.device not in waited:
            for dev, ev in events:
                if dev == src.device:
                    stream.wait_event(ev)
            waited.add(src.device)
        with torch.cuda.stream(stream):
            if u.index not in flat:
                src.record_stream(stream)
                flat[u.index] = flat_bytes(src)
            dst.copy_(flat[u.index][u.lo : u.hi], non_blocking=True)
    for dev in waited:
        streams[dev].synchronize()
