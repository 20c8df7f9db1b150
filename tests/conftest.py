import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def shm_roots():
    """Shm roots a test registers; the snapshot keepers left under them are killed after it."""
    from snapshot_helpers import kill_keeper

    roots: list[str] = []
    yield roots
    for r in roots:
        kill_keeper(r)
