"""The environment ``unickpt launch`` gives its workers, and the client of its c10d store:
one leaf that the live-recovery wing (:mod:`unickpt.live`) and the snapshot tier
(:mod:`unickpt.snapshot`) share, so that each name is spelled once and both connect the
same way (IPv6 addresses included). No torch at import: the keepers import this."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = [
    "LIVE_DEBUG_ENV", "LIVE_NODE_STORE_ENV", "LIVE_PG_TIMEOUT_ENV", "LIVE_STORE_ENV", "LIVE_TIMINGS_ENV", "LIVE_WORKER_ENV", "connect",
    "split_address", "torchrun_env", "wait_key",
]

LIVE_STORE_ENV = "UNICKPT_LIVE_STORE"  # host:port of the job's store, set by `unickpt launch`
LIVE_WORKER_ENV = "UNICKPT_LIVE_WORKER"  # a worker's id in the job (node.local[.replacement])
LIVE_NODE_STORE_ENV = "UNICKPT_LIVE_NODE_STORE"  # host:port of its node's launcher's own store (beats, liveness)
LIVE_PG_TIMEOUT_ENV = "UNICKPT_LIVE_PG_TIMEOUT"  # seconds a worker's collective may wait for its peers
LIVE_TIMINGS_ENV = "UNICKPT_LIVE_TIMINGS"  # a file rank 0 appends each re-forming's phases to (JSON lines)
LIVE_DEBUG_ENV = "UNICKPT_LIVE_DEBUG"  # set: the workers and launchers say more about each re-forming


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); ValueError when it is not."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def connect(address: str, timeout_s: float = 600.0) -> Any:
    """A new client connection to the TCPStore at ``host:port`` (``timeout_s``: each
    request's)."""
    from torch.distributed import TCPStore

    from .kept_connections import keep

    host, port = split_address(address)
    keep(host, port)  # a re-forming's cut of the groups never takes it for a group's (see there)
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                    use_libuv=True)


def wait_key(store: Any, name: str, timeout_s: float) -> bool:
    """Block until ``name`` exists in the store (True) or ``timeout_s`` passed (False)."""
    from torch.distributed import DistStoreError

    try:
        store.wait([name], timedelta(seconds=max(timeout_s, 0.001)))
        return True
    except DistStoreError:  # torch 2.13's TCPStore: a wait that timed out (a lost host: DistNetworkError)
        return False


def torchrun_env(rank: int, size: int, local_rank: int, local_size: int, node: int, nodes: int,
                 restarts: int) -> dict[str, str]:
    """The variables torchrun gives a worker for its place in the world (the rest of
    torchrun's environment, set once per worker, stays as it is)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(size), "TORCHELASTIC_RESTART_COUNT": str(restarts)}
