"""Numbered checkpoints under one root (a directory or an object-store URL): resume from
the latest valid one, retention; optionally a second, durable tier (an object store) that
every Mth checkpoint is copied to in the background; retention that follows the
references of incremental checkpoints. :class:`Checkpoints` is the durable part of the
public :class:`unickpt.CheckpointManager` (``api/manager.py``), which adds the training
loop's tiers on top; the delta log keeps its entries in one too."""

from __future__ import annotations

import json
import os
import threading
import warnings
from typing import Any

from ..dist import all_true, first_said, resolve_group
from ..engine.exit_wait import finish_before_exit, wait_for
from ..engine.outcome import decided_by_rank0
from ..engine.load import LoadRecord
from ..errors import CorruptionError, UnickptError
from ..logs import log
from ..storage.open import open_storage
from ..storage.transaction import remove_abandoned
from .incremental import prune
from ..engine.save_options import Given
from .load import load_into, read_manifest
from .options import CheckpointsOptions, DurableOptions, SaveSchedule, check_tiers
from .save import checkpoint_file, save
from .tiers import Tier

__all__ = ["Checkpoints", "TierFallbackWarning"]


class TierFallbackWarning(UserWarning):
    """A checkpoint was loaded from the durable tier because the fast tier's copy was
    missing or failed its checks (also a warning on the ``unickpt`` logger).

    Example:
        ``warnings.simplefilter("error", unickpt.TierFallbackWarning)`` makes a fallback
        an error.
    """


