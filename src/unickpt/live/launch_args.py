"""One node's launch, typed: what ``unickpt launch``'s command line (:mod:`.launch_cli`)
resolves to, and what the launcher (:mod:`.launch`) and ``unickpt store``'s coordinator
(:mod:`.store_host`) run on; torchrun's defaults. Kept apart from both so that the
command line (imported by every ``unickpt`` command) does not import the launcher."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .output import Std

SHUTDOWN_TIMEOUT_S = 30.0  # torchrun's: after the forwarded SIGINT/SIGTERM, SIGKILL
JOIN_TIMEOUT_S = 600.0  # torchrun's c10d rendezvous join_timeout
RDZV_PORT = 29400  # torchrun's port when --rdzv-endpoint names none
MASTER_PORT = 29500  # torchrun's --master-port
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's --signals-to-handle


@dataclass(frozen=True)
class LaunchArgs:
    """One node's launch, resolved from ``unickpt launch``'s command line
    (:mod:`.launch_cli`): torchrun's rendezvous flags are already mapped onto the job's
    store (``master_addr:master_port``), ``--nproc-per-node`` onto a number, ``--tee``,
    ``--redirects``, ``--local-ranks-filter``, ``--signals-to-handle`` and the
    ``--duplicate-*-filters`` onto their values. ``unickpt store``
    builds one too (the coordinator's fields; the others keep their defaults)."""

    script: str = ""  # a path; with ``module`` a module; with ``no_python`` a program
    script_args: list[str] = field(default_factory=list)  # passed through untouched
    module: bool = False
    role: str = "default"  # the workers' ROLE_NAME (torchrun's --role)
    no_python: bool = False
    start_method: str = "spawn"  # or "forkserver": workers forked from a server that imported torch (.forked)
    preload: tuple[str, ...] = ()  # with forkserver: modules the server also imports (--preload)
    nnodes: int = 1
    node_rank: int = 0  # -1: the coordinator of `unickpt store`, on no node
    master_addr: str = "127.0.0.1"  # node 0's address: where the job's store is
    master_port: int = MASTER_PORT  # 0 with ``standalone``: a free port
    standalone: bool = False
    store: str | None = None  # HOST:PORT of `unickpt store`, which hosts the store and coordinates
    rdzv_id: str = "none"
    nproc_per_node: int = 1
    max_restarts: int = 0
    hang_timeout: float | None = None  # None: DEFAULT_HANG_TIMEOUT_S (see hang_limit); 0: never
    min_ranks: int = 1
    join_timeout: float = JOIN_TIMEOUT_S
    shutdown_timeout: float = SHUTDOWN_TIMEOUT_S
    log_dir: str | None = None
    tee_spec: Std = frozenset()
    redirects_spec: Std = frozenset()
    local_filter: frozenset[int] | None = None  # the local ranks shown on the console (None: all)
    signals: tuple[int, ...] = tuple(signal.Signals[n] for n in SIGNALS_TO_HANDLE.split(","))  # stop the job
    duplicate: dict[str, tuple[str, ...]] = field(default_factory=dict)  # stream: needles (--duplicate-*-filters)
