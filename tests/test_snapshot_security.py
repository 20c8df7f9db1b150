"""The keepers serve only their job: every connection must prove the job's secret
(HMAC of a nonce), which lives in a 0600 file under a 0700 directory and in no snapshot
or manifest. Real keeper processes, raw sockets for the intruder."""

from __future__ import annotations

import os
import socket
import stat

import pytest
import torch

from unickpt.errors import SnapshotError
from unickpt.snapshot import paths, wire
from unickpt import SnapshotOptions
from unickpt.snapshot.client import Snapshotter
from unickpt.snapshot.keeper_admin import ensure_keeper, running_keeper, stop_keeper

from snapshot_helpers import kill_keeper

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _intrude(doc: dict, header: dict) -> tuple[dict | None, bytes]:
    """A client that ignores the challenge and sends ``header`` as its answer: the
    keeper's reply and every byte it sent after."""
    with socket.create_connection((doc["host"], int(doc["port"])), timeout=10) as s:
        assert "nonce" in wire.recv_header(s)
        wire.send(s, header)
        reply = wire.recv_header(s)
        rest = b""
        while chunk := s.recv(1 << 16):
            rest += chunk
    return reply, rest


def test_a_keeper_serves_only_who_proves_the_job_secret(tmp_path):
    """Without the job's secret nothing is served (no byte of a file, no stop), with a
    wrong one the connection is refused with one clear error; the job itself is served."""
    root = str(tmp_path / "shm")
    doc = ensure_keeper(root, "sec")
    try:
        assert _mode(paths.base_dir(root)) == 0o700 and _mode(os.path.join(paths.base_dir(root), "keeper.log")) == 0o600
        secret = os.urandom(paths.SECRET_BYTES)
        with pytest.raises(SnapshotError, match="holds no job secret yet"):
            wire.Connection(doc["host"], int(doc["port"]), secret)
        paths.write_secret(root, "sec", secret)
        assert _mode(paths.secret_file(root, "sec")) == 0o600
        sdir = os.path.join(paths.job_dir(root, "sec"), "step_00000001")
        os.makedirs(sdir)
        data = os.urandom(3000)
        with open(os.path.join(sdir, "rank_00000.safetensors"), "wb") as f:
            f.write(data)
        with pytest.raises(SnapshotError, match=r"snapshot keeper at 127\.0\.0\.1:\d+: refused: wrong job secret"):
            wire.Connection(doc["host"], int(doc["port"]), os.urandom(paths.SECRET_BYTES))
        read = {"op": "read", "path": "step_00000001/rank_00000.safetensors", "offset": 0, "length": 3000}
        for header in (read, {"op": "stop"}, {"op": "auth", "mac": "00" * 32}):
            reply, rest = _intrude(doc, header)
            assert reply == {"ok": False, "error": "refused: wrong job secret", "nbytes": 0} and rest == b""
        with socket.create_connection((doc["host"], int(doc["port"])), timeout=10) as s:  # a 2 GiB "answer"
            assert "nonce" in wire.recv_header(s)
            s.sendall((1 << 31).to_bytes(4, "big"))
            assert s.recv(1) == b""  # dropped at once, nothing allocated for it
        assert running_keeper(root) is not None  # the intruder's stop did nothing
        conn = wire.Connection(doc["host"], int(doc["port"]), secret)
        try:
            out = bytearray(3000)
            conn.read("step_00000001/rank_00000.safetensors", 0, memoryview(out))
            assert bytes(out) == data
            elsewhere = str(tmp_path / "elsewhere")  # a flush copies only beside the step's own flush target
            with pytest.raises(SnapshotError, match="is not beside step 1's flush target"):
                conn.request({"op": "flush", "step": 1, "staging": elsewhere, "node": 1, "reply": doc})
            assert not os.path.exists(elsewhere)
        finally:
            conn.close()
        stop_keeper(root)
        assert running_keeper(root) is None and not os.path.exists(paths.job_dir(root, "sec"))
    finally:
        kill_keeper(root)


def test_a_snapshotter_stores_the_secret_privately_and_nowhere_else(tmp_path):
    """One process (one node): the job's secret is drawn, stored 0600, kept by a second
    Snapshotter of the same job (a relaunch), and is in no file of the snapshot."""
    root = str(tmp_path / "shm")
    try:
        snap = Snapshotter("priv", SnapshotOptions(every=1, parity=0), root=root)
        secret = paths.read_secret(root, "priv")
        assert secret == snap.secret and len(secret) == paths.SECRET_BYTES
        assert _mode(paths.secret_file(root, "priv")) == 0o600 and _mode(paths.base_dir(root)) == 0o700
        snap.snapshot({"w": torch.arange(1000.0)}, 1).result()
        snap.close(clean=False)
        again = Snapshotter("priv", SnapshotOptions(every=1, parity=0), root=root)  # the relaunch proposes the stored secret
        assert again.secret == secret
        found = []
        for d, _, files in os.walk(paths.job_dir(root, "priv")):
            for name in files:
                blob = open(os.path.join(d, name), "rb").read()
                if name != "secret" and (secret in blob or secret.hex().encode() in blob):
                    found.append(name)
        assert os.path.exists(os.path.join(paths.step_dir(root, "priv", 1), "manifest.json")) and found == []
        again.close()
        assert running_keeper(root) is None
    finally:
        kill_keeper(root)
