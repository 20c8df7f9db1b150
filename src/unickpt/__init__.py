"""unickpt: universal, fast, fault-tolerant checkpointing for distributed PyTorch."""

__version__ = "0.1.0"

from .api.async_save import AsyncSaveHandle, async_save  # noqa: E402
from .api.convert import convert  # noqa: E402
from .api.load import load, load_rank_values, load_tensor, read_manifest  # noqa: E402
from .api.manager import CheckpointManager, TierFallbackWarning  # noqa: E402
from .api.save import save  # noqa: E402
from .engine.state import PerRank, Sharded  # noqa: E402
from .api.verify import verify  # noqa: E402
from .errors import (  # noqa: E402
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

__all__ = [
    "save", "load", "CheckpointManager", "load_tensor", "load_rank_values", "read_manifest", "PerRank", "Sharded", "verify",
    "UnickptError", "NotACheckpointError", "FormatVersionError", "ManifestError", "CorruptionError",
    "LayoutError", "MismatchError", "InconsistentStateError", "SaveError", "SnapshotError", "StorageError", "UnsafePickleError",
    "TierFallbackWarning",
]
