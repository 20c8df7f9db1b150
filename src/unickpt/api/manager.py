"""CheckpointManager: numbered checkpoints under one directory, resume from the latest
valid one, retention (that follows the references of incremental checkpoints)."""

from __future__ import annotations

import os
import re
from typing import Any

from ..adapters.detect import open_manifest
from ..dist import broadcast_bytes, resolve_group
from ..errors import UnickptError
from ..format.manifest import MANIFEST_NAME
from ..storage.local import LocalStorage, list_subdirs
from ..storage.transaction import remove_abandoned
from .incremental import prune
from .load import load, read_manifest
from .save import checkpoint_file, save

_STEP = re.compile(r"^step_(\d+)$")


class CheckpointManager:
    """Checkpoints ``root/step_00000100`` ...; keeps the newest ``keep`` (all when None).

    ``latest()`` is the newest checkpoint that is committed and whose manifest and data
    files are intact (sizes checked; pass ``verify=True`` to re-check every checksum), so
    a run resumes from the last good checkpoint even after a crash during a save.

    ``incremental=True``: every save after the first is incremental against the latest
    valid checkpoint (only changed fragments are written, the others referenced), and
    every ``full_every``-th save is a full one (None: only the first). Retention then
    keeps, besides the newest ``keep``, every checkpoint one of them references, and
    deletes in an order that a kill at any point leaves every committed checkpoint whole
    (so ``steps()`` may list, besides the newest ``keep``, older checkpoints that hold
    bytes of kept ones; they go once nothing kept references them).
    """

    def __init__(
        self, root: str | os.PathLike, keep: int | None = None, *, incremental: bool = False, full_every: int | None = None,
    ) -> None:
        if keep is not None and keep < 1:
            raise UnickptError(f"keep must be at least 1, not {keep}")
        if full_every is not None and full_every < 1:
            raise UnickptError(f"full_every must be at least 1, not {full_every}")
        self.root = str(root)
        self.keep = keep
        self.incremental = incremental
        self.full_every = full_every

    def path_for(self, step: int) -> str:
        """Directory of the checkpoint of ``step``."""
        return os.path.join(self.root, f"step_{step:08d}")

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first."""
        out = []
        for name in list_subdirs(self.root):
            m = _STEP.match(name)
            if m and LocalStorage(os.path.join(self.root, name)).exists(MANIFEST_NAME):
                out.append(int(m.group(1)))
        return sorted(out)

    def is_valid(self, path: str, verify: bool = False) -> bool:
        """True when ``path`` is a committed checkpoint whose files are all there, whole."""
        try:
            manifest = read_manifest(path)
            storage = LocalStorage(path)
            if any(storage.size(f) != n for f, n in manifest.files.items()):
                return False
            if verify:
                from .verify import verify as verify_checkpoint

                return verify_checkpoint(path).ok
            return True
        except UnickptError:
            return False

    def latest(self, verify: bool = False) -> str | None:
        """The newest valid checkpoint, or None."""
        for step in reversed(self.steps()):
            path = self.path_for(step)
            if self.is_valid(path, verify):
                return path
        return None

    def base_for(self, step: int) -> str | None:
        """The base of an incremental save of ``step``: the latest valid checkpoint, unless
        the save is to be a full one (the first, every ``full_every``-th, or no base)."""
        if not self.incremental:
            return None
        base = self.latest()
        if base is None or os.path.abspath(base) == os.path.abspath(self.path_for(step)):
            return None
        try:
            depth = (open_manifest(base).incremental or {}).get("depth", 0)
        except UnickptError:
            return None
        if self.full_every is not None and depth + 1 >= self.full_every:
            return None
        return base

    def save(self, state_dict: dict[str, Any], step: int, **kwargs: Any) -> str:
        """Save ``state_dict`` as the checkpoint of ``step`` (collective), then apply retention."""
        path = self.path_for(step)
        group = resolve_group(kwargs.get("process_group"))
        if self.incremental and "base" not in kwargs:  # rank 0 chooses, so every rank has the same base
            chosen = self.base_for(step) if group.rank == 0 else None
            kwargs["base"] = broadcast_bytes(group, (chosen or "").encode(), 0).decode() or None
        save(state_dict, path, **kwargs)
        if group.rank == 0:
            self.prune()
        return path

    def prune(self) -> list[str]:
        """Apply retention now (``save`` does after each save): delete the checkpoints
        beyond the newest ``keep`` that no kept checkpoint references, and what saves and
        deletions killed midway left. Returns the checkpoint directories deleted."""
        deleted: list[str] = []
        if self.keep is not None:
            committed = [self.path_for(s) for s in self.steps()]
            deleted = prune(committed, self.keep, self._interrupted())
        remove_abandoned(self.root)  # what saves killed midway left: their space comes back
        return deleted

    def _interrupted(self) -> list[str]:
        """Step directories without a manifest holding nothing but checkpoint files: what a
        deletion killed midway left."""
        out = []
        for name in list_subdirs(self.root):
            path = os.path.join(self.root, name)
            if not _STEP.match(name) or LocalStorage(path).exists(MANIFEST_NAME):
                continue
            names = LocalStorage(path).names()
            if all(checkpoint_file(n) or n.startswith(".") for n in names) and all(
                os.path.isfile(os.path.join(path, n)) for n in names
            ):
                out.append(path)
        return out

    def load(self, state_dict: dict[str, Any], path: str | None = None, **kwargs: Any) -> str | None:
        """Load ``path`` (default: the latest valid checkpoint) into ``state_dict``.
        Returns the path loaded, or None when there is no checkpoint yet."""
        path = path or self.latest()
        if path is None:
            return None
        load(state_dict, path, **kwargs)
        return path
