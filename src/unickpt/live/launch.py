"""``unickpt launch``: torchrun's static launch, where a failure costs the survivors nothing.

One launcher per node starts the node's workers with torchrun's environment (a plain
torch script runs unchanged), sees a child exit in milliseconds (SIGCHLD), and never
kills a surviving worker of a job that uses ``unickpt.run``: it reports the loss through
the job's c10d ``TCPStore``, and node 0's launcher (which hosts the store: the control
plane) opens a new generation without the lost workers (see :mod:`.control`). It kills
a worker that shows no progress for ``--hang-timeout`` seconds while stopped (a hang
becomes a crash; 30 s by default, so that its peers re-form before their collectives
time out), starts up to ``--max-restarts`` replacement workers in the background (they join
at a step boundary), and ends the job below ``--min-ranks`` ranks.

Exit status (every node's launcher): 0 when every rank that ran ended 0 or was
recovered from (a signal, a hang, a lost node); a plain script's failed rank's code
(after --max-restarts restarts of the group); 1 when fn raised (unless
``unickpt.run(fn, recover=...)`` says to go on without the rank), when a rank ended 0
while its peers still trained, below --min-ranks, or when a node did not join within
--join-timeout; 128 + the signal on one of --signals-to-handle (130 on SIGINT, 143 on
SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .. import store_client
from ..store_client import LIVE_DEBUG_ENV, LIVE_PG_TIMEOUT_ENV, torchrun_env
from . import control
from .control import Cause, Exited, Generation, Raised, Ready, Stopped, Suspect, key
from .forked import WorkerServer, die_with_parent
from .launch_args import LaunchArgs
from .output import Output

NODE_TIMEOUT_S = 3.0  # a node whose launcher is silent this long is lost
STILL_S = 2.0  # a worker whose beats are silent this long is stopped or holds the GIL
BEAT_S = 0.2  # how often a launcher looks for hangs (in its node's own store)
NODE_BEAT_S = 0.5  # how often a launcher tells the job's store it is alive and looks for the job's end
MAIL_WAIT_S = 3600.0  # the mailbox thread's wait in the job's store (woken by a message: no timeout logged)
PROBE_S = 0.5  # a launcher that does not answer a probe within this is lost (a live one answers in milliseconds)
BATCH_S = 0.02  # exits this close together open one generation
END_GRACE_S = 5.0  # after SIGTERM at the job's end, SIGKILL
GATHER_LOOK_S = 1.0  # how often the coordinator looks whether a generation's members all came to its gathering
DEFAULT_PG_TIMEOUT_S = 60.0
# without --hang-timeout: a stopped worker is killed after this long without progress (or half
# the generation's timeout, when shorter), so that its peers re-form before their collectives
# time out (they would leave the job, the stopped worker kept: a job that hangs)
DEFAULT_HANG_TIMEOUT_S = 30.0
WAIT_NOTE_S = 5.0  # how often node 0's launcher says which nodes it still waits for
FIRST_WAIT_NOTE_S = 2.0  # ... first said after this long: a node late by seconds is told at once
CONNECT_TRY_S = 2.0  # one attempt to reach node 0's store (a signal is seen between attempts)
PROBE_AGAIN_S = 0.1  # between probes of node 0's store port while nothing listens there


class Signals:
    """The signals that stop the job (``--signals-to-handle``: torchrun's SIGTERM, SIGINT,
    SIGHUP and SIGQUIT by default) as the launcher sees them: the first one starts the
    shutdown, a second one kills the workers at once."""

    def __init__(self, handled: tuple[int, ...]) -> None:
        self.handled = handled
        self.signum: int | None = None
        self.count = 0

    def install(self) -> None:
        for sig in self.handled:
            signal.signal(sig, self._on)

    def _on(self, signum: int, _frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        self.count += 1

    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + (self.signum or 0)

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


def run_node(args: LaunchArgs) -> int:
    """Run this node's launcher; returns its exit status."""
    signals = Signals(args.signals)
    signals.install()  # Ctrl-C while the store is reached or nodes are awaited ends this launcher cleanly
    output = Output(args.tee_spec, args.redirects_spec, args.log_dir, args.local_filter, args.rdzv_id, args.duplicate)
    try:
        output.prepare()
    except OSError as e:
        output.say(f"unickpt launch: --log-dir {args.log_dir}: cannot make its folder ({e.strerror or e})")
        return 1
    host = args.master_addr if not args.standalone else "127.0.0.1"
    try:  # a name no resolver knows: the store's connect retried it for 600 s, deaf to Ctrl-C
        socket.getaddrinfo(host, args.master_port or None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        output.say(f"unickpt launch: the job's store address {host!r} (--master-addr, --rdzv-endpoint or --store) "
                   f"does not resolve: {getattr(e, 'strerror', None) or e}")
        return 2
    from torch.distributed import TCPStore

    if args.node_rank == 0 and args.store is None:
        try:
            store = TCPStore(host, args.master_port, is_master=True, timeout=timedelta(seconds=600), wait_for_workers=False)
        except RuntimeError as e:  # DistNetworkError: the port taken (another job), an address not of this host
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            output.say(f"unickpt launch: cannot host the job's store on {host}:{args.master_port} ({first}): another "
                       "job on that port? give another --master-port (or --rdzv-endpoint HOST:PORT)")
            return 1
    else:
        store = _reach(f"{args.master_addr}:{args.master_port}", args.join_timeout, signals, output)
        if store is None:
            return signals.exit_code() if signals.signum else 1
        if args.store is not None:
            control.join_config(store, args)
    address = f"{args.master_addr}:{store.port}"
    # this node's own store: its workers' progress and liveness, read by this launcher only
    node_store = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    return Launcher(args, store, address, node_store, signals, output).run()


def _listening(address: str, timeout_s: float) -> bool:
    """Whether something accepts connections at ``address`` (a plain socket: the store's
    own client prints a C++ stack on each failed try)."""
    try:
        with socket.create_connection(store_client.split_address(address), timeout=timeout_s):
            return True
    except OSError:
        return False


def _reach(address: str, timeout_s: float, signals: Signals, output: Output) -> Any:
    """Connect to node 0's store, retrying for ``timeout_s`` (node 0 may start later); None
    on a signal or when it never answers (said). Until the store's port accepts, it is
    only probed, quietly."""
    deadline = time.monotonic() + timeout_s
    while signals.signum is None:
        if not _listening(address, CONNECT_TRY_S):
            time.sleep(PROBE_AGAIN_S)  # refused at once: node 0 is not up yet
        else:
            try:
                store = store_client.connect(address, timeout_s=CONNECT_TRY_S)
                store.set_timeout(timedelta(seconds=600))
                return store
            except RuntimeError:
                pass  # something else on that port, or a store not answering yet
        if time.monotonic() >= deadline:
            output.say(f"unickpt launch: node 0's store at {address} did not answer within --join-timeout "
                       f"{timeout_s:g} s: is node 0's launcher started (--node-rank 0, the same "
                       "--rdzv-endpoint/--master-addr)?")
            return None
    output.say(f"unickpt launch: stopped by {signals.name()} before node 0's store at {address} answered")
    return None


def recorded_error(path: str, limit: int = 1 << 20) -> str:
    """The error a worker recorded in its TORCHELASTIC_ERROR_FILE (torchrun's ``@record``
    writes ``{"message": {"message": "RuntimeError: ...", "extraInfo": ...}}``): its first
    line, at most 300 characters; '' when there is none or it is not such a file (what a
    worker wrote is untrusted: read at most ``limit`` bytes, never raised on)."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(limit))
        message = doc["message"]
        if isinstance(message, dict):
            message = message["message"]
        if not isinstance(message, str) or not message.strip():
            return ""
        first = message.strip().splitlines()[0]
        return first if len(first) <= 300 else first[:299] + "…"
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return ""


@dataclass
class Worker:
    """A worker process this launcher started."""

    name: str
    local: int
    proc: Any  # a subprocess.Popen, or with --start-method forkserver a forked.ForkedWorker
    rank: int = 0  # RANK at its start (its output's prefix)
    progress: str = ""
    progress_at: float = field(default_factory=time.monotonic)
    alive: int = 0
    alive_at: float = field(default_factory=time.monotonic)
    hung: float = 0.0  # seconds without progress when it was killed for it


def hang_limit(given: float | None) -> float:
    """Seconds without progress after which a stopped worker is killed (0: never):
    ``--hang-timeout`` as given, else ``DEFAULT_HANG_TIMEOUT_S`` or half the generation's
    timeout (``$UNICKPT_LIVE_PG_TIMEOUT``) when that is shorter."""
    if given is not None:
        return given
    try:
        pg = float(os.environ.get(LIVE_PG_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT_S))
    except ValueError:
        pg = DEFAULT_PG_TIMEOUT_S
    return min(DEFAULT_HANG_TIMEOUT_S, pg / 2) if pg > 0 else DEFAULT_HANG_TIMEOUT_S


class Launcher:
    """One node's launcher (node 0's is also the job's coordinator)."""

    def __init__(self, args: LaunchArgs, store: Any, address: str, node_store: Any = None,
                 signals: Signals | None = None, output: Output | None = None) -> None:
        self.args, self.store, self.address = args, store, address
        self.node_store = node_store if node_store is not None else store
        self.node_address = f"127.0.0.1:{node_store.port}" if node_store is not None else None
        self.signals = signals or Signals(args.signals)
        self.output = output or Output()
        self.relayed = -1  # the newest generation relayed to this node's workers
        self.relay_lock = threading.Lock()
        self.node = args.node_rank
        self.workers: dict[int, Worker] = {}  # pid -> worker
        self.codes: dict[str, int] = {}  # exit code of each worker that ended
        self.restarts = 0
        self.attempt = 0  # the plain script's group restarts (the coordinator's restart generations)
        self.attempt_port: str | None = None
        self.done = False
        self.last_line = ""  # the job's summary, said last
        self.errors_dir: str | None = None  # the workers' TORCHELASTIC_ERROR_FILEs (made at the first spawn)
        self.coordinator = Coordinator(store, args, self.output) if self.node == 0 and args.store is None else None
        self.hang_limit = hang_limit(args.hang_timeout)
        self.started_at = time.time() - 1  # (file times are coarser than the clock)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        self.server: WorkerServer | None = None  # --start-method forkserver: what forks the workers

    def run(self) -> int:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        mailbox = None
        if self.args.start_method == "forkserver":  # it imports while the nodes join, in the workers' environment
            self.server = WorkerServer(list(self.args.preload), self._interpreter_env(dict(os.environ)))
        try:
            self.store.set(key("node", self.node, "joined"), "1")
            if self.coordinator is not None:
                self.coordinator.start()
            while control.newest(self.store) < 0:  # generation 0 opens once every node joined
                if self.signals.signum is not None:
                    return self._shutdown()
                if self.coordinator is not None:
                    self.coordinator.step()
                self._sleep(0.05)
            first = control.read(self.store, 0)
            if first.cause == Cause.END:  # a node did not join in time
                return self._finish(first)
            mailbox = threading.Thread(target=self._mailbox, name="unickpt-launch-mailbox", daemon=True)
            mailbox.start()
            return self._run()
        except RuntimeError as e:  # a store call failed: node 0's launcher (the job's store) is gone
            if self.coordinator is not None:
                raise
            self.output.say(f"unickpt launch: the job's store at {self.address} is gone (node 0's launcher ended or was "
                            f"lost: {str(e).splitlines()[0][:200]}); stopping this node's workers")
            self._stop_workers(signal.SIGTERM, END_GRACE_S)
            self.last_line = f"unickpt launch: the job failed: its control plane (node 0) was lost (exit 1){self._kept()}"
            return 1
        finally:
            if self.server is not None:  # a forked worker still there (the launcher failed) dies with it, as
                for w in list(self.workers.values()):  # a spawned one does: multiprocessing joins it at exit
                    w.proc.kill()
            if self.errors_dir is not None:
                shutil.rmtree(self.errors_dir, ignore_errors=True)
            if mailbox is not None:
                try:
                    control.mail(self.store, self.node, stop=1)  # wakes the mailbox thread: it ends
                except RuntimeError:
                    pass  # the job's store is gone: the thread's wait has failed already
                mailbox.join(2.0)
            self.output.drain()
            if self.last_line:  # after the mailbox's end: torch's own warnings never follow the job's summary
                self.output.say(self.last_line)

    def _sleep(self, seconds: float) -> None:
        """Until a worker exits, a signal arrives or ``seconds`` pass (a forked worker is
        the fork server's child: its sentinel says it ended, not SIGCHLD)."""
        forked = [w.proc.sentinel for w in list(self.workers.values())] if self.server is not None else []
        select.select([self.wake_r, *forked], [], [], seconds)
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _mailbox(self) -> None:
        """Read this node's mailbox on the job's store (one waiter a node, woken by each
        message, no timeout): relay every generation published to this node's workers, on
        the node's own store (each worker's watcher waits on its own key there), and answer
        the coordinator's probes (a node whose launcher answers is up, however slow its
        workers)."""
        try:
            client = store_client.connect(self.address)
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
            names = [w.name for w in list(self.workers.values())]
            for n in range(self.relayed + 1, upto + 1):
                for name in names:
                    self.node_store.set(control.watch_key(name, n), "1")
            self.relayed = max(self.relayed, upto)

    def _run(self) -> int:
        for local in range(self.args.nproc_per_node):  # names beyond generation 0's: a node that joins later
            self._spawn(self._new_name(), local)
        next_beat = next_node_beat = 0.0
        while True:
            self._sleep(0.01)
            if self.signals.signum is not None:
                return self._shutdown()
            self._reap()
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + BEAT_S
                if self.hang_limit:
                    self._find_hangs(now)
            gen = None
            if now >= next_node_beat:  # the job's store: a request or two a node every NODE_BEAT_S
                next_node_beat = now + NODE_BEAT_S
                self.store.add(key("node", self.node, "beat"), 1)
                if self.coordinator is None:
                    gen = self._newest()
            if self.coordinator is not None:  # the store's host looks for the end every turn
                self.coordinator.step()
                gen = self._newest()
            if gen is not None and gen.cause == Cause.END:
                return self._finish(gen)
            if gen is not None and gen.cause == Cause.RESTART and gen.code > self.attempt:
                self._restart_group(gen)
            if not self.workers and not self.done:  # then wait for the coordinator's verdict on the job
                self.done = True
                self.store.set(key("node", self.node, "done"), "1")

    # -- workers ----------------------------------------------------------------------------
    def _new_name(self) -> str:
        return f"{self.node}.{self.store.add(key('node', self.node, 'started'), 1) - 1}"

    def _spawn(self, name: str, local: int) -> None:
        a = self.args
        world = a.nnodes * a.nproc_per_node
        rank = self.node * a.nproc_per_node + local
        env = dict(os.environ)
        env.update(torchrun_env(rank, world, local, a.nproc_per_node, self.node, a.nnodes, self.attempt))
        env.update(ROLE_NAME=a.role, MASTER_ADDR=a.master_addr,
                   MASTER_PORT=self.attempt_port or self.address.rpartition(":")[2], TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCHELASTIC_MAX_RESTARTS=str(a.max_restarts),
                   TORCHELASTIC_RUN_ID=a.rdzv_id, **control.worker_env(self.address, name, self.node_address))
        error_file = self._error_file(name)
        if os.path.lexists(error_file):
            os.unlink(error_file)
        env["TORCHELASTIC_ERROR_FILE"] = error_file  # torchrun's, one per worker: @record writes its error there
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort the communicators, never the process
        # a survivor blocked in a collective whose peers cannot free the old group gives up then
        env.setdefault(LIVE_PG_TIMEOUT_ENV, str(max(10.0, 2 * a.hang_timeout) if a.hang_timeout else DEFAULT_PG_TIMEOUT_S))
        self._interpreter_env(env)
        self.node_store.set(key("beat", name), "")
        self.node_store.delete_key(key("alive", name))  # 0 until this process's unickpt.run beats
        if a.no_python:
            cmd = [a.script]
        else:
            cmd = [sys.executable, "-u"] + (["-m", a.script] if a.module else [a.script])
        cmd += list(a.script_args)
        try:
            # its own session (process group): the terminal's Ctrl-C reaches the launcher only,
            # which forwards it once; and the whole group can be signalled (its own children)
            if self.server is not None:
                proc: Any = self.server.start([a.script, *a.script_args], a.module, env)
            else:
                proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, start_new_session=True,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as e:
            what = a.script if self.server is not None else cmd[0]
            raise SystemExit(f"unickpt launch: cannot start {what!r}: {e.strerror or e}") from None
        with self.relay_lock:  # the generations relayed before it started are there for its watcher
            self.workers[proc.pid] = Worker(name, local, proc, rank)
            if self.node_address is not None:
                for n in range(self.relayed + 1):
                    self.node_store.set(control.watch_key(name, n), "1")
        self.output.attach(proc, rank, local, self.attempt)

    def _interpreter_env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with what a worker's interpreter reads at its start (a fork server's too,
        whose torch import starts OpenMP), where the user did not set it; returned."""
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines come through the pipe as they are printed
        if self.args.nproc_per_node > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def _reap(self) -> None:
        for pid, w in list(self.workers.items()):
            code = w.proc.poll()
            if code is None:
                continue
            del self.workers[pid]
            self.codes[w.name] = code
            error = recorded_error(self._error_file(w.name)) if code != 0 else ""
            control.post_event(self.store, Exited(w.name, code, time.time(), self._why(w, code), error))
            if code != 0 and self.signals.signum is None:  # no replacement once a shutdown began
                if self.restarts < self.args.max_restarts and self.store.check([key("run", w.name)]):
                    self.restarts += 1
                    self._spawn(self._new_name(), w.local)

    def _error_file(self, name: str) -> str:
        """Worker ``name``'s TORCHELASTIC_ERROR_FILE, where torchrun's ``@record`` writes the
        exception that ended it (this launcher's own folder, made at the first call)."""
        if self.errors_dir is None:
            self.errors_dir = tempfile.mkdtemp(prefix="unickpt_launch_errors_")
        return os.path.join(self.errors_dir, f"{name}.json")

    def _why(self, w: Worker, code: int) -> str:
        if w.hung:
            return f"hung: no progress for {w.hung:.0f} s, exit {code}"
        return f"exit {code}"

    def _find_hangs(self, now: float) -> None:
        """Kill the workers that showed no progress for --hang-timeout seconds and whose
        beats are silent too (a stopped process, or one holding the GIL). Progress is the
        step counter once a step is done; before the first step of a generation (joining,
        gathering, forming, restoring) only the beats show it, from the start of
        ``unickpt.run`` (a process not there yet, importing or building, is never taken
        for hung). A worker blocked in a collective on a dead peer is not hung: its
        collective fails within the generation's timeout (``LIVE_PG_TIMEOUT_ENV``) and it
        re-forms."""
        limit = self.hang_limit
        for w in list(self.workers.values()):
            if w.hung:
                continue  # killed already, not reaped yet
            try:
                progress = self.node_store.get(key("beat", w.name)).decode()
                alive = int(self.node_store.add(key("alive", w.name), 0))
            except RuntimeError:
                return
            if progress != w.progress:
                w.progress, w.progress_at = progress, now
            if alive != w.alive:
                w.alive, w.alive_at = alive, now
            if progress.isdigit():  # a step done: no new step for the limit, and the beats still
                hung = now - w.progress_at if now - w.progress_at > limit and now - w.alive_at > STILL_S else 0.0
            elif w.alive and progress != "done":  # in unickpt.run, no step yet: the beats only
                hung = now - w.alive_at if now - w.alive_at > limit else 0.0
            else:
                continue
            if hung:
                w.hung = hung
                self.output.say(f"unickpt launch: worker {w.name} (pid {w.proc.pid}) shows no progress for "
                                f"{hung:.0f} s: killed")
                w.proc.kill()

    def _restart_group(self, gen: Generation) -> None:
        """A plain script's rank failed and --max-restarts allows another try: stop this
        node's workers and start the group again (torchrun's restart), on a fresh store."""
        self._stop_workers(signal.SIGTERM, END_GRACE_S, report=False)
        self.attempt = gen.code
        self.attempt_port = self.store.get(key("attempt", self.attempt, "port")).decode()
        self.done = False
        for name in gen.members:
            if control.node_of(name) == self.node:
                self._spawn(name, int(name.rsplit(".", 1)[1]))

    def _signal(self, w: Worker, signum: int) -> None:
        """``signum`` to the worker's process group (the worker and the processes it started)."""
        try:
            os.killpg(w.proc.pid, signum)
        except ProcessLookupError:  # a forked worker between its fork and its setsid: no group yet
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(w.proc.pid, signum)
        except PermissionError:
            pass

    def _stop_workers(self, signum: int, grace: float, report: bool = True) -> None:
        """``signum`` to every worker once, SIGKILL to those left after ``grace`` seconds."""
        for w in self.workers.values():
            self._signal(w, signum)
        deadline = time.monotonic() + grace
        for w in list(self.workers.values()):
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(w, signal.SIGKILL)
                w.proc.wait()
        if report:
            self._reap()
        self.workers.clear()

    # -- the end ----------------------------------------------------------------------------
    def _newest(self) -> Generation | None:
        n = control.newest(self.store)
        if n < 0:
            return None
        gen = control.read(self.store, n) if n != getattr(self, "_read", -1) else self._last
        self._read, self._last = n, gen
        return gen

    def _finish(self, end: Generation) -> int:
        """The coordinator ended the job (every rank finished, a rank failed for good, too
        few ranks are left, a node did not join, a launcher was stopped): stop this node's
        workers and say why, on the last line."""
        self._stop_workers(signal.SIGTERM, END_GRACE_S, report=False)
        self.store.set(key("node", self.node, "done"), "1")
        self.store.set(key("node", self.node, "ended"), "1")  # the store's host may go now
        if self.coordinator is not None:
            self.coordinator.wait_nodes_done()
        self.output.drain()
        code = end.code if end.code >= 0 else 1
        self.last_line = f"unickpt launch: {end.reason}{self._kept() if code else ''}"
        return code

    def _shutdown(self) -> int:
        """A handled signal (SIGINT, SIGTERM, ...): tell the job (its coordinator ends it on
        every node), forward the signal once to every worker's process group, SIGKILL those
        left after --shutdown-timeout; no replacement is started meanwhile. Exit 128 + the
        signal."""
        name, grace = self.signals.name(), self.args.shutdown_timeout
        try:
            if control.newest(self.store) < 0:  # generation 0 not open yet: this node no longer joins it
                self.store.delete_key(key("node", self.node, "joined"))
            if self.coordinator is not None:
                self.coordinator.stop(self.signals.signum or 0, self.node)
            else:
                control.post_event(self.store, Stopped(self.node, int(self.signals.signum)))
        except RuntimeError:
            pass  # the job's store is gone: this node stops on its own
        if self.workers:
            self.output.say(f"unickpt launch: {name}: stopping this node's {len(self.workers)} worker(s) "
                            f"(SIGKILL after --shutdown-timeout {grace:g} s; {name} again: at once)")
        for w in self.workers.values():
            self._signal(w, self.signals.signum or signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.workers:
            if time.monotonic() >= deadline or self.signals.count > 1:
                for w in self.workers.values():
                    self.output.say(f"unickpt launch: worker {w.name} (rank {w.rank}, pid {w.proc.pid}) did not stop "
                                    f"within {time.monotonic() - deadline + grace:.0f} s of {name}: SIGKILL")
                    self._signal(w, signal.SIGKILL)
                    w.proc.wait()
                deadline = float("inf")
            self._sleep(0.05)
            for pid, w in list(self.workers.items()):
                if w.proc.poll() is not None:
                    del self.workers[pid]
        try:
            self.store.set(key("node", self.node, "done"), "1")
            if self.coordinator is not None:
                self.coordinator.wait_nodes_done(grace + END_GRACE_S + 2.0)
            end = self._newest()
            self.store.set(key("node", self.node, "ended"), "1")
        except RuntimeError:
            end = None
        self.output.drain()
        line = end.reason if end is not None and end.cause == Cause.END else f"the job was stopped: {name} on node {self.node}"
        self.last_line = f"unickpt launch: {line}{self._kept()}"
        return self.signals.exit_code()

    def _kept(self) -> str:
        """What this node's keeper still holds in memory, and how to resume or free it
        (empty when nothing is held)."""
        from ..snapshot.leftovers import held_snapshots
        from ..snapshot.paths import base_dir, shm_root

        root = shm_root()
        try:
            held = held_snapshots(root)
            # this job's: snapshots taken while this launcher ran (another job's, on the same
            # root, or a script that never snapshots, must not be said to resume from them)
            jobs = [j for j in held["jobs"] if _touched_since(os.path.join(base_dir(root), j["job"]), self.started_at)]
        except OSError:
            return ""
        keeper = held["keeper"] if held["keeper"] is not None and any(j["job"] == held["keeper"]["job"] for j in jobs) \
            else None
        if keeper is None and not jobs:
            return "; nothing of this job is kept in memory"
        whole = sorted({s for j in jobs for s in j["whole"]})
        what = f"the snapshots of step(s) {', '.join(map(str, whole[-3:]))}" if whole else "its keeper"
        return (f"; this node keeps {what} in memory ({root}): the same command resumes from them, "
                f"`unickpt snapshots {root} --free` frees them")


def _touched_since(folder: str, since: float) -> bool:
    """Whether ``folder`` or an entry right under it changed at or after ``since`` (a
    snapshot step written, or dropped, while this launcher ran)."""
    try:
        if os.stat(folder).st_mtime >= since:
            return True
        with os.scandir(folder) as entries:
            return any(e.stat(follow_symlinks=False).st_mtime >= since for e in entries)
    except OSError:
        return False


class Coordinator:
    """Node 0's launcher's second role: it opens the job's generations, and ends the job
    with its verdict (the exit status every node's launcher returns, and their last line)."""

    def __init__(self, store: Any, args: LaunchArgs, output: Output | None = None) -> None:
        self.store, self.args = store, args
        self.output = output or Output()
        self.gen: Generation | None = None
        self.events = 0
        self.pending: list[str] = []  # replacements ready to join
        self.finished: set[str] = set()  # workers that exited 0
        self.suspects: set[str] = set()  # members of this generation whose collective failed (Suspect)
        self.beats: dict[int, tuple[int, float]] = {}
        self.next_look = 0.0  # when _lost_nodes reads the launchers' beats again
        self.ever: set[str] = set()  # every worker that was a member of a generation
        self.recovered: list[tuple[int, str, str]] = []  # (rank, worker, why) of each loss the job went on without
        self.raised: dict[str, Raised] = {}  # worker -> what its fn raised (unickpt.run's report)
        self.attempt = 0  # a plain script's group restarts
        self.attempt_stores: list[Any] = []
        self.size = 0  # the world size of the last generation that ran
        self.started = 0.0
        self.next_note = 0.0
        self.silent: dict[int, tuple[bytes, float]] = {}  # all_done's view of each node's beat
        self.probes = 0  # probes sent
        self.multiple: int | None = None  # the job's multiple_of, once a worker has said it
        self.probe: tuple[int, float, list[int]] | None = None  # the one in flight: number, sent at, nodes asked
        self.me = args.node_rank if args.store is None else -1  # the node hosting this coordinator
        self.gathered: set[int] = set()  # generations whose members all arrived
        self.first_arrival: dict[int, float] = {}  # generation -> when a member was first seen arrived
        self.next_gather_look = 0.0

    def start(self) -> None:
        """Wait for every node to join (:meth:`step` opens generation 0 once they have), or,
        when this launcher restarts on a store that lives on, take the newest."""
        a = self.args
        for n in range(a.nnodes):  # every beat counter exists: one multi_get reads them all, never waits
            self.store.add(key("node", n, "beat"), 0)
        self.started = time.monotonic()
        self.next_note = self.started + FIRST_WAIT_NOTE_S

    def _join(self) -> None:
        """Generation 0 opens once every one of --nnodes nodes has joined (torchrun's
        rendezvous); until then this says who is awaited every WAIT_NOTE_S; after
        --join-timeout the job ends (exit 1), naming the missing nodes."""
        a = self.args
        missing = [n for n in range(a.nnodes) if n != self.me and not self.store.check([key("node", n, "joined")])]
        now = time.monotonic()
        if not missing:
            self._publish(Generation(0, [f"{n}.{i}" for n in range(a.nnodes) for i in range(a.nproc_per_node)]))
            return
        names = ", ".join(map(str, missing))
        if now - self.started >= a.join_timeout:
            self.gen = Generation(-1, [])
            self._end(1, f"node(s) {names} of {a.nnodes} did not join within --join-timeout {a.join_timeout:g} s (start "
                         f"`unickpt launch --node-rank N ...` there, with the same --nnodes and endpoint)")
        elif now >= self.next_note:
            self.next_note = now + WAIT_NOTE_S
            self.output.say(f"unickpt launch: waiting for node(s) {names} of {a.nnodes} to join ({now - self.started:.0f} s; "
                            f"--join-timeout {a.join_timeout:g} s)")

    def _publish(self, gen: Generation) -> None:
        """Open ``gen``, and tell every node's launcher (one message a node, in its mailbox)."""
        self.gen = gen
        self.suspects.clear()  # a collective that failed in the generation before
        self.ever.update(gen.members)
        if gen.members:
            self.size = len(gen.active(self._multiple()))
        control.publish(self.store, gen)
        for n in range(self.args.nnodes):
            control.mail(self.store, n, gen=gen.number)

    def stop(self, signum: int, node: int) -> None:
        """A launcher was sent a handled signal (SIGINT, SIGTERM, ...): the job ends on every
        node (128 + signum)."""
        self.step()  # what happened before the signal is counted first
        if self.gen is None:
            self.gen = Generation(-1, [])
        if self.gen.cause != Cause.END:
            self._end(128 + signum, f"{signal.Signals(signum).name} on node {node}", stopped=True)

    def step(self) -> None:
        """Handle the launchers' reports; watch the other nodes' launchers; open a
        generation for replacements once rank 0 has fixed the step they join at."""
        if self.gen is None:
            return self._join()
        if self.gen.cause == Cause.END:
            return None
        lost: list[dict[str, Any]] = []
        end: tuple[int, str] | None = None
        bug: tuple[int, str] | None = None  # fn raised: not a failure of the process
        stop: Stopped | None = None
        deadline = None
        while True:
            total = self.store.add(key("nevents"), 0)
            while self.events < total:
                try:
                    ev = control.parse_event(self.store.get(key("event", self.events)))
                except ValueError as e:  # never crash the coordinator on what it reads back
                    self.output.say(f"unickpt launch: event {self.events} skipped: {e}")
                    self.events += 1
                    continue
                self.events += 1
                if os.environ.get(LIVE_DEBUG_ENV):
                    self.output.say(f"unickpt launch: event {ev}")
                if isinstance(ev, Suspect):  # a worker's collective failed: is a node gone?
                    if ev.worker in self.gen.members:
                        self.suspects.add(ev.worker)
                    self._send_probe()
                elif isinstance(ev, Stopped):
                    stop = stop or ev
                elif isinstance(ev, Raised):
                    self.raised[ev.worker] = ev
                elif isinstance(ev, Ready):
                    self.pending.append(ev.worker)
                    self.store.set(key("g", self.gen.number, "ready"), str(len(self.pending)))
                elif ev.worker in self.pending:
                    self.pending.remove(ev.worker)
                elif ev.code == 0:
                    self.finished.add(ev.worker)
                elif ev.worker in self.gen.members:
                    worker, rank = ev.worker, self.gen.members.index(ev.worker)
                    raised = self.raised.get(worker)
                    if not self.store.check([key("run", worker)]) and (end is None or (end[0] < 0 < ev.code)):
                        # of the failures reaped together, the first that chose its exit code: a peer
                        # aborted by its vanished gloo connection (a signal) is an effect, not the cause
                        said = f" (it recorded {ev.error})" if ev.error else ""
                        end = (ev.code, f"worker {worker} (rank {rank}) exited with {ev.code} outside unickpt.run{said}: "
                                        "nothing to recover")
                    elif raised is not None and not raised.recoverable and bug is None:
                        bug = (ev.code if ev.code > 0 else 1,
                               f"rank {rank} (worker {worker}) raised {raised.error} ({raised.where}): an error of "
                               "fn is not recovered from (it would happen again; its traceback is above), unless "
                               "unickpt.run(fn, recover=...) says to go on without the rank")
                    lost.append({"rank": rank, "worker": worker, "why": ev.why, "at": ev.at})
            if stop is not None or not lost or (end is not None and end[0] > 0):
                break
            if deadline is None:
                deadline = time.monotonic() + BATCH_S
            if time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        if stop is not None:
            return self._end(128 + stop.signal, f"{signal.Signals(stop.signal).name} on node {stop.node}", stopped=True)
        lost += self._lost_nodes()
        early = [m for m in self.gen.members if m in self.finished and self.store.check([key("run", m)])]
        # a rank that left fn while its peers trained: they cannot go on without it. Said when a
        # peer's collective fails on it (at once: the peer would wait out NETWORK_ERROR_WAIT_S
        # for a verdict) or a peer is lost; a peer still finishing fn is neither
        if (lost or self.suspects) and early:
            m = early[0]
            return self._end(1, f"rank {self.gen.members.index(m)} (worker {m}) ended with exit 0 in generation "
                                f"{self.gen.number} while its peers still trained (fn returned or called sys.exit early)")
        if bug is not None:
            return self._end(*bug)
        if end is not None:
            if self.attempt < self.args.max_restarts:
                return self._restart(end[1])
            return self._end(*end)
        active = set(self.gen.active(self._multiple()))
        never = self._never_to_run(active)
        if active and (self.finished >= active or never):  # hot spares or replacements may still wait: the job is over
            self.ever -= never  # taken in at the last step: they never ran
            self.size -= len(never)
            return self._end(0, "finished")
        if lost:
            return self._open(Cause.LOST, lost)
        late = self._late_to_gather()
        if late is not None:
            return self._end(1, late)
        if self.pending and self.store.check([key("g", self.gen.number, "grow_at")]):
            self._open(Cause.GROW, [])
        return None

    def _late_to_gather(self) -> str | None:
        """Why the job ends when a member of this generation never came to its gathering
        (a worker stuck before ``unickpt.run``: in its imports, its data, a deadlock; alive,
        so neither lost nor hung) --join-timeout after a first member arrived: its peers
        would wait in the barrier for ever (torchrun's ranks would fail their group's
        timeout). None otherwise. A request or two a second while members gather."""
        gen, now = self.gen, time.monotonic()
        if gen is None or gen.number in self.gathered or now < self.next_gather_look:
            return None
        self.next_gather_look = now + GATHER_LOOK_S
        active = gen.active(self._multiple())
        arrived = int(self.store.add(key("g", gen.number, "arrived"), 0))
        if not active or arrived >= len(active) or self.store.check([key("g", gen.number, "go")]):
            self.gathered.add(gen.number)
            return None
        if arrived == 0:  # none came yet (a plain script's workers never do)
            return None
        first = self.first_arrival.setdefault(gen.number, now)
        if now - first < self.args.join_timeout:
            return None
        late = [m for m in active if not self.store.check([key("run", m)])]
        within = f"within --join-timeout {self.args.join_timeout:g} s of its peers' arrival"
        if late:
            who = ", ".join(f"worker {m} (rank {gen.members.index(m)})" for m in late)
            return (f"{who} did not reach unickpt.run {within} (stuck before it: its imports, its data, a deadlock; "
                    "`py-spy dump --pid PID` shows where)")
        return f"{len(active) - arrived} of {len(active)} ranks did not come to generation {gen.number}'s gathering {within}"

    def _never_to_run(self, active: set[str]) -> set[str]:
        """The replacements this generation took in, when its members that trained before
        it all finished (``fn`` returned) before it formed: taken in at the training's last
        step, they would wait for peers that never come. Empty otherwise."""
        joined = active & set(self.gen.joined)
        ran = active - joined
        if not joined or not ran or not self.finished >= ran or self.store.check([key("g", self.gen.number, "go")]):
            return set()
        return joined

    def _open(self, cause: Cause, lost: list[dict[str, Any]]) -> None:
        gone = {x["worker"] for x in lost}
        joined, self.pending = self.pending, []
        members = [m for m in self.gen.members if m not in gone] + joined
        members.sort(key=control.node_of)  # stable: the survivors keep their order
        gen = Generation(self.gen.number + 1, members, cause, lost, joined)
        k = self._multiple()
        active = len(gen.active(k))
        if not active or active < self.args.min_ranks:
            if not active:
                why = f"{len(members)} rank(s) left, fewer than the multiple_of={k} the job trains on"
            else:
                spares = f" (and {len(members) - active} spare(s) that fit no multiple of {k})" if active < len(members) else ""
                why = f"{active} rank(s) left{spares}, fewer than --min-ranks {self.args.min_ranks}"
            return self._end(1, why)
        self.recovered += [(x["rank"], x["worker"], x["why"]) for x in lost]
        self._publish(gen)
        if self.pending:
            self.store.set(key("g", self.gen.number, "ready"), str(len(self.pending)))

    def _restart(self, why: str) -> None:
        """A plain script's rank failed: start the whole group again (torchrun's
        --max-restarts), its rendezvous on a fresh store (no key of the failed attempt)."""
        from torch.distributed import TCPStore

        self.attempt += 1
        fresh = TCPStore(self.args.master_addr if not self.args.standalone else "127.0.0.1", 0, is_master=True,
                         timeout=timedelta(seconds=600), wait_for_workers=False)
        self.attempt_stores.append(fresh)
        self.store.set(key("attempt", self.attempt, "port"), str(fresh.port))
        a = self.args
        members = [f"{n}.a{self.attempt}.{i}" for n in range(a.nnodes) for i in range(a.nproc_per_node)]
        self.output.say(f"unickpt launch: {why}; restarting the group ({self.attempt} of --max-restarts "
                        f"{a.max_restarts})")
        self._publish(Generation(self.gen.number + 1, members, Cause.RESTART, code=self.attempt, reason=why))

    def _end(self, code: int, reason: str, stopped: bool = False) -> None:
        """End the job: ``reason`` and the job's summary become every launcher's last line."""
        head = "the job was stopped: " if stopped else ("the job " + ("finished" if code == 0 else "failed") + ": ")
        if code == 0:
            head, reason = "the job finished", ""
        ranks = len(self.ever)
        # a rank number given twice (two losses in a row: the second named by its rank after the
        # re-forming) says which worker each was
        said = [r for r, _, _ in self.recovered]
        told = [f"rank {r}{f' (worker {w})' if said.count(r) > 1 else ''}: {why}" for r, w, why in self.recovered]
        lost = f"{len(self.recovered)} lost and recovered" + (f" ({'; '.join(told)})" if told else "")
        restarts = f", the group restarted {self.attempt} time{'s' if self.attempt != 1 else ''}" if self.attempt else ""
        summary = f"{ranks} rank{'s' if ranks != 1 else ''} ran, {lost}{restarts}, final world size {self.size}"
        line = f"{head}{reason}{'; ' if reason else ': '}{summary} (exit {code})"
        self._publish(Generation(self.gen.number + 1, [], Cause.END, code=code, reason=line))

    def _multiple(self) -> int:
        """The job's ``multiple_of`` (1 until a worker said otherwise; read from the store
        until then, once after: every worker gives the same, and it never changes)."""
        if self.multiple is None and self.store.check([control.MULTIPLE_KEY]):
            self.multiple = control.multiple_of(self.store)
        return self.multiple or 1

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

    def all_done(self, mark: str = "done") -> bool:
        """True when every other node that joined has finished (``mark``: ``done``, its
        workers ended; ``ended``, its launcher read the job's end), or was lost (its
        launcher silent for NODE_TIMEOUT_S)."""
        now = time.monotonic()
        nodes = [n for n in range(self.args.nnodes) if n != self.me and self.store.check([key("node", n, "joined")])]
        beats = self.store.multi_get([key("node", n, "beat") for n in nodes]) if nodes else []
        waiting = False
        for n, beat in zip(nodes, beats, strict=True):
            last = self.silent.get(n)
            if last is None or last[0] != beat:
                self.silent[n] = last = (beat, now)
            if not self.store.check([key("node", n, mark)]) and now - last[1] <= NODE_TIMEOUT_S:
                waiting = True
        return not waiting

    def wait_nodes_done(self, timeout: float = 30.0) -> None:
        """Keep the store up until the other nodes have read the job's end (or the timeout):
        a launcher that finds the store gone before it read the end would report the job
        as failed."""
        deadline = time.monotonic() + timeout
        while not self.all_done("ended") and time.monotonic() < deadline:
            time.sleep(0.05)
