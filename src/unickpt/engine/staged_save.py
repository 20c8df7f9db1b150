"""One save as every writer carries it (:class:`StagedSave`): where and how it writes (its
:class:`~unickpt.SaveOptions`, whole) and, once staged, this rank's captured state, so that
it can finish without the live state_dict, in the loop (``unickpt.save``) or in a
background thread (``unickpt.async_save``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..dist import Group
from .collect import LocalState
from .save_options import SaveOptions
from .unchanged import BaseIndex

__all__ = ["StagedSave"]


@dataclass
class StagedSave:
    """A save: where and how it writes, and, once staged, this rank's captured state.

    Attributes:
        group: The group saving together.
        path: The checkpoint's directory or URL.
        options: How each rank's file is written (threads, checksum block, staging cap).
        overwrite: Replace a committed checkpoint at ``path`` once this one commits.
        metadata: Plain values for the manifest.
        storage_options: Options of a URL's file system (fsspec).
        base: Opens the base of an incremental save (None: a full save); its failure is
            this rank's, reported at the commit.
        local: This rank's captured state (None until staged, or when staging failed).
        error: Why staging failed on this rank (reported to every rank at the commit).
    """

    group: Group
    path: str
    options: SaveOptions
    overwrite: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    storage_options: dict[str, Any] | None = None
    base: Callable[[], BaseIndex] | None = None
    local: LocalState | None = None
    error: str | None = None
