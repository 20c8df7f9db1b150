"""The job's control plane: what the launchers and the trainers of a live-recovery job
say to each other through the c10d ``TCPStore`` that node 0's launcher hosts.

Every membership change opens a new *generation*: node 0's launcher (the coordinator)
writes its document ``g<N>`` (members in rank order, why it was opened) and then the
counter ``gen``. The process group of generation N rendezvouses under its own prefix
``g<N>/pg/``, never reused, so no key of an earlier generation can mislead a later one.
The launchers report what they see (a worker that exited, a replacement that is ready)
as numbered events; the trainers report progress (``beat``) and liveness (``alive``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from ..store_client import LIVE_NODE_STORE_ENV, LIVE_STORE_ENV, LIVE_WORKER_ENV, wait_key

if TYPE_CHECKING:
    from .launch_args import LaunchArgs

PREFIX = "unickpt/live/"


def key(*parts: Any) -> str:
    """A key of the control plane."""
    return PREFIX + "/".join(str(p) for p in parts)



def node_of(worker: str) -> int:
    """The node a worker id belongs to."""
    return int(worker.split(".")[0])


class Cause(StrEnum):
    """Why a generation began (a string on the store: ``"lost"`` compares equal to LOST)."""

    START = "start"  # the job's first
    LOST = "lost"  # members died or hung
    GROW = "grow"  # replacements join at the step boundary ``grow_at`` rank 0 sets
    END = "end"  # the job is over: ``code``, ``reason``
    RESTART = "restart"  # a plain script's group is restarted (``--max-restarts``): round ``code``


@dataclass
class Generation:
    """One generation of the job: its members (worker ids, in rank order) and why it began
    (:class:`Cause`)."""

    number: int
    members: list[str]
    cause: Cause = Cause.START
    lost: list[dict[str, Any]] = field(default_factory=list)  # {"rank": old rank, "worker", "exit": code}
    joined: list[str] = field(default_factory=list)
    code: int = 0
    reason: str = ""
    at: float = 0.0  # when the coordinator published it (wall clock)

    def __post_init__(self) -> None:
        self.cause = Cause(self.cause)  # a cause spelled as its string; ValueError for an unknown one

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, raw: bytes) -> "Generation":
        doc = json.loads(raw)
        return cls(int(doc["number"]), [str(m) for m in doc["members"]], str(doc["cause"]), list(doc["lost"]),
                   [str(j) for j in doc["joined"]], int(doc["code"]), str(doc["reason"]), float(doc["at"]))

    def active(self, multiple_of: int = 1) -> list[str]:
        """The members that train (in member order): the largest multiple of
        ``multiple_of`` not above the members' count; the others are hot spares. Whole
        nodes are kept together: the nodes with the most members are filled first (ties:
        the lower node), so a node that lost a rank gives up its rest before a rank is taken
        from each whole node."""
        n = len(self.members) // multiple_of * multiple_of
        if n == len(self.members):
            return list(self.members)
        by_node: dict[int, list[str]] = {}
        for m in self.members:
            by_node.setdefault(node_of(m), []).append(m)
        chosen: set[str] = set()
        for node in sorted(by_node, key=lambda x: (-len(by_node[x]), x)):
            chosen.update(by_node[node][: n - len(chosen)])
        return [m for m in self.members if m in chosen]

    def place(self, worker: str, multiple_of: int = 1) -> dict[str, int] | None:
        """Where ``worker`` sits in this generation's active world: rank, size, local rank,
        local size, node index and node count (nodes and local ranks dense, in member
        order); None for a hot spare."""
        active = self.active(multiple_of)
        if worker not in active:
            return None
        nodes = sorted({node_of(m) for m in active})
        mine = node_of(worker)
        local = [m for m in active if node_of(m) == mine]
        return {"rank": active.index(worker), "size": len(active), "local_rank": local.index(worker),
                "local_size": len(local), "node": nodes.index(mine), "nodes": len(nodes)}


MULTIPLE_KEY = PREFIX + "multiple_of"  # the workers' unickpt.run(fn, multiple_of=K), for the coordinator


def multiple_of(store: Any) -> int:
    """The job's ``multiple_of`` (1 until a worker said otherwise)."""
    return int(store.get(MULTIPLE_KEY)) if store.check([MULTIPLE_KEY]) else 1


CONFIG_KEY = PREFIX + "config"  # a store host's job: its shape and policy, set by the first launcher


def join_config(store: Any, args: LaunchArgs) -> None:
    """A launcher under ``--store``: record the job's shape for the store host's coordinator
    (the first launcher's wins: ``unickpt store``), and refuse a launcher whose shape differs."""
    mine = {"nnodes": args.nnodes, "nproc_per_node": args.nproc_per_node, "min_ranks": args.min_ranks,
            "max_restarts": args.max_restarts, "join_timeout": args.join_timeout}
    have = json.loads(store.compare_set(CONFIG_KEY, "", json.dumps(mine)))
    if any(have.get(k) != v for k, v in mine.items() if k in ("nnodes", "nproc_per_node")):
        raise SystemExit(f"unickpt launch: the job at --store {args.store} has {have['nnodes']} node(s) of "
                         f"{have['nproc_per_node']} process(es); this launcher says {args.nnodes} of {args.nproc_per_node}")


