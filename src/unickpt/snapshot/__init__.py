"""The in-memory snapshot tier (docs/SNAPSHOT.md): per-node keeper processes hold each
rank's snapshot in host shared memory, erasure coding across nodes (XOR, Reed-Solomon) or
copies on neighbours rebuild lost nodes, and
recovery loads the newest whole, verified state onto any layout.

Exports are imported on first use: the keeper process imports this package without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Snapshotter": "client", "ensure_keeper": "keeper_admin", "stop_keeper": "keeper_admin", "job_id": "client",
    "recover": "recover", "Outcome": "recover",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # over the submodule of the same name ("recover") bound by the import
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
