"""CheckpointManager: numbered checkpoints under one directory, resume from the latest
valid one, retention."""

from __future__ import annotations

import os
import re
from typing import Any

from ..dist import resolve_group
from ..errors import UnickptError
from ..format.manifest import MANIFEST_NAME
from ..storage.local import list_subdirs, remove_checkpoint
from ..storage.open import open_storage
from ..storage.transaction import remove_abandoned
from .load import load, read_manifest
from .save import save

_STEP = re.compile(r"^step_(\d+)$")


class CheckpointManager:
    """Checkpoints ``root/step_00000100`` ...; keeps the newest ``keep`` (all when None).

    ``latest()`` is the newest checkpoint that is committed and whose manifest and data
    files are intact (sizes checked; pass ``verify=True`` to re-check every checksum), so
    a run resumes from the last good checkpoint even after a crash during a save.
    """

    def __init__(self, root: str | os.PathLike, keep: int | None = None) -> None:
        if keep is not None and keep < 1:
            raise UnickptError(f"keep must be at least 1, not {keep}")
        self.root = str(root)
        self.keep = keep

    def path_for(self, step: int) -> str:
        """Directory of the checkpoint of ``step``."""
        return os.path.join(self.root, f"step_{step:08d}")

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first."""
        out = []
        for name in list_subdirs(self.root):
            m = _STEP.match(name)
            if m and open_storage(os.path.join(self.root, name)).exists(MANIFEST_NAME):
                out.append(int(m.group(1)))
        return sorted(out)

    def is_valid(self, path: str, verify: bool = False) -> bool:
        """True when ``path`` is a committed checkpoint whose files are all there, whole."""
        try:
            manifest = read_manifest(path)
            storage = open_storage(path)
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

    def save(self, state_dict: dict[str, Any], step: int, **kwargs: Any) -> str:
        """Save ``state_dict`` as the checkpoint of ``step`` (collective), then apply retention."""
        path = self.path_for(step)
        save(state_dict, path, **kwargs)
        if resolve_group(kwargs.get("process_group")).rank == 0:
            if self.keep is not None:
                for old in self.steps()[: -self.keep]:
                    remove_checkpoint(self.path_for(old), MANIFEST_NAME)
            remove_abandoned(self.root)  # what saves killed midway left: their space comes back
        return path

    def load(self, state_dict: dict[str, Any], path: str | None = None, **kwargs: Any) -> str | None:
        """Load ``path`` (default: the latest valid checkpoint) into ``state_dict``.
        Returns the path loaded, or None when there is no checkpoint yet."""
        path = path or self.latest()
        if path is None:
            return None
        load(state_dict, path, **kwargs)
        return path