GO_ALL = "all"  # generation N's ``go`` key: every member arrived (else "superseded": a newer one exists)


def publish(store: Any, gen: Generation) -> None:
    """Coordinator: open generation ``gen`` (its document first, then the counter), and
    close the previous one's arrival (its members still gathering go on to ``gen``)."""
    gen.at = time.time()
    store.set(key("g", gen.number), gen.to_json())
    store.set(key("gen"), str(gen.number))
    if gen.number > 0:
        store.compare_set(key("g", gen.number - 1, "go"), "", "superseded")


def watch_key(worker: str, number: int) -> str:
    """The key in a node's store that wakes ``worker``'s watcher for generation ``number``
    (its launcher relays each generation there; the worker sets it itself to end its
    watcher: a wait with no timeout, so torch logs none)."""
    return key("w", worker, "g", number)


def mail(store: Any, node: int, **doc: Any) -> None:
    """Coordinator (or a launcher to itself): put a message in node ``node``'s mailbox on
    the job's store: ``gen`` (a generation was published), ``probe`` (answer to prove the
    node is up), ``stop`` (the launcher's own: its mailbox thread ends)."""
    i = int(store.add(key("node", node, "nmail"), 1)) - 1
    store.set(key("node", node, "mail", i), json.dumps(doc))


def read_mail(store: Any, node: int, i: int, timeout_s: float) -> dict[str, Any] | None:
    """Message ``i`` of node ``node``'s mailbox, waiting up to ``timeout_s`` (None then)."""
    name = key("node", node, "mail", i)
    if not wait_key(store, name, timeout_s):
        return None
    return json.loads(store.get(name))


def newest(store: Any) -> int:
    """The number of the newest generation published (-1 before the first)."""
    if not store.check([key("gen")]):
        return -1
    return int(store.get(key("gen")))


def read(store: Any, number: int) -> Generation:
    """Generation ``number``'s document (waits until it is published)."""
    return Generation.from_json(store.get(key("g", number)))


@dataclass(frozen=True)
class Exited:
    """A launcher reaped one of its workers: its exit ``code`` (negative: the signal) and
    ``why`` in words, at ``at`` (wall clock); ``error``: what it recorded in its
    ``TORCHELASTIC_ERROR_FILE`` (torchrun's ``@record``: ``RuntimeError: ...``), or ''."""

    worker: str
    code: int
    at: float
    why: str
    error: str = ""


@dataclass(frozen=True)
class Ready:
    """A replacement worker on ``node`` waits to join the next generation."""

    worker: str
    node: int


@dataclass(frozen=True)
class Suspect:
    """A worker's collective failed at ``at``: the coordinator probes the nodes (is one gone?)."""

    worker: str
    at: float


@dataclass(frozen=True)
class Stopped:
    """Node ``node``'s launcher got ``signal`` (SIGINT, SIGTERM): the job stops."""

    node: int
    signal: int


@dataclass(frozen=True)
class Raised:
    """``fn`` raised for good on ``worker``: the error, where, and whether it is a failure
    of the process the job recovers from (``recoverable``) or a bug that ends it."""

    worker: str
    error: str
    where: str
    recoverable: bool


Event = Exited | Ready | Suspect | Stopped | Raised
_KINDS: dict[str, type] = {"exit": Exited, "ready": Ready, "suspect": Suspect, "stop": Stopped, "raised": Raised}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}
_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def post_event(store: Any, event: Event) -> None:
    """A report to the coordinator, numbered in the order it reaches the store."""
    doc = {"kind": _KIND_OF[type(event)], **dataclasses.asdict(event)}
    i = store.add(key("nevents"), 1) - 1
    store.set(key("event", i), json.dumps(doc))


def parse_event(raw: bytes) -> Event:
    """An event read back from the store (untrusted: checked field by field); ValueError
    saying what is wrong with it."""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise ValueError(f"not JSON: {bytes(raw)[:80]!r}") from None
    cls = _KINDS.get(doc.get("kind")) if isinstance(doc, dict) else None
    if cls is None:
        raise ValueError(f"no known kind: {str(doc)[:80]}")
    values = {}
    for f in dataclasses.fields(cls):
        value = doc.get(f.name)
        if not isinstance(value, _TYPES[str(f.type)]) or (f.type != "bool" and isinstance(value, bool)):
            raise ValueError(f"{doc['kind']} event: {f.name} is {value!r}, not a {f.type}")
        values[f.name] = value
    return cls(**values)


def worker_env(address: str, worker: str, node_address: str | None = None) -> dict[str, str]:
    """The variables through which ``unickpt.run`` finds the job's control plane (and its
    node's store, where it reports progress and liveness to its own launcher only)."""
    return {LIVE_STORE_ENV: address, LIVE_WORKER_ENV: worker, **({LIVE_NODE_STORE_ENV: node_address} if node_address else {})}


def under_launch() -> bool:
    """True in a worker that ``unickpt launch`` started."""
    return bool(os.environ.get(LIVE_STORE_ENV)) and bool(os.environ.get(LIVE_WORKER_ENV))

