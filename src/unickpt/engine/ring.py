"""A ring of memory-mapped files that one rank's snapshots are written into, reused
from step to step (docs/SNAPSHOT.md, "The ring").

Writing a fresh file into tmpfs every step costs a page fault and a zeroed page for every
4 KiB: at 0.5-2 GB/s it is several times slower than copying into memory that is already
mapped. A :class:`MappedRing` keeps a few files (*slots*) of a rank's data-file size
under ``<job dir>/ring/``, each allocated once (``fallocate``: the memory is taken, or
refused with ENOSPC, up front) and mapped for the life of the process with every page
populated; a snapshot copies the state straight into a free slot and then hard-links it
into its step directory, where it is an ordinary rank file.

Which slot is free is told by the file system alone: a slot whose link count is 1 is in
no step directory. Only this rank ever adds a link (after writing), and the keepers only
remove step directories, so a slot linked into the newest whole step, or into a step in
progress, is never written again until the keeper has deleted every step that holds it:
a trainer killed mid-copy leaves only a slot no step refers to.

On CUDA each slot is registered with ``cudaHostRegister`` once, when it is made (in the
background: :meth:`MappedRing.prepare`), so the device-to-host copy of a snapshot lands
in the keeper's shared memory in one DMA, with no pinned staging buffer beside it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import threading
from dataclasses import dataclass

import torch

from ..errors import SnapshotError
from ..logs import log

RING_DIR = "ring"
_SLOT = re.compile(r"^rank_(\d{5,})\.s(\d+)$")


def slot_name(rank: int, index: int) -> str:
    """The file name of ``rank``'s slot ``index``."""
    return f"rank_{rank:05d}.s{index}"


def slot_rank(name: str) -> int | None:
    """The rank a slot file belongs to (None: not a slot's name)."""
    m = _SLOT.match(name)
    return int(m.group(1)) if m else None


@dataclass
class Slot:
    """One mapped file of the ring: ``buf`` is its bytes as a uint8 tensor."""

    path: str
    fd: int
    map: mmap.mmap
    buf: torch.Tensor
    pinned: bool = False
    pin_error: str = ""  # why cudaHostRegister refused it (not tried again)

    @property
    def size(self) -> int:
        """Bytes of the file (and of the map)."""
        return self.buf.numel()

    def free(self) -> bool:
        """True when no step directory holds the file (its only link is the ring's) and
        it is still the size mapped (a file truncated by anything else is not written:
        touching its pages past the new end would be a SIGBUS)."""
        try:
            st = os.fstat(self.fd)
            return st.st_nlink == 1 and st.st_size == self.size and os.path.samestat(st, os.stat(self.path))
        except OSError:
            return False

    def close(self) -> None:
        """Unregister, unmap and close."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self.pinned = False
        self.buf = torch.empty(0, dtype=torch.uint8)
        try:
            self.map.close()
        except BufferError:  # a view of the map still lives (a failed save's): the map goes with it
            pass
        os.close(self.fd)


def _map(path: str, size: int, pin: bool) -> Slot:
    """Create or reuse the file at ``path`` at ``size`` bytes, take its memory
    (``fallocate``), map it with every page populated, and pin it when asked."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        if size:
            os.posix_fallocate(fd, 0, size)
        m = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except OSError as e:
        os.close(fd)
        raise SnapshotError(f"cannot take {size} bytes of shared memory for a snapshot slot {path}: "
                            f"{e.strerror or e}") from None
    buf = torch.frombuffer(m, dtype=torch.uint8)[:size] if size else torch.empty(0, dtype=torch.uint8)
    slot = Slot(path, fd, m, buf)
    if pin:
        pin_slot(slot)
    return slot


_PIN_WARNED: set[str] = set()  # the ring directories whose slots CUDA refused to page-lock (warned once)


