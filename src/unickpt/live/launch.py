"""``unickpt launch``: torchrun's static launch, where a failure costs the survivors nothing.

One launcher per node starts the node's workers with torchrun's environment (a plain
torch script runs unchanged), sees a child exit in milliseconds (SIGCHLD), and never
kills a surviving worker of a job that uses ``unickpt.run``: it reports the loss through
the job's c10d ``TCPStore``, and node 0's launcher (which hosts the store: the control
plane) opens a new generation without the lost workers (see :mod:`.control`). It kills
a worker that shows no progress for ``--hang-timeout`` seconds (a hang becomes a
crash), starts up to ``--max-restarts`` replacement workers in the background (they join
at a step boundary), and ends the job below ``--min-ranks`` ranks.

Exit status: 0 when the node's surviving workers ended 0; otherwise the failed worker's
code (a plain script whose rank fails ends the whole job, as under torchrun), or 1.
"""

from __future__ import annotations

import argparse
import json
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from . import control
from .control import Generation, key

NODE_TIMEOUT_S = 3.0  # a node whose launcher is silent this long is lost
STILL_S = 2.0  # a worker whose watcher thread is silent this long is stopped or holds the GIL
BEAT_S = 0.2  # how often a launcher looks for hangs (in its node's own store)
NODE_BEAT_S = 0.5  # how often a launcher tells the job's store it is alive and looks for the job's end
MAIL_WAIT_S = 3600.0  # the mailbox thread's wait in the job's store (woken by a message: no timeout logged)
PROBE_S = 0.5  # a launcher that does not answer a probe within this is lost (a live one answers in milliseconds)
BATCH_S = 0.02  # exits this close together open one generation
END_GRACE_S = 5.0  # after SIGTERM at the job's end, SIGKILL
PG_TIMEOUT_ENV = "UNICKPT_LIVE_PG_TIMEOUT"  # seconds a worker's collective may wait for its peers
DEFAULT_PG_TIMEOUT_S = 60.0


def parse(argv: list[str]) -> argparse.Namespace:
    """torchrun's static flags (torchrun's names), and live recovery's."""
    p = argparse.ArgumentParser(prog="unickpt launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--standalone", action="store_true", help="one node, the store on a free local port")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=29500)
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="replacement workers this node may start over the job")
    p.add_argument("--hang-timeout", type=float, default=0.0,
                   help="kill a worker that shows no progress for this many seconds (0: never)")
    p.add_argument("--min-ranks", type=int, default=1, help="end the job below this many ranks")
    p.add_argument("--store", default=None, metavar="HOST:PORT",
                   help="the job's store, hosted by `unickpt store --port PORT` on HOST (which also coordinates the "
                   "job): no node hosts it, so the loss of node 0 is a node loss like any other")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.standalone:
        args.nnodes, args.node_rank, args.master_addr, args.master_port = 1, 0, "127.0.0.1", 0
    if not 0 <= args.node_rank < args.nnodes or args.nproc_per_node < 1 or args.min_ranks < 1:
        p.error("need 0 <= --node-rank < --nnodes, --nproc-per-node >= 1 and --min-ranks >= 1")
    if args.store is not None:
        host, _, port = args.store.rpartition(":")
        if not host or not port.isdigit():
            p.error(f"--store {args.store}: expected HOST:PORT (where `unickpt store --port PORT` runs)")
        if args.standalone:
            p.error("--store and --standalone: --standalone hosts the store in this launcher; give one of them")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the node's launcher; returns its exit status."""
    args = parse(sys.argv[1:] if argv is None else argv)
    from torch.distributed import TCPStore

    if args.store is not None:  # a store host of its own coordinates the job
        from .store_host import join_config

        store = control.connect(args.store)
        join_config(store, args)
        address = args.store
        node_store = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
        return Launcher(args, store, address, node_store).run()
    if args.node_rank == 0:
        store = TCPStore(args.master_addr if not args.standalone else "127.0.0.1", args.master_port, is_master=True,
                         timeout=timedelta(seconds=600), wait_for_workers=False)
    else:
        store = control.connect(f"{args.master_addr}:{args.master_port}")
    address = f"{args.master_addr}:{store.port}"
    # this node's own store: its workers' progress and liveness, read by this launcher only
    node_store = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    return Launcher(args, store, address, node_store).run()


