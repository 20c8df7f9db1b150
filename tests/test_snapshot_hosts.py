"""Where the snapshot keepers listen: a job whose rendezvous is on the network gets
keepers on the network (other machines must reach them) without any setting, and a job
over several machines with a keeper on a loopback address is one clear error instead of
snapshots that never become whole."""

from __future__ import annotations

import json
import socket

import pytest

from unickpt.errors import SnapshotError
from unickpt.snapshot.client import keeper_host, unreachable_keepers
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


def test_the_keeper_host_follows_the_rendezvous(monkeypatch):
    monkeypatch.delenv("UNICKPT_KEEPER_HOST", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert keeper_host() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert keeper_host() == "127.0.0.1"
    own = _own_address()
    if own:
        monkeypatch.setenv("MASTER_ADDR", own)
        assert keeper_host() == own
    monkeypatch.setenv("UNICKPT_KEEPER_HOST", "localhost")  # named: wins, resolved
    assert keeper_host() == "127.0.0.1"
    assert keeper_host("127.0.0.2") == "127.0.0.2"
    monkeypatch.setenv("UNICKPT_KEEPER_HOST", "no-such-host.invalid")
    with pytest.raises(SnapshotError, match=r"the keeper host 'no-such-host.invalid' \(\$UNICKPT_KEEPER_HOST\) is not"):
        keeper_host()


def test_keepers_on_loopback_across_machines_are_refused():
    a, b = b"a" * 16, b"b" * 16
    assert unreachable_keepers(["127.0.0.1", "127.0.0.1"], [a, a]) is None  # simulated nodes of one machine
    assert unreachable_keepers(["10.0.0.1", "10.0.0.2"], [a, b]) is None
    why = unreachable_keepers(["10.0.0.1", "127.0.0.1", "127.0.0.1"], [a, b, b])
    assert why is not None and why.startswith(
        "the job's nodes run on 2 machines, but the snapshot keeper of nodes 1, 2 listens on 127.0.0.1, which the "
        "other machines cannot reach: set $UNICKPT_KEEPER_HOST"), why


def test_a_network_rendezvous_puts_the_keepers_on_the_network(tmp_path):
    """2 simulated nodes whose rendezvous names this machine's network address: both
    keepers listen there, exchange parity over it and serve the recovery."""
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


def test_a_keeper_on_another_address_is_replaced_and_the_snapshots_kept(tmp_path):
    """A relaunch that wants its keeper elsewhere (its nodes now on several machines)
    replaces the running keeper of the job; the snapshots in the shm root stay."""
    import os

    from unickpt.snapshot import paths
    from unickpt.snapshot.client import ensure_keeper, running_keeper

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