def pin_slot(slot: Slot) -> None:
    """Page-lock a slot for CUDA (once per slot: later device-to-host copies into it are
    DMA straight into the shared memory); nothing without CUDA. Where CUDA refuses (a
    file on a disk's file system, not a tmpfs: Linux lends no long-term pin of such
    pages), the slot stays pageable, the reason is kept in ``slot.pin_error`` and said
    once per directory, and the copies go at the pageable rate."""
    if slot.pinned or slot.pin_error or not slot.size or not torch.cuda.is_available():
        return
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(slot.buf.data_ptr(), slot.size, 0))  # flags 0: cudaHostRegisterDefault
    slot.pinned = err == 0
    if slot.pinned:
        return
    _clear_last_cuda_error()  # else this thread's next kernel launch check raises it as its own
    try:
        name = str(cudart.cudaGetErrorString(cudart.cudaError(err)))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        name = "cudaError"
    slot.pin_error = f"{name} ({err})"
    folder = os.path.dirname(slot.path)
    if folder not in _PIN_WARNED:
        _PIN_WARNED.add(folder)
        log.warning(f"unickpt: CUDA cannot page-lock the snapshot ring in {folder} (cudaHostRegister: "
                    f"{slot.pin_error}): snapshots copy from the GPU at the pageable rate. The shm root "
                    f"($UNICKPT_SHM_ROOT) must be a tmpfs such as /dev/shm")


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error of this thread (``cudaGetLastError``): a failed
    ``cudaHostRegister`` leaves "invalid argument" there, and torch's check after the
    thread's next kernel launch raised it (measured on an H200: the next ``torch.ones``
    on the device failed). torch binds no ``cudaGetLastError``: it is called through
    ctypes in the runtime library torch loaded (its global symbols, else the library
    named in this process's maps)."""
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "/libcudart" in line})
    except OSError:
        libs = []
    for lib in [None, *libs]:
        try:
            ctypes.CDLL(lib).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


_RINGS: dict[str, "MappedRing"] = {}  # directory -> this process's ring there (see MappedRing.shared)


