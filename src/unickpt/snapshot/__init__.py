"""The in-memory snapshot tier (docs/SNAPSHOT.md): per-node keeper processes hold each
rank's snapshot in host shared memory, XOR parity across nodes rebuilds a lost node, and
recovery loads the newest whole, verified state onto any layout."""

from .client import Snapshotter, ensure_keeper, job_id, stop_keeper
from .recover import Outcome, recover

__all__ = ["Snapshotter", "recover", "Outcome", "ensure_keeper", "stop_keeper", "job_id"]