@dataclass
class Worker:
    """A worker process this launcher started."""

    name: str
    local: int
    proc: subprocess.Popen
    progress: str = ""
    progress_at: float = field(default_factory=time.monotonic)
    alive: int = 0
    alive_at: float = field(default_factory=time.monotonic)
    hung: float = 0.0  # seconds without progress when it was killed for it


class Launcher:
    """One node's launcher (node 0's is also the job's coordinator)."""

    def __init__(self, args: argparse.Namespace, store: Any, address: str, node_store: Any = None) -> None:
        self.args, self.store, self.address = args, store, address
        self.node_store = node_store if node_store is not None else store
        self.node_address = f"127.0.0.1:{node_store.port}" if node_store is not None else None
        self.relayed = -1  # the newest generation relayed to this node's workers
        self.relay_lock = threading.Lock()
        self.node = args.node_rank
        self.workers: dict[int, Worker] = {}  # pid -> worker
        self.codes: dict[str, int] = {}  # exit code of each worker that ended
        self.restarts = 0
        self.coordinator = Coordinator(store, args) if self.node == 0 and args.store is None else None
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def run(self) -> int:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)
        if self.coordinator is not None:
            self.coordinator.start()
        while control.newest(self.store) < 0:
            time.sleep(0.01)
        mailbox = threading.Thread(target=self._mailbox, name="unickpt-launch-mailbox", daemon=True)
        mailbox.start()
        try:
            return self._run()
        finally:
            try:
                control.mail(self.store, self.node, stop=1)  # wakes the mailbox thread: it ends
            except RuntimeError:
                pass  # the job's store is gone: the thread's wait has failed already
            mailbox.join(2.0)

    def _mailbox(self) -> None:
        """Read this node's mailbox on the job's store (one waiter a node, woken by each
        message, no timeout): relay every generation published to this node's workers, on
        the node's own store (each worker's watcher waits on its own key there), and answer
        the coordinator's probes (a node whose launcher answers is up, however slow its
        workers)."""
        try:
            client = control.connect(self.address)
            i = 0
            while True:
                msg = control.read_mail(client, self.node, i, MAIL_WAIT_S)
                if msg is None:
                    continue
                i += 1
                if "stop" in msg:
                    return
                if "probe" in msg:
                    client.add(key("probe", msg["probe"], "acks"), 1)
                    client.set(key("probe", msg["probe"], "ack", self.node), "1")
                if "gen" in msg:
                    self._relay(int(msg["gen"]))
        except RuntimeError:
            return  # the job's store is gone (its host ended or was lost)

    def _relay(self, upto: int) -> None:
        """Wake every worker of this node for generations up to ``upto``."""
        if self.node_address is None:
            return
        with self.relay_lock:
            names = [w.name for w in self.workers.values()]
            for n in range(self.relayed + 1, upto + 1):
                for name in names:
                    self.node_store.set(control.watch_key(name, n), "1")
            self.relayed = max(self.relayed, upto)

    def _run(self) -> int:
        for local in range(self.args.nproc_per_node):  # names beyond generation 0's: a node that joins later
            self._spawn(self._new_name(), local)
        next_beat = next_node_beat = 0.0
        while True:
            select.select([self.wake_r], [], [], 0.01)
            try:
                while os.read(self.wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            self._reap()
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + BEAT_S
                if self.args.hang_timeout:
                    self._find_hangs(now)
            end = None
            if now >= next_node_beat:  # the job's store: a request or two a node every NODE_BEAT_S
                next_node_beat = now + NODE_BEAT_S
                self.store.add(key("node", self.node, "beat"), 1)
                if self.coordinator is None:
                    end = self._ended()
            if self.coordinator is not None:  # the store's host looks for the end every turn
                self.coordinator.step()
                end = self._ended()
            if end is not None:
                return self._finish(end)
            if not self.workers:
                self.store.set(key("node", self.node, "done"), "1")
                if self.coordinator is None or self.coordinator.all_done():
                    return self._status()

    # -- workers ----------------------------------------------------------------------------
    def _new_name(self) -> str:
        return f"{self.node}.{self.store.add(key('node', self.node, 'started'), 1) - 1}"

    def _spawn(self, name: str, local: int) -> None:
        a = self.args
        world = a.nnodes * a.nproc_per_node
        rank = self.node * a.nproc_per_node + local
        env = dict(os.environ)
        env.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(a.nproc_per_node),
                   GROUP_RANK=str(self.node), GROUP_WORLD_SIZE=str(a.nnodes), ROLE_RANK=str(rank),
                   ROLE_WORLD_SIZE=str(world), ROLE_NAME="default", MASTER_ADDR=self.address.rpartition(":")[0],
                   MASTER_PORT=self.address.rpartition(":")[2], TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS=str(a.max_restarts),
                   TORCHELASTIC_RUN_ID="unickpt", **control.worker_env(self.address, name, self.node_address))
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort the communicators, never the process
        # a survivor blocked in a collective whose peers cannot free the old group gives up then
        env.setdefault(PG_TIMEOUT_ENV, str(max(10.0, 2 * a.hang_timeout) if a.hang_timeout else DEFAULT_PG_TIMEOUT_S))
        if a.nproc_per_node > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        self.node_store.set(key("beat", name), "")
        cmd = [sys.executable, "-u"] + (["-m", a.script] if a.module else [a.script]) + list(a.script_args)
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
        with self.relay_lock:  # the generations relayed before it started are there for its watcher
            self.workers[proc.pid] = Worker(name, local, proc)
            for n in range(self.relayed + 1):
                self.node_store.set(control.watch_key(name, n), "1")

    def _reap(self) -> None:
        for pid, w in list(self.workers.items()):
            code = w.proc.poll()
            if code is None:
                continue
            with self.relay_lock:
                del self.workers[pid]
            self.codes[w.name] = code
            control.post_event(self.store, kind="exit", worker=w.name, code=code, at=time.time(), why=self._why(w, code))
            if code != 0:
                if self.restarts < self.args.max_restarts and self.store.check([key("run", w.name)]):
                    self.restarts += 1
                    self._spawn(self._new_name(), w.local)

    def _why(self, w: Worker, code: int) -> str:
        return f"hung: no progress for {w.hung:.0f} s, exit {code}" if w.hung else f"exit {code}"

    def _find_hangs(self, now: float) -> None:
        """Kill the workers that showed no progress for --hang-timeout seconds and whose
        watcher thread is silent too (a stopped process, or one holding the GIL). A worker
        blocked in a collective on a dead peer is not hung: its collective fails within the
        generation's timeout (``PG_TIMEOUT_ENV``) and it re-forms."""
        limit = self.args.hang_timeout
        stale = []
        for w in self.workers.values():
            try:
                progress = self.node_store.get(key("beat", w.name)).decode()
                alive = int(self.node_store.add(key("alive", w.name), 0))
            except RuntimeError:
                return
            if progress != w.progress:
                w.progress, w.progress_at = progress, now
            if alive != w.alive:
                w.alive, w.alive_at = alive, now
            if progress.isdigit() and now - w.progress_at > limit:  # a step done (not starting, joining, forming)
                stale.append(w)
        for w in [w for w in stale if now - w.alive_at > STILL_S]:
            w.hung = now - w.progress_at
            print(f"unickpt launch: worker {w.name} (pid {w.proc.pid}) shows no progress for {w.hung:.0f} s: killed",
                  file=sys.stderr, flush=True)
            w.proc.kill()

    def _forward(self, signum: int, _frame: Any) -> None:
        for w in self.workers.values():
            w.proc.send_signal(signum)

    # -- the end ----------------------------------------------------------------------------
    def _ended(self) -> Generation | None:
        n = control.newest(self.store)
        if n < 0:
            return None
        gen = control.read(self.store, n) if n != getattr(self, "_read", -1) else self._last
        self._read, self._last = n, gen
        return gen if gen.cause == "end" else None

    def _finish(self, end: Generation) -> int:
        """The job ended (a plain script's rank failed, or too few ranks are left): stop
        this node's workers and say why."""
        for w in self.workers.values():
            w.proc.terminate()
        deadline = time.monotonic() + END_GRACE_S
        for w in self.workers.values():
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        self.store.set(key("node", self.node, "done"), "1")
        if self.coordinator is not None:
            if end.code:
                print(f"unickpt launch: the job failed: {end.reason}", file=sys.stderr, flush=True)
            self.coordinator.wait_nodes_done()
        return end.code if end.code >= 0 else 1

    def _status(self) -> int:
        """0 when this node's surviving workers ended 0 (lost ones were recovered from)."""
        gen = control.read(self.store, control.newest(self.store))
        failed = [c for name, c in self.codes.items() if c != 0 and name in gen.members]
        return (failed[0] if failed[0] > 0 else 1) if failed else 0