class MappedRing:
    """One rank's ring of at most ``slots`` mapped files under ``directory``. Not
    thread-safe: one snapshot at a time uses it (the snapshot channel's saver)."""

    @classmethod
    def shared(cls, directory: str, rank: int, slots: int) -> "MappedRing":
        """This process's ring in ``directory``: the one an earlier Snapshotter of this
        process made (live recovery calls the training function again after a re-forming,
        whose new manager then reuses the mapped, populated, pinned slots instead of
        mapping them again and leaking the old maps), else a new one. The ring of another
        rank there (this process's rank changed at the re-forming) is closed first."""
        ring = _RINGS.get(directory)
        if ring is not None and (ring.rank, ring.most) == (rank, slots):
            return ring
        if ring is not None:
            ring.close()
        ring = _RINGS[directory] = cls(directory, rank, slots)
        return ring

    def __init__(self, directory: str, rank: int, slots: int) -> None:
        if slots < 2:
            raise SnapshotError(f"a snapshot ring needs at least 2 slots (the newest whole step and the next), not {slots}")
        self.directory, self.rank, self.most = directory, rank, slots
        self.slots: dict[int, Slot] = {}
        self._preparing: threading.Thread | None = None
        self._error: BaseException | None = None
        self._adopted = False
        self._made = threading.Condition()  # notified each time the preparing thread made a slot

    @property
    def nbytes(self) -> int:
        """Bytes the ring's slots hold now."""
        return sum(s.size for s in self.slots.values())

    def _path(self, index: int) -> str:
        return os.path.join(self.directory, slot_name(self.rank, index))

    def prepare(self, size: int, pin: bool) -> None:
        """Make every slot at ``size`` bytes in a background thread (the files an earlier
        process of this rank left are reused; mapped, populated, pinned when ``pin``):
        called once the state's size is known, so that neither the page faults nor the
        pinning land on a training step, and the ring's memory is taken once, up front."""
        if self._preparing is not None:
            return

        def run() -> None:
            try:
                self.adopt()
                for i in range(self.most):
                    slot = self.slots.get(i)
                    if slot is None or (slot.size != size and slot.free()):
                        self._remake(i, size, pin)
                    elif pin:
                        pin_slot(slot)
                    with self._made:
                        self._made.notify_all()
            except BaseException as e:  # reported by the next acquire()
                self._error = e
            with self._made:
                self._made.notify_all()

        self._preparing = threading.Thread(target=run, name="unickpt-ring-prepare", daemon=True)
        self._preparing.start()

    def _settle(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
        elif not self._adopted:
            self.adopt()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _remake(self, index: int, size: int, pin: bool) -> Slot:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        with self._made:
            old = self.slots.pop(index, None)
        if old is not None:
            old.close()
        path = self._path(index)
        try:
            if os.lstat(path).st_nlink > 1 or not os.path.isfile(path):  # held by a step, or not a file: a new inode
                os.unlink(path) if not os.path.isdir(path) else os.rmdir(path)
        except FileNotFoundError:
            pass
        slot = _map(path, size, pin)
        with self._made:
            self.slots[index] = slot
        return slot

    def available(self) -> bool:
        """True when a slot can take the next snapshot: one is free, or the ring may grow
        (or is being made)."""
        if self._preparing is not None and self._preparing.is_alive():
            return True
        self._settle()
        return len(self.slots) < self.most or any(s.free() for s in self.slots.values())

    def acquire(self, size: int, pin: bool) -> Slot:
        """A free slot of ``size`` bytes (remade at that size when it had another). Raises
        SnapshotError when every slot is held by a step (check :meth:`available` first).
        While the ring is being made, the first slot ready is taken without waiting for
        the others."""
        ready = self._ready(size, pin)
        if ready is not None:
            return ready
        self._settle()
        for i, s in sorted(self.slots.items()):
            if s.free() and s.size == size and (s.pinned or s.pin_error or not pin):
                return s
        for i, s in sorted(self.slots.items()):
            if s.free() and s.size == size:
                pin_slot(s)
                return s
        for i, s in sorted(self.slots.items()):
            if s.free():
                return self._remake(i, size, pin)
        for i in range(self.most):
            if i not in self.slots:
                return self._remake(i, size, pin)
        raise SnapshotError(f"all {self.most} slots of the snapshot ring of rank {self.rank} are held by steps the "
                            f"keepers have not released")

    def _ready(self, size: int, pin: bool) -> Slot | None:
        """While the preparing thread runs: wait for a free slot it made at ``size``."""
        thread = self._preparing
        while thread is not None and thread.is_alive():
            with self._made:
                for _, s in sorted(self.slots.items()):
                    if s.size == size and (s.pinned or s.pin_error or not pin or not torch.cuda.is_available()) and s.free():
                        return s
                self._made.wait(0.05)
        return None

    def adopt(self) -> None:
        """Map the slots an earlier process of this rank left (a relaunch reuses their
        memory instead of taking more); slots still held by steps are mapped too, and
        written only once the keeper has released them."""
        self._adopted = True
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            m = _SLOT.match(name)
            if not m or int(m.group(1)) != self.rank or int(m.group(2)) >= self.most or int(m.group(2)) in self.slots:
                continue
            path = os.path.join(self.directory, name)
            try:
                st = os.lstat(path)
                if not os.path.isfile(path) or os.path.islink(path):
                    continue
                if st.st_size:
                    slot = _map(path, st.st_size, False)
                    with self._made:
                        self.slots[int(m.group(2))] = slot
            except (OSError, SnapshotError):
                continue

    def close(self) -> None:
        """Unmap every slot (the files stay: the steps that hold them, and the next process
        of this rank, keep using them)."""
        try:
            self._settle()
        except BaseException:
            pass
        for s in self.slots.values():
            s.close()
        self.slots.clear()
        if _RINGS.get(self.directory) is self:
            del _RINGS[self.directory]


def sweep(directory: str, ranks: set[int]) -> int:
    """Delete the slot files of ranks not in ``ranks`` that no step holds (a relaunch on
    fewer ranks leaves the others' slots); returns the bytes freed."""
    freed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        rank = slot_rank(name)
        if rank is None or rank in ranks:
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if st.st_nlink == 1:
                os.unlink(path)
                freed += st.st_size
        except OSError:
            continue
    return freed
