import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))


def _worker_ports() -> None:
    """Under pytest-xdist, each worker (gw0, gw1, ...) takes the free ports its tests hand
    to torchrun, rendezvous and servers from a slice of its own below the kernel's
    ephemeral range (unickpt.testing.free_port reads it): two workers never pick the same
    port, and the kernel never gives it to a client socket in between."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return
    try:
        ephemeral = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    width = 2000
    lo = 10000 + width * int(worker[2:])
    if lo + width <= ephemeral:
        os.environ["UNICKPT_TEST_PORTS"] = f"{lo}-{lo + width - 1}"


_worker_ports()


@pytest.fixture
def shm_roots():
    """Shm roots a test registers; the snapshot keepers left under them are killed after it."""
    from snapshot_helpers import kill_keeper

    roots: list[str] = []
    yield roots
    for r in roots:
        kill_keeper(r)