class Coordinator:
    """Node 0's launcher's second role: it opens the job's generations."""

    def __init__(self, store: Any, args: argparse.Namespace) -> None:
        self.store, self.args = store, args
        self.gen: Generation | None = None
        self.events = 0
        self.pending: list[str] = []  # replacements ready to join
        self.finished: set[str] = set()  # workers that exited 0
        self.beats: dict[int, tuple[int, float]] = {}
        self.next_look = 0.0  # when _lost_nodes reads the launchers' beats again
        self.probes = 0  # probes sent
        self.probe: tuple[int, float, list[int]] | None = None  # the one in flight: number, sent at, nodes asked
        self.me = args.node_rank if not getattr(args, "store", None) else -1  # the node hosting this coordinator

    def start(self) -> None:
        """Open generation 0 (or, when this launcher restarts on a store that lives on, take the newest)."""
        a = self.args
        for n in range(a.nnodes):  # every beat counter exists: one multi_get reads them all, never waits
            self.store.add(key("node", n, "beat"), 0)
        members = [f"{n}.{i}" for n in range(a.nnodes) for i in range(a.nproc_per_node)]
        self.publish(Generation(0, members))

    def publish(self, gen: Generation) -> None:
        """Open ``gen``, and tell every node's launcher (one message a node, in its mailbox)."""
        self.gen = gen
        control.publish(self.store, gen)
        for n in range(self.args.nnodes):
            control.mail(self.store, n, gen=gen.number)

    def step(self) -> None:
        """Handle the launchers' reports; watch the other nodes' launchers; open a
        generation for replacements once rank 0 has fixed the step they join at."""
        lost: list[dict[str, Any]] = []
        end: tuple[int, str] | None = None
        deadline = None
        while True:
            total = self.store.add(key("nevents"), 0)
            while self.events < total:
                ev = json.loads(self.store.get(key("event", self.events)))
                self.events += 1
                if os.environ.get("UNICKPT_LIVE_DEBUG"):
                    print(f"unickpt launch: event {ev}", file=sys.stderr, flush=True)
                if ev["kind"] == "suspect":  # a worker's collective failed: is a node gone?
                    self._send_probe()
                elif ev["kind"] == "ready":
                    self.pending.append(ev["worker"])
                    self.store.set(key("g", self.gen.number, "ready"), str(len(self.pending)))
                elif ev["worker"] in self.pending:
                    self.pending.remove(ev["worker"])
                elif ev["code"] == 0:
                    self.finished.add(ev["worker"])
                elif ev["worker"] in self.gen.members:
                    if not self.store.check([key("run", ev["worker"])]) and (end is None or (end[0] < 0 < ev["code"])):
                        # of the failures reaped together, the first that chose its exit code: a peer
                        # aborted by its vanished gloo connection (a signal) is an effect, not the cause
                        end = (ev["code"], f"worker {ev['worker']} (rank {self.gen.members.index(ev['worker'])}) "
                                           f"exited with {ev['code']} outside unickpt.run: nothing to recover")
                    lost.append({"rank": self.gen.members.index(ev["worker"]), "worker": ev["worker"],
                                 "why": ev["why"], "at": ev["at"]})
            if not lost or (end is not None and end[0] > 0):
                break
            if deadline is None:
                deadline = time.monotonic() + BATCH_S
            if time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        lost += self._lost_nodes()
        if end is not None:
            return self._end(*end)
        active = set(self.gen.active(control.multiple_of(self.store)))
        if self.finished >= active and (self.pending or set(self.gen.members) - self.finished):
            return self._end(0, "the job finished")  # replacements or hot spares waiting for a job that is over
        if lost:
            return self._open("lost", lost)
        if self.pending and self.store.check([key("g", self.gen.number, "grow_at")]):
            self._open("grow", [])

    def _open(self, cause: str, lost: list[dict[str, Any]]) -> None:
        gone = {x["worker"] for x in lost}
        joined, self.pending = self.pending, []
        members = [m for m in self.gen.members if m not in gone] + joined
        members.sort(key=control.node_of)  # stable: the survivors keep their order
        gen = Generation(self.gen.number + 1, members, cause, lost, joined)
        k = control.multiple_of(self.store)
        active = len(gen.active(k))
        if not active:
            return self._end(1, f"{len(members)} rank(s) left, fewer than the multiple_of={k} the job trains on")
        if active < self.args.min_ranks:
            spares = f" ({len(members) - active} spare(s) that fit no multiple of {k})" if active < len(members) else ""
            return self._end(1, f"{active} rank(s) left{spares}, fewer than --min-ranks {self.args.min_ranks}")
        self.publish(gen)
        if self.pending:
            self.store.set(key("g", self.gen.number, "ready"), str(len(self.pending)))

    def _end(self, code: int, reason: str) -> None:
        self.publish(Generation(self.gen.number + 1, [], "end", code=code, reason=reason))

    def _send_probe(self) -> None:
        """Ask every other node of the generation to answer within PROBE_S (one message a
        node; a live launcher answers from its mailbox thread in milliseconds): a node lost
        with its launcher is then declared in PROBE_S, not NODE_TIMEOUT_S. One probe at a
        time."""
        if self.probe is not None:
            return
        nodes = sorted({control.node_of(m) for m in self.gen.members} - {self.me})
        if not nodes:
            return
        k, self.probes = self.probes, self.probes + 1
        for n in nodes:
            control.mail(self.store, n, probe=k)
        self.probe = (k, time.monotonic(), nodes)

    def _unanswered(self) -> list[int]:
        """The nodes that did not answer the probe in flight within PROBE_S (none while it
        is young, or once all answered: the probe is then over)."""
        if self.probe is None:
            return []
        k, sent, nodes = self.probe
        if int(self.store.add(key("probe", k, "acks"), 0)) >= len(nodes):
            self.probe = None
            return []
        if time.monotonic() - sent < PROBE_S:
            return []
        self.probe = None  # a node that finished its work has nothing to answer with: not lost
        return [n for n in nodes if not self.store.check([key("probe", k, "ack", n)])
                and not self.store.check([key("node", n, "done")])]

    def _lost_nodes(self) -> list[dict[str, Any]]:
        """Members on nodes whose launcher did not answer a probe within PROBE_S (sent when
        a worker's collective failed: a lost node's peers see their connections break at
        once), or has been silent for NODE_TIMEOUT_S (its beats read every NODE_BEAT_S,
        all in one request)."""
        silent = self._unanswered()
        out = [{"rank": self.gen.members.index(m), "worker": m, "why": f"node {n} lost", "at": time.time()}
               for n in silent for m in self.gen.members if control.node_of(m) == n]
        now = time.monotonic()
        if now < self.next_look:
            return out
        self.next_look = now + NODE_BEAT_S
        nodes = sorted({control.node_of(m) for m in self.gen.members} - {self.me} - set(silent))
        beats = self.store.multi_get([key("node", n, "beat") for n in nodes]) if nodes else []
        for n, raw in zip(nodes, beats, strict=True):
            beat = int(raw) if raw.isdigit() else -1
            last = self.beats.get(n)
            if last is None or last[0] != beat:
                self.beats[n] = (beat, now)
            elif now - last[1] > NODE_TIMEOUT_S and not self.store.check([key("node", n, "done")]):
                out += [{"rank": self.gen.members.index(m), "worker": m, "why": f"node {n} lost", "at": time.time()}
                        for m in self.gen.members if control.node_of(m) == n]
        return out

    def all_done(self) -> bool:
        """True when every other node of the job has finished (or was lost)."""
        nodes = {control.node_of(m) for m in self.gen.members} - {self.me}
        return all(self.store.check([key("node", n, "done")]) for n in nodes)

    def wait_nodes_done(self, timeout: float = 30.0) -> None:
        """Keep the store up until the other nodes have seen the end (or the timeout)."""
        deadline = time.monotonic() + timeout
        while not self.all_done() and time.monotonic() < deadline:
            self._lost_nodes()
            time.sleep(0.05)


def _die_with_parent() -> None:
    """In the child before exec: die with the launcher (a lost node loses its workers)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
