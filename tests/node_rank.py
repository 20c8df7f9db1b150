"""A worker of a simulated node (tests/node_fork.py): torchrun's ``--run-path`` runs this
file in each forked worker. It records the rank's pid (``$NODE_PIDS/rank<RANK>``, for the
tests that kill a rank) and runs the training script, or ``-m MODULE``, as ``__main__``,
as ``python script ...`` / ``python -m module ...`` would."""

from __future__ import annotations

import os
import sys

from forked_child import run_main


def main() -> None:
    pids = os.environ.get("NODE_PIDS")
    if pids:
        os.makedirs(pids, exist_ok=True)
        path = os.path.join(pids, f"rank{os.environ['RANK']}")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
    try:
        run_main(sys.argv[1:])
    except SystemExit as e:  # torchrun's fork workers must return to report success; an error code stays one
        if e.code not in (None, 0):
            raise

if __name__ == "__main__":
    main()
