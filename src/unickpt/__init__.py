"""unickpt: universal, fast, fault-tolerant checkpointing for distributed PyTorch."""

from .errors import (
    CheckpointExistsError,
    CorruptionError,
    FormatVersionError,
    InconsistentStateError,
    LayoutError,
    ManifestError,
    MismatchError,
    NotACheckpointError,
    SaveError,
    StorageError,
    SnapshotError,
    UnickptError,
    UnsafePickleError,
)

from .version import __version__ as __version__
from . import logs as _logs  # noqa: F401  (the unickpt logger's default handler: console lines, warnings)

# The entry points import torch: they are loaded on first use (PEP 562), so that
# ``import unickpt`` (and the command line's start) costs no torch import.
_LAZY = {
    "save": "api.save", "async_save": "api.async_save", "AsyncSaveHandle": "api.async_save",
    "load": "api.load", "load_rank_values": "api.load", "load_tensor": "api.load", "read_manifest": "api.load",
    "convert": "api.convert", "verify": "api.verify", "CheckpointManager": "api.manager",
    "Checkpoints": "api.checkpoints", "TierFallbackWarning": "api.checkpoints",
    "SaveOptions": "api.options", "SaveSchedule": "api.options", "SnapshotOptions": "api.options",
    "DurableOptions": "api.options", "DeltaLogOptions": "api.options",
    "run": "live.run", "World": "live.run",
    "PerRank": "engine.state", "Sharded": "engine.state", "RNGState": "engine.rng",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'unickpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# the public surface: the entry points above and the errors (tests/test_public_surface.py
# keeps this list, _LAZY and docs/API.md in step)
__all__ = [
    "save", "async_save", "AsyncSaveHandle", "load", "load_tensor", "load_rank_values", "read_manifest", "verify",
    "convert", "CheckpointManager", "Checkpoints", "TierFallbackWarning",
    "SaveOptions", "SaveSchedule", "SnapshotOptions", "DurableOptions", "DeltaLogOptions", "PerRank", "Sharded", "RNGState",
    "UnickptError", "NotACheckpointError", "FormatVersionError", "ManifestError", "CorruptionError",
    "LayoutError", "MismatchError", "InconsistentStateError", "SaveError", "CheckpointExistsError", "SnapshotError", "StorageError", "UnsafePickleError",
    "run", "World",
]
