"""Where the snapshot keepers listen: a job over several machines (network namespaces)
gets keepers on each machine's network address without any setting, one machine keeps
them on loopback, and a job over several machines with a keeper on a loopback address is
one clear error instead of snapshots that never become whole."""

from __future__ import annotations

import json
import socket

import pytest

from unickpt.errors import SnapshotError
from unickpt.snapshot.keeper_admin import keeper_host, network_identity, unreachable_keepers
from unickpt.testing import run_ranks

from snapshot_helpers import kill_keeper, two_machines_rank


def _own_address() -> str | None:
    """This machine's IPv4 address on its default route (None without one)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("198.51.100.1", 9))  # sends nothing
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_the_keeper_host(monkeypatch):
    """One machine: loopback, whatever the rendezvous. Several: this machine's network
    address, also where the rendezvous host's name resolves to a loopback address on its
    own machine (Debian's /etc/hosts). A named host wins; one that does not resolve is one
    error."""
    monkeypatch.delenv("UNICKPT_KEEPER_HOST", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    own = _own_address()
    assert keeper_host() == "127.0.0.1"
    if own:
        monkeypatch.setenv("MASTER_ADDR", own)
        assert keeper_host() == "127.0.0.1"  # simulated nodes of one machine stay private
        assert keeper_host(several_machines=True) == own
        monkeypatch.setenv("MASTER_ADDR", "localhost")
        assert keeper_host(several_machines=True) == own
    monkeypatch.setenv("UNICKPT_KEEPER_HOST", "localhost")  # named: wins, resolved
    assert keeper_host(several_machines=True) == "127.0.0.1"
    assert keeper_host("127.0.0.2") == "127.0.0.2"
    monkeypatch.setenv("UNICKPT_KEEPER_HOST", "no-such-host.invalid")
    with pytest.raises(SnapshotError, match=r"the keeper host 'no-such-host.invalid' \(\$UNICKPT_KEEPER_HOST\) is not"):
        keeper_host()


@pytest.mark.multiprocess
def test_the_network_identity_tells_network_namespaces_apart():
    """Processes that share a loopback share the identity; a process in another network
    namespace (a container on the same kernel) does not."""
    import shutil
    import subprocess
    import sys

    code = "from unickpt.snapshot.keeper_admin import network_identity as n; print(n().hex())"
    here = network_identity().hex()
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == here
    unshare = shutil.which("unshare")
    other = subprocess.run([unshare, "--net", sys.executable, "-c", code], capture_output=True, text=True) if unshare else None
    if other is None or other.returncode:
        pytest.skip("cannot make a network namespace here")
    assert other.stdout.strip() not in ("", here)


def test_keepers_on_loopback_across_machines_are_refused():
    a, b = b"a" * 16, b"b" * 16
    assert unreachable_keepers(["127.0.0.1", "127.0.0.1"], [a, a]) is None  # simulated nodes of one machine
    assert unreachable_keepers(["10.0.0.1", "10.0.0.2"], [a, b]) is None
    why = unreachable_keepers(["10.0.0.1", "127.0.0.1", "127.0.0.1"], [a, b, b])
    assert why is not None and why.startswith(
        "the job's nodes run on 2 machines, but the snapshot keeper of nodes 1, 2 listens on 127.0.0.1, which the "
        "other machines cannot reach: set $UNICKPT_KEEPER_HOST"), why


@pytest.mark.multiprocess
def test_keepers_on_a_network_address_exchange_parity_and_serve_the_recovery(tmp_path):
    """2 simulated nodes whose keepers listen on this machine's network address
    ($UNICKPT_KEEPER_HOST): the parity crosses it and the recovery is served over it."""
    own = _own_address()
    if own is None:
        pytest.skip("no IPv4 address besides loopback")
    roots = [str(tmp_path / "shm0"), str(tmp_path / "shm1")]
    out = tmp_path / "seen.json"
    try:
        run_ranks(two_machines_rank, 2, roots, own, str(out), preload=["torch", "unickpt", "unickpt.snapshot.client"])
    finally:
        for r in roots:
            kill_keeper(r)
    seen = json.loads(out.read_text())
    assert seen["hosts"] == [own, own] and seen["bitwise"], seen
    assert seen["line"].startswith("resumed step 1 from memory"), seen


@pytest.mark.multiprocess
def test_a_keeper_on_another_address_is_replaced_and_the_snapshots_kept(tmp_path):
    """A relaunch that wants its keeper elsewhere (its nodes now on several machines)
    replaces the running keeper of the job; the snapshots in the shm root stay."""
    import os

    from unickpt.snapshot import paths
    from unickpt.snapshot.keeper_admin import ensure_keeper, running_keeper

    root = str(tmp_path / "shm")
    try:
        first = ensure_keeper(root, "moved", "127.0.0.1")
        step = os.path.join(paths.job_dir(root, "moved"), "step_00000003")
        os.makedirs(step)
        open(os.path.join(step, "rank_00000.safetensors"), "wb").write(b"x" * 100)
        assert ensure_keeper(root, "moved", "127.0.0.1")["pid"] == first["pid"]
        second = ensure_keeper(root, "moved", "127.0.0.2")
        assert second["host"] == "127.0.0.2" and second["pid"] != first["pid"]
        with pytest.raises(ProcessLookupError):  # gone (and reaped)
            os.kill(int(first["pid"]), 0)
        assert running_keeper(root)["pid"] == second["pid"]
        assert open(os.path.join(step, "rank_00000.safetensors"), "rb").read() == b"x" * 100
    finally:
        kill_keeper(root)
