"""A per-step delta log (LowDiff): each step's applied gradients as a small checkpoint.

Between two full checkpoints a trainer appends, after every optimizer step, what that
step applied (the gradients the optimizer consumed, plus the small state that moves with
a step: data position, RNG) to ``<log root>/step_<N>/``, an ordinary unickpt checkpoint:

* each rank writes its own shard of every gradient (DTensor/FSDP/TP placements, exactly
  as a full checkpoint stores parameters), so the log reshards like any checkpoint;
* every data file is fsynced and checksummed (crc32c per block), and the manifest,
  written last by rank 0, is the entry's commit marker: an entry without it, or whose
  files are short or fail their checksums, is torn and never replayed;
* the writes run on a background thread over a gloo group of their own (never the
  training group), at most ``max_pending`` entries behind the trainer.

Recovery (see :func:`replayable`) takes the newest full checkpoint and the unbroken run
of committed, verified entries right after it. Entries a newer full checkpoint covers are
folded away (deleted) as soon as it commits, so the log holds at most the steps since the
newest full checkpoint plus the one in flight. Layer: an entry point beside ``save`` and
the durable checkpoints, on which it stands; what a step's entry holds, and how to replay
it in any loop, is :mod:`unickpt.api.deltas.replay` (``CheckpointManager(log_deltas=True)``).
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ...dist import new_group, resolve_group
from ...errors import SaveError, UnickptError, one_line
from ...format.manifest import MANIFEST_NAME
from ...storage.local import list_subdirs, remove_checkpoint
from ...storage.transaction import remove_abandoned
from ..checkpoints import Checkpoints
from ..save import save

DELTAS_DIR = "deltas"


def step_of(path: str) -> int:
    """The step of a numbered checkpoint directory (``.../step_00000012`` -> 12)."""
    return int(os.path.basename(os.path.normpath(path)).split("_")[-1])


class DeltaLog:
    """The delta log under ``root`` (usually ``<ckpt dir>/deltas``).

    Collective construction over ``process_group`` (every rank makes the log's own gloo
    group). ``threads`` write each entry (one suits entries of a few MB).
    ``append(step, state)`` queues one entry; ``state`` must already be a private
    copy (the trainer may change its tensors at once). ``covered()`` returns the step of
    the newest committed full checkpoint (or None); entries up to it are folded away after
    each commit. ``close()`` waits for the queue and raises the first write failure."""

    def __init__(self, root: str | os.PathLike, process_group: Any = None, *,
                 covered: Callable[[], int | None] | None = None, max_pending: int = 2, threads: int = 1) -> None:
        self.root = str(root)
        self.threads = threads  # an entry is small: one writer thread, no pool to start per step
        self.entries = Checkpoints(self.root)
        group = resolve_group(process_group)
        self.rank = group.rank
        self._pg = None
        if group.active:
            ranks = dist.get_process_group_ranks(group.pg)
            self._pg = new_group(ranks, "gloo", parent=group.pg)
        self._covered = covered
        self._slots = threading.Semaphore(max_pending)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.last_committed: int | None = None
        # entries written, and the wall and CPU seconds the writer thread spent on them
        self.stats = {"entries": 0, "write_s": 0.0, "write_cpu_s": 0.0}
        self._thread = threading.Thread(target=self._run, name="unickpt-delta-log", daemon=True)
        self._thread.start()

    def path_for(self, step: int) -> str:
        """Directory of the entry of ``step``."""
        return self.entries.path_for(step)

    def append(self, step: int, state: dict[str, Any]) -> None:
        """Queue the entry of ``step`` (waits while ``max_pending`` entries are unwritten).
        Raises the failure of an earlier entry, if one failed."""
        self._raise()
        self._slots.acquire()
        self._queue.put((step, state))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):  # flush(): everything before it is done
                item.set()
                continue
            step, state = item
            try:
                if self._error is None:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    save(state, self.path_for(step), process_group=self._pg, overwrite=True, threads=self.threads,
                         metadata={"delta_log": {"step": step}})
                    self.last_committed = step
                    self.stats["entries"] += 1
                    self.stats["write_s"] += time.perf_counter() - t0
                    self.stats["write_cpu_s"] += time.thread_time() - c0
                    if self._covered is not None and self.rank == 0:
                        self.fold(self._covered())
            except BaseException as e:  # reported by the next append() or close()
                self._error = e if isinstance(e, UnickptError) else SaveError(
                    f"delta log entry of step {step}: {type(e).__name__}: {e}")
            finally:
                del state, item
                self._slots.release()

    def take_error(self) -> BaseException | None:
        """The failure of an earlier entry, if one failed, and forget it: the log goes on
        with the next entry (a replay stops at the missing one)."""
        error, self._error = self._error, None
        return error

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def fold(self, upto: int | None) -> None:
        """Delete the entries of steps ``<= upto`` (a committed full checkpoint covers
        them); rank 0 only, other ranks return at once. The manifest goes first, so a
        crash midway leaves an uncommitted entry, never a committed one missing files."""
        if upto is None or self.rank != 0:
            return
        for step in self.steps(committed=False):
            if step <= upto:
                remove_entry(self.path_for(step))

    def discard_after(self, step: int) -> None:
        """Delete the entries newer than ``step`` and what killed writes left (rank 0):
        called once a run has resumed at ``step``, whose next entries replace them."""
        if self.rank != 0:
            return
        for s in self.steps(committed=False):
            if s > step:
                remove_entry(self.path_for(s))
        if os.path.isdir(self.root):
            remove_abandoned(self.root)

    def steps(self, committed: bool = True) -> list[int]:
        """Steps of the committed entries (all entry directories with ``committed=False``)."""
        if committed:
            return self.entries.steps()
        return sorted(int(n[5:]) for n in list_subdirs(self.root) if n.startswith("step_") and n[5:].isdigit())

    def flush(self) -> None:
        """Wait until every queued entry is written (or failed); raise the first failure."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()
        self._raise()

    def close(self) -> None:
        """Write what is queued, fold what the newest full checkpoint covers, stop the
        writer; raise the first failure."""
        try:
            self.flush()
            if self._covered is not None and self.rank == 0:
                self.fold(self._covered())
        finally:
            self._queue.put(None)
            self._thread.join()
            self._pg = None  # destroyed now, its gloo threads joined, not at the interpreter's exit


