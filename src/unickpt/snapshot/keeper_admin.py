"""The keeper processes seen from the trainers: where a node's keeper listens, starting
it (detached, so it outlives a crashed trainer), finding it, replacing and stopping it.
No torch here.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from ..errors import SnapshotError
from . import paths, wire

KEEPER_START_S = 60.0
KEEPER_HOST_ENV = "UNICKPT_KEEPER_HOST"


def keeper_host(host: str | None = None, several_machines: bool = False) -> str:
    """The IPv4 address this node's keeper listens on: ``host`` or $UNICKPT_KEEPER_HOST (an
    address, or a name that resolves to one); else 127.0.0.1 when the job runs on one
    machine (one loopback: the simulated nodes); else this machine's network address
    (:func:`network_address`)."""
    named = host or os.environ.get(KEEPER_HOST_ENV)
    if named:
        try:
            return socket.gethostbyname(named)
        except OSError as e:
            raise SnapshotError(f"the keeper host {named!r} (${KEEPER_HOST_ENV}) is not an IPv4 address or a name "
                                f"that resolves to one: {e.strerror or e}") from None
    if not several_machines:
        return "127.0.0.1"
    addr = network_address()
    if addr is None:
        raise SnapshotError(f"the job's nodes run on several machines and this one has no network address to offer "
                            f"its snapshot keeper on: set ${KEEPER_HOST_ENV} to its address on the cluster network")
    return addr


def network_address() -> str | None:
    """This machine's IPv4 address where the other machines reach it: on the route to the
    job's rendezvous host ($MASTER_ADDR, which torchrun sets) when that resolves to another
    machine, else on the default route (the rendezvous host's own machine, whose host name
    may resolve to a loopback address there); None without either."""
    targets = []
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            targets.append(socket.gethostbyname(master))
        except OSError:
            pass
    targets.append("198.51.100.1")  # a documentation address: only the default route's choice matters
    for target in targets:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))  # UDP: picks the route and its source address, sends nothing
                addr = probe.getsockname()[0]
        except OSError:
            continue
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
    return None


def network_identity() -> bytes:
    """16 bytes that exactly the processes sharing one loopback interface share: this
    kernel's boot id and the network namespace (containers on one host have their own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = ""
    return hashlib.sha256(f"{boot}/{netns}".encode()).digest()[:16]


def unreachable_keepers(hosts: list[str], machines: list[bytes]) -> str | None:
    """Why keepers at ``hosts`` (by node) on ``machines`` cannot all reach each other, or
    None: a keeper listening on a loopback address serves only its own machine."""
    if len(set(machines)) < 2:
        return None
    local = [n for n, h in enumerate(hosts) if ipaddress.ip_address(h).is_loopback]
    if not local:
        return None
    which = ", ".join(map(str, local))
    return (f"the job's nodes run on {len(set(machines))} machines, but the snapshot keeper of node{'s' if len(local) > 1 else ''} "
            f"{which} listens on {hosts[local[0]]}, which the other machines cannot reach: set ${KEEPER_HOST_ENV} to each "
            f"node's address on the cluster network, or leave it unset (each machine's network address is then used)")


def keeper_alive(pid: int) -> bool:
    """True when ``pid`` is a running (not zombie) keeper process."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"unickpt.snapshot.keeper_server" in f.read()
    except (FileNotFoundError, IndexError):
        return False


def wake_address(pid: int) -> bytes:
    """The abstract Unix socket (Linux; no file) on which the keeper ``pid`` hears that a
    step committed on its node."""
    return f"\0unickpt-keeper-{pid}".encode()


def wake_keeper(pid: int) -> None:
    """Tell this machine's keeper ``pid`` that a step committed here, so it takes the step
    up now rather than at its next look (every ``POLL_S``). Best effort and never blocks:
    a keeper that cannot hear it (gone, its queue full, no abstract sockets) still looks."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            s.sendto(b"c", wake_address(pid))
    except OSError:
        pass


def running_keeper(root: str) -> dict[str, Any] | None:
    """The address document of the live keeper of this shm root, or None (also when the
    document is unreadable or fails its digest: a keeper is then started in its place,
    and the old one, if alive, exits once the pid file names the new one)."""
    try:
        doc = paths.unseal(paths.read_regular(paths.address_file(root), 1 << 16))
        doc = {"pid": int(doc["pid"]), "host": str(doc["host"]), "port": int(doc["port"]), "job": str(doc["job"])}
    except (OSError, SnapshotError, KeyError, TypeError, ValueError):
        return None
    return doc if doc["pid"] > 0 and keeper_alive(doc["pid"]) else None


_CHILDREN: list[subprocess.Popen] = []