class Checkpoints:
    """Checkpoints ``root/step_00000100`` ...; keeps the newest ``keep`` (all when None).
    ``root`` may be a URL (``s3://bucket/run``; ``storage_options`` for its file system).

    ``latest()`` is the newest checkpoint that is committed and whose manifest and data
    files are intact (sizes checked; pass ``verify=True`` to re-check every checksum), so
    a run resumes from the last good checkpoint even after a crash during a save.

    Two tiers: with ``durable`` (a URL, or another directory) every ``durable_every``-th
    checkpoint this manager saves is copied there in the background by rank 0, from the
    committed copy under ``root`` (the fast tier: local or node-local disk, visible to
    rank 0), keeping the newest ``durable_keep`` there. ``latest()`` is then the newest
    whole checkpoint of either tier; ``load`` prefers the fast tier's copy and falls back
    to the durable one when the fast copy is missing or fails its checksums, saying so
    (a :class:`TierFallbackWarning` and a log line). A failed copy is logged and kept in
    ``durable_errors``. The loop never waits for the durable tier: a copy due while the one
    before is still running is queued behind it, and when a newer one is due before its
    turn it is skipped for the newer (a store slower than the saves), logged and kept in
    ``durable_skipped``; ``wait()`` waits for the copies in flight and queued.

    ``incremental=True``: every save after the first is incremental against the latest
    valid checkpoint (only changed fragments are written, the others referenced), and
    every ``full_every``-th save is a full one (None: only the first). Retention then
    keeps, besides the newest ``keep``, every checkpoint one of them references, and
    deletes in an order that a kill at any point leaves every committed checkpoint whole
    (so ``steps()`` may list, besides the newest ``keep``, older checkpoints that hold
    bytes of kept ones; they go once nothing kept references them).

    :attr:`options` holds the groups in effect (a
    :class:`~unickpt.api.options.CheckpointsOptions`: the save schedule, the durable tier),
    built once from what was given (the flat keywords or the groups).

    Args:
        root: The fast tier: a directory or a URL.
        keep: Keep the newest ``keep`` checkpoints (None: all).
        storage_options: Options of the root's file system (fsspec).
        durable: The durable tier: a URL or directory, or a :class:`~unickpt.DurableOptions`
            (then without the ``durable_*`` keywords).
        durable_every: Copy every ``durable_every``-th checkpoint there.
        durable_keep: Keep the newest ``durable_keep`` there (None: all).
        durable_storage_options: Options of the durable tier's file system.
        incremental: Incremental saves (a local root, no durable tier).
        full_every: With ``incremental``, a full save every ``full_every`` saves.
        saves: ``incremental`` and ``full_every`` as a :class:`~unickpt.SaveSchedule`.

    Raises:
        UnickptError: A bad value or combination, naming the keyword.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        keep: int | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        durable: str | os.PathLike | DurableOptions | None = None,
        durable_every: int = 1,
        durable_keep: int | None = None,
        durable_storage_options: dict[str, Any] | None = None,
        incremental: bool = False,
        full_every: int | None = None,
        saves: SaveSchedule | None = None,
    ) -> None:
        given = SaveSchedule.merged(saves, {"incremental": incremental, "full_every": full_every})
        self._configure(root, keep, storage_options, given,
                        durable_options(durable, durable_every, durable_keep, durable_storage_options))

    def _configure(self, root: str | os.PathLike, keep: int | None, storage_options: dict[str, Any] | None,
                   saves: Given[SaveSchedule], durable: Given[DurableOptions] | None) -> None:
        """Set up the tiers from the groups as a public constructor was given them (this
        one's, or :class:`~unickpt.CheckpointManager`'s), checked across groups first."""
        check_tiers(str(root), saves, durable)
        self.options: CheckpointsOptions = CheckpointsOptions(saves.group, durable.group if durable else None)
        self.fast = Tier(root, keep, storage_options)
        tier = self.options.durable
        self.durable = Tier(tier.url, tier.keep, tier.storage_options) if tier is not None else None
        self.durable_errors: list[BaseException] = []
        self.durable_skipped: list[int] = []  # steps due to be copied, superseded by a newer one before their turn
        self._queued: int | None = None  # the step whose copy waits for the one running (the newest due)
        self._copy_running = False  # a copy thread is at work (set under _copy_lock when it stops)
        self._copy_lock = threading.Lock()
        self._saves = 0
        self._copy: threading.Thread | None = None
        self._copying: int | None = None
        self.passed_over: list[str] = []  # the checkpoints the last load() passed over, and why
        self.last_load: LoadRecord | None = None  # what this rank read in the last load() that succeeded
        self._failed: set[str] = set()  # checkpoints that failed their checks in a load of this process

    @property
    def root(self) -> str:
        """The fast tier's root."""
        return self.fast.root

    @property
    def keep(self) -> int | None:
        """How many checkpoints the fast tier keeps (None: all)."""
        return self.fast.keep

    def path_for(self, step: int) -> str:
        """Location of the checkpoint of ``step`` in the fast tier."""
        return self.fast.path_for(step)

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints of the fast tier, oldest first."""
        return self.fast.steps()

    def is_valid(self, path: str, verify: bool = False) -> bool:
        """True when ``path`` is a committed checkpoint whose files are all there, whole."""
        tier = self.durable if self.durable is not None and _under(path, self.durable) else self.fast
        return tier.is_valid(path, verify)

    def _candidates(self) -> list[tuple[int, list[tuple[Tier, str]]]]:
        """Every committed step of either tier, newest first, with its copies (fast first)."""
        tiers = [self.fast] + ([self.durable] if self.durable is not None else [])
        found: dict[int, list[tuple[Tier, str]]] = {}
        for tier in tiers:
            for step in tier.steps():
                found.setdefault(step, []).append((tier, tier.path_for(step)))
        return sorted(found.items(), reverse=True)

    def latest(self, verify: bool = False) -> str | None:
        """The newest valid checkpoint of either tier (the fast tier's copy when both are
        valid), or None. Passed over: a checkpoint that failed its checksums in a load of
        this manager, and with ``verify=True`` any whose checksums do not all match."""
        for _, copies in self._candidates():
            for tier, path in copies:
                if path not in self._failed and tier.is_valid(path, verify):
                    return path
        return None

    def failed_checks(self, path: str) -> bool:
        """True when a load of this manager passed ``path`` over (a file missing or cut
        short, a checksum that did not match): a new save of its step replaces it."""
        return path in self._failed

    def base_for(self, step: int) -> str | None:
        """The base of an incremental save of ``step``: the latest valid checkpoint, unless
        the save is to be a full one (the first, every ``full_every``-th, or no base)."""
        saves = self.options.saves
        if not saves.incremental:
            return None
        base = self.latest()
        if base is None or os.path.abspath(base) == os.path.abspath(self.path_for(step)):
            return None
        try:
            depth = (read_manifest(base).incremental or {}).get("depth", 0)
        except UnickptError:
            return None
        if saves.full_every is not None and depth + 1 >= saves.full_every:
            return None
        return base

    def save(self, state_dict: dict[str, Any], step: int, **kwargs: Any) -> str:
        """Save ``state_dict`` as the checkpoint of ``step`` (collective) into the fast
        tier, then apply retention; every ``durable_every``-th save also starts its copy
        to the durable tier (in the background, on rank 0). Returns its location."""
        return self._save(state_dict, step, **kwargs)[0]

    def _save(self, state_dict: dict[str, Any], step: int, **kwargs: Any) -> tuple[str, int]:
        """:meth:`save`; returns the location and the bytes this rank wrote."""
        path = self.path_for(step)
        group = resolve_group(kwargs.get("process_group"))
        if self.options.saves.incremental and "base" not in kwargs:
            kwargs["base"] = self.shared_base(step, group)
        written = save(state_dict, path, storage_options=self.fast.storage_options, **kwargs)
        if group.rank == 0:
            self.committed(step)
        return path, written

    def shared_base(self, step: int, group: Any) -> str | None:
        """Collective: the base of an incremental save of ``step``, chosen by rank 0."""
        return decided_by_rank0(group, lambda: (self.base_for(step) or "").encode()).decode() or None

    def committed(self, step: int) -> None:
        """Rank 0, once the checkpoint of ``step`` is committed in the fast tier: start its
        copy to the durable tier when due (queued behind a copy still running: the loop
        never waits for the durable tier), apply retention, clean what killed saves left."""
        self._saves += 1
        tier = self.options.durable
        if self.durable is not None and tier is not None and self._saves % tier.every == 0:
            with self._copy_lock:
                running = self._copy_running  # its thread ends only after it found nothing queued, under the lock
                if running:
                    if self._queued is not None:  # superseded before its turn: the newest goes instead
                        self.durable_skipped.append(self._queued)
                        log.warning("unickpt: step %d is not copied to the durable tier %s: step %d is due before the "
                                    "copy of step %d ended (the store is slower than the saves)", self._queued,
                                    self.durable.root, step, self._copying)
                    self._queued = step
            if not running:
                self.wait()
                self._start_copy(step)
        pinned = {s for s in (self._copying, self._queued) if s is not None}
        if self.fast.remote or self.durable is not None:
            self.fast.apply_retention(pinned)
            self.fast.clean_leftovers({step})  # what saves killed midway left: their space comes back
        else:
            self.prune()

    def prune(self) -> list[str]:
        """Apply retention to a local root without a durable tier now (``save`` does after
        each save): delete the checkpoints beyond the newest ``keep`` that no kept
        checkpoint references (incremental checkpoints), and what saves and deletions
        killed midway left. Returns the checkpoint directories deleted."""
        deleted: list[str] = []
        if self.keep is not None:
            committed = [self.path_for(s) for s in self.steps()]
            deleted = prune(committed, self.keep, self._interrupted())
        if os.path.isdir(self.root):
            remove_abandoned(self.root)  # what saves killed midway left: their space comes back
        return deleted

    def _interrupted(self) -> list[str]:
        """Step directories without a manifest holding nothing but checkpoint files: what a
        deletion killed midway left."""
        out = []
        for name in self.fast.uncommitted():
            path = os.path.join(self.root, name)
            names = open_storage(path).names()
            if all(checkpoint_file(n) or n.startswith(".") for n in names) and all(
                os.path.isfile(os.path.join(path, n)) for n in names
            ):
                out.append(path)
        return out

    def _start_copy(self, step: int) -> None:
        """Copy ``step``'s checkpoint to the durable tier in a thread, then each step queued
        meanwhile (:meth:`committed`), the newest one."""
        durable = self.durable
        assert durable is not None
        self._copying, self._copy_running = step, True

        def run() -> None:
            step = self._copying
            while step is not None:
                try:
                    durable.copy_in(self.path_for(step), step, src_options=self.fast.storage_options)
                    durable.apply_retention()
                    durable.clean_leftovers()
                    log.info("unickpt: copied step %d to the durable tier %s", step, durable.path_for(step))
                except BaseException as e:  # noqa: BLE001  (kept for the caller; training goes on)
                    self.durable_errors.append(e)
                    log.warning("unickpt: copying step %d to the durable tier %s failed: %s", step, durable.root, e)
                with self._copy_lock:
                    step, self._queued = self._queued, None
                    if step is not None:
                        self._copying = step
                    else:
                        self._copy_running = False

        # a daemon that exit waits for all the same: a script that ends after its last save
        # still has it copied (exit_wait names it when the store is slow; Ctrl-C gives it up)
        self._copy = threading.Thread(target=run, name=f"unickpt-durable-copy-{step}", daemon=True)
        self._copy.start()
        finish_before_exit(self._copy, self._copy_named)

    def _copy_named(self) -> str:
        """The copy in flight, as the notices of exit and :meth:`wait` name it."""
        assert self.durable is not None  # a copy runs only with a durable tier
        return f"the copy of step {self._copying} to the durable tier {self.durable.root}"

    def wait(self) -> None:
        """Wait for the copies to the durable tier in flight (and queued), if any; then
        the fast tier's retention, which kept them while they were copied. A wait of more
        than a few seconds (a store that stopped answering) names the copy on stderr, and
        Ctrl-C gives it up (it is then not committed; exit does not wait for it again)."""
        if self._copy is not None:
            wait_for(self._copy, self._copy_named)
            self._copy, self._copying = None, None
            if self.durable is not None:
                self.fast.apply_retention(set())

    def load(self, state_dict: dict[str, Any], path: str | None = None, **kwargs: Any) -> str | None:
        """Load ``path`` (default: the newest whole checkpoint of either tier) into
        ``state_dict``; when the fast tier's copy of that step is missing or fails its
        checksums, the durable tier's copy is loaded instead, with a warning. Without
        ``path``, a step none of whose copies is whole (a file missing or cut short, a
        checksum that does not match on any rank) is passed over for the next older one,
        and :attr:`passed_over` says which and why; the steps tried are rank 0's, so every
        rank loads the same one. Returns the location loaded, or None when there is no
        checkpoint; a :class:`~unickpt.CorruptionError` naming each one when none is whole.
        :attr:`last_load` is what this rank read (a :class:`~unickpt.engine.load.LoadRecord`),
        and a ``stats`` dict among ``kwargs`` receives it as :func:`unickpt.load` fills one."""
        stats = kwargs.pop("stats", None)
        self.passed_over, self.last_load = [], None
        loaded = self._load_newest(state_dict, path, kwargs)
        if stats is not None and self.last_load is not None:
            stats.update(self.last_load.as_stats())
        return loaded

    def _load_newest(self, state_dict: dict[str, Any], path: str | None, kwargs: dict[str, Any]) -> str | None:
        """:meth:`load`'s search: ``path``'s step, or the newest whole one."""
        if path is not None:
            step = self._step_of(path)
            if step is None or self.durable is None:
                self.last_load = load_into(state_dict, path, storage_options=self._options_for(path), **kwargs)
                return path
            return self._load_step(state_dict, step, [(self.fast, self.fast.path_for(step)), (self.durable, self.durable.path_for(step))],
                                   kwargs)
        for step, copies in self._shared_candidates(resolve_group(kwargs.get("process_group"))):
            if self.durable is not None and all(tier is not self.fast for tier, _ in copies):
                copies = [(self.fast, self.fast.path_for(step))] + copies  # named in the fallback warning
            loaded = self._load_step(state_dict, step, copies, kwargs, quiet_missing=True)
            if loaded is not None:
                return loaded
        if self.passed_over:  # checkpoints there, none whole: never a silent fresh start
            raise CorruptionError(f"no checkpoint under {self.root} could be loaded: " + "; ".join(self.passed_over))
        return None

    def _shared_candidates(self, group: Any) -> list[tuple[int, list[tuple[Tier, str]]]]:
        """Collective: :meth:`_candidates` as rank 0 lists them (a node-local fast tier may
        list otherwise on other ranks; every rank must try the same steps)."""
        tiers = [self.fast] + ([self.durable] if self.durable is not None else [])
        doc = decided_by_rank0(group, lambda: json.dumps(
            [[step, [tiers.index(t) for t, _ in copies]] for step, copies in self._candidates()]).encode())
        return [(step, [(tiers[i], tiers[i].path_for(step)) for i in which]) for step, which in json.loads(doc)]

    def _load_step(self, state_dict: dict[str, Any], step: int, copies: list[tuple[Tier, str]], kwargs: dict[str, Any],
                   quiet_missing: bool = False) -> str | None:
        """Load the first usable copy of ``step``; warn for each fast copy passed over.
        Collective over ``kwargs["process_group"]``: rank 0 says which copies are whole,
        and a copy that fails its checksums on any rank is passed over by every rank, so
        all of them load the same copy. ``quiet_missing``: when no copy is usable, None
        (the reason added to :attr:`passed_over`) instead of the error."""
        group = resolve_group(kwargs.get("process_group"))
        why = None
        reasons: list[str] = []
        for k, (tier, path) in enumerate(copies):
            last = k == len(copies) - 1
            whole = decided_by_rank0(group, lambda: bytes([tier.is_valid(path)])) == b"\x01"
            if not whole:
                why = f"{path} is missing or incomplete"
                reasons.append(why)
                self._failed.add(path)
                if last and not quiet_missing:
                    load_into(state_dict, path, storage_options=tier.storage_options, **kwargs)  # raises what is wrong
                continue
            if why is not None:
                fallback(f"step {step}: {why}; loading the durable copy {path}")
            error: Exception | None = None
            try:
                self.last_load = load_into(state_dict, path, storage_options=tier.storage_options, **kwargs)
            except Exception as e:  # agreed on below: no rank leaves while the others wait for it
                error = e
            if all_true(group, error is None):
                return path
            corrupt = all_true(group, error is None or isinstance(error, CorruptionError))
            where = _first_failure(group, error, path)  # (the same on every rank)
            if not corrupt:  # another kind of error is the same in every copy
                raise error or UnickptError(f"{path} could not be loaded{where}")
            if last and not quiet_missing:
                raise error or CorruptionError(f"{path} failed its checks{where}")
            self._failed.add(path)
            why = f"{path} failed its checks{where}"
            reasons.append(why)
        self.passed_over.append("; ".join(reasons))
        return None

    def _step_of(self, path: str) -> int | None:
        from .tiers import STEP

        for tier in [self.fast] + ([self.durable] if self.durable is not None else []):
            if _under(path, tier):
                m = STEP.match(str(path).rstrip("/").rsplit("/", 1)[-1])
                return int(m.group(1)) if m else None
        return None

    def _options_for(self, path: str) -> dict[str, Any] | None:
        if self.durable is not None and _under(path, self.durable):
            return self.durable.storage_options
        return self.fast.storage_options if _under(path, self.fast) else None


def durable_options(durable: str | os.PathLike | DurableOptions | None, every: int, keep: int | None,
                    storage_options: dict[str, Any] | None) -> Given[DurableOptions] | None:
    """The durable tier of ``durable=`` (a :class:`DurableOptions`, or the location with the
    flat ``durable_*`` keywords) as the user gave it, or None."""
    if durable is None:
        for name, value, default in (("durable_every", every, 1), ("durable_keep", keep, None),
                                     ("durable_storage_options", storage_options, None)):
            if value != default:  # said for a tier there is not: never silently ignored
                raise UnickptError(f"{name}={value!r} configures the durable tier: set durable too")
        return None
    given = durable if isinstance(durable, DurableOptions) else None
    flat = {"every": every, "keep": keep, "storage_options": storage_options} | ({} if given else {"url": durable})
    return DurableOptions.merged(given, flat, {"url": None})


def _reason(error: BaseException, path: str) -> str:
    """The first line of ``error`` without the location it starts with (the class of an
    error not unickpt's own before it)."""
    text = (str(error).splitlines() or [""])[0]
    text = text[len(path) + 2:] if text.startswith(f"{path}: ") else text
    return text if isinstance(error, UnickptError) else f"{type(error).__name__}: {text}"


def _first_failure(group: Any, error: BaseException | None, path: str) -> str:
    """Collective: `` on rank R (why)`` of the lowest rank whose load of ``path`` failed,
    the same text on every rank."""
    where = first_said(group, _reason(error, path) if error is not None else "")
    return f" on rank {where[0]} ({where[1]})" if where else ""


def _under(path: str, tier: Tier) -> bool:
    p = str(path).rstrip("/")
    if tier.remote:
        return p.startswith(tier.root + "/")
    return os.path.dirname(os.path.realpath(p)) == os.path.realpath(tier.root)


def fallback(message: str) -> None:
    """Say that a durable copy is loaded in place of the fast tier's (log and warning)."""
    log.warning("unickpt: %s", message)
    warnings.warn(message, TierFallbackWarning, stacklevel=4)