def remove_entry(path: str) -> None:
    """Remove a log entry, committed or torn."""
    if os.path.exists(os.path.join(path, MANIFEST_NAME)):
        try:
            remove_checkpoint(path, MANIFEST_NAME)
            return
        except OSError:
            pass
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Replay:
    """What a recovery can replay: the newest full checkpoint (``base``; None: the
    initial state, step 0, that the trainer rebuilds) and the entries after it, in order; ``notes`` says why later entries are not
    replayed (torn, corrupt, after a gap)."""

    base: str | None
    base_step: int
    entries: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        """True when there is anything to resume from."""
        return self.base is not None or bool(self.entries)

    @property
    def step(self) -> int:
        """The step the replay reaches."""
        return self.base_step + len(self.entries)


def replayable(ckpt_root: str, log_root: str, verify_entries: bool = True) -> Replay:
    """Plan a recovery (local, no collectives: call on one rank and share the result):
    the newest valid full checkpoint under ``ckpt_root`` and the unbroken run of committed
    entries of ``log_root`` after it. An entry is replayed only if its manifest is
    committed, its data files have their recorded sizes and (``verify_entries``) every
    checksum holds; the first one that fails ends the run, and the reason is noted."""
    from ..verify import verify

    full = Checkpoints(ckpt_root).latest()
    plan = Replay(full, step_of(full) if full is not None else 0)
    log = Checkpoints(log_root)
    on_disk = sorted(int(n[5:]) for n in list_subdirs(log_root) if n.startswith("step_") and n[5:].isdigit())
    staged = _abandoned_steps(log_root)
    step = plan.base_step + 1
    gap = False
    while True:
        path = log.path_for(step)
        if step not in on_disk:
            if step in staged:
                plan.notes.append(f"step {step}: torn entry (killed mid-write, no commit marker), not replayed")
            else:
                gap = True
            break
        why = _entry_problem(log, path, step, verify, verify_entries)
        if why:
            plan.notes.append(f"step {step}: torn entry ({why}), not replayed")
            break
        plan.entries.append(path)
        step += 1
    later = [s for s in on_disk if s > step]
    if later:
        why = f"no full checkpoint or entry of step {step} comes before them" if gap else "they follow the torn one"
        plan.notes.append(f"{len(later)} later entries (steps {later[0]}..{later[-1]}) not replayed: {why}")
    return plan


def _entry_problem(log: Checkpoints, path: str, step: int, verify: Callable, full_check: bool) -> str:
    if not os.path.exists(os.path.join(path, MANIFEST_NAME)):
        return "no commit marker"
    try:
        from ..load import read_manifest

        manifest = read_manifest(path)
        for name, size in manifest.files.items():
            have = os.path.getsize(os.path.join(path, name)) if os.path.exists(os.path.join(path, name)) else None
            if have != size:
                return f"{name}: {have if have is not None else 'no'} of {size} bytes" if have is not None else f"{name} missing"
        entry = manifest.metadata.get("delta_log")
        if not isinstance(entry, dict) or entry.get("step") != step:
            return "its manifest names another step"
        if full_check:
            report = verify(path)
            if not report.ok:
                return str(report.problems[0])
    except UnickptError as e:
        return one_line(e)
    except OSError as e:  # the log's files are untrusted: a manifest or data file that is a directory, unreadable
        return f"unreadable: {e}"
    return ""


def _abandoned_steps(root: str) -> set[int]:
    """Steps whose entry a killed write left uncommitted (its staging directory)."""
    out = set()
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for n in names:
        if n.startswith(".step_") and ".unickpt" in n:
            digits = n[len(".step_"):].split(".")[0]
            if digits.isdigit():
                out.add(int(digits))
    return out