class KeeperSeen:
    """The keeper a rank last ensured (``pid``: from :func:`ensure_keeper`'s document),
    watched through a pidfd: :meth:`running` is one poll of it, where :func:`ensure_keeper`
    reads the address file and the process's /proc entries (a snapshot asks every step).
    Without pidfds (kernels before 5.3) it never says running, and each snapshot ensures
    the keeper."""

    def __init__(self, pid: int) -> None:
        self.fd: int | None = None
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        if keeper_alive(pid):  # the pid is still the keeper's: not reused since
            self.fd = fd
            self.poller = select.poll()  # not select(): a training process may hold more than 1,024 files
            self.poller.register(fd, select.POLLIN)
        else:
            os.close(fd)

    def running(self) -> bool:
        """True while the process lives (its pidfd turns readable when it exits)."""
        return self.fd is not None and not self.poller.poll(0)

    def close(self) -> None:
        """Stop watching (the pidfd closed)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# The keeper needs neither torch nor the rest of unickpt: it is started with a bare
# ``unickpt`` package (its __init__, which imports torch, is skipped), so it starts in a
# fraction of a second and holds no torch runtime in memory.
_KEEPER_BOOT = (
    "import sys, types; pkg = types.ModuleType('unickpt'); pkg.__path__ = [sys.argv.pop(1)]; "
    "sys.modules['unickpt'] = pkg; from unickpt.snapshot.keeper_server import main; main(sys.argv[1:])"
)


def ensure_keeper(root: str, job: str, host: str = "127.0.0.1") -> dict[str, Any]:
    """The node's keeper for ``job`` listening on ``host`` (started, detached in its own
    session, when none runs; one of the job on another address is replaced). A live keeper
    of another job on the same root is a SnapshotError."""
    for p in list(_CHILDREN):  # reap keepers this process started that have died
        if p.poll() is not None:
            _CHILDREN.remove(p)
    doc = running_keeper(root)
    if doc is not None:
        if doc["job"] != job:
            try:
                held = paths.steps(paths.job_dir(root, doc["job"]))
            except (OSError, SnapshotError):  # the shm root is untrusted: a name that is no directory
                held = []
            if held:
                holds = (f"it holds the snapshots of steps {held[0]}..{held[-1]}. Give each job its own "
                         f"UNICKPT_SHM_ROOT, or stop that keeper (kill {doc['pid']}: its snapshots are then deleted at "
                         "the next keeper's start)")
            else:
                holds = (f"it holds no snapshot (its job may have failed before its first): stop it (kill "
                         f"{doc['pid']}), or give each job its own UNICKPT_SHM_ROOT")
            raise SnapshotError(f"the snapshot keeper (pid {doc['pid']}) in {root} serves job {doc['job']!r}, not "
                                f"{job!r}; {holds}")
        if doc["host"] == host:
            return doc
        _replace_keeper(doc)
    paths.make_private(root)
    log_path = os.path.join(paths.base_dir(root), "keeper.log")
    if os.path.isdir(log_path):  # what is in the shm root is not trusted: a log that cannot be appended to
        paths.clear(log_path)
    log = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-c", _KEEPER_BOOT, package, "--root", root, "--job", job, "--host", host]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True)
    log.close()
    _CHILDREN.append(proc)
    deadline = time.monotonic() + KEEPER_START_S
    while time.monotonic() < deadline:
        doc = running_keeper(root)
        if doc is not None and int(doc["pid"]) == proc.pid:
            return doc
        if proc.poll() is not None:
            raise SnapshotError(f"the snapshot keeper exited at start (code {proc.returncode}: {_last_line(log_path)}); "
                                f"see {log_path}")
        time.sleep(0.01)
    raise SnapshotError(f"the snapshot keeper did not start within {KEEPER_START_S:.0f} s; see {log_path}")


def _replace_keeper(doc: dict[str, Any]) -> None:
    """Stop a keeper of the job that listens on another address than this start asks for
    (a relaunch whose nodes are now on other machines); the snapshots it holds stay in the
    shm root for the keeper started in its place."""
    pid = int(doc["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not _wait_gone(pid, KEEPER_START_S):
        raise SnapshotError(f"the snapshot keeper (pid {pid}) listening on {doc['host']} did not exit on SIGTERM")


def _wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for keeper ``pid`` to exit (reaped when this process
    started it); True once it is gone."""
    deadline = time.monotonic() + timeout
    mine = [p for p in _CHILDREN if p.pid == pid]
    if mine:
        try:
            mine[0].wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        _CHILDREN.remove(mine[0])
    while keeper_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _last_line(path: str) -> str:
    """The last line of a log file (what a keeper that died at start said last)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1] if lines else "no log"


def stop_keeper(root: str, timeout: float = 30.0) -> None:
    """Ask the keeper of ``root`` to delete its job's snapshots and exit, and wait for it."""
    doc = running_keeper(root)
    if doc is None:
        return
    secret = paths.read_secret(root, str(doc["job"]))
    try:
        if secret is None:  # a keeper never given its job's secret (a start that failed): it holds nothing
            os.kill(int(doc["pid"]), signal.SIGTERM)
        else:
            conn = wire.Connection(doc["host"], int(doc["port"]), secret)
            try:
                conn.request({"op": "stop"})
            finally:
                conn.close()
    except (SnapshotError, ProcessLookupError):
        return
    _wait_gone(int(doc["pid"]), timeout)
