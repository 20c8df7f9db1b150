"""A real S3-compatible server for the object-store tests (moto's server, as a subprocess
on 127.0.0.1), and the rank functions those tests spawn (module level so spawn can import
them)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import unickpt
from unickpt.api.load import load_into
from unickpt.testing import free_port

from dist_cases import build_state, check_state

BUCKET = "ckpt"


class S3Server:
    """``moto_server`` on a free port of 127.0.0.1, in its own process (so that it can
    really go away: ``kill``)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start")
                time.sleep(0.05)

    def env(self) -> dict[str, str]:
        """The standard environment that points S3 clients (botocore, s3fs) at this server."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing", aws_secret_access_key="testing",
                            region_name="us-east-1")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


PRELOAD = ["torch", "torch.distributed", "unickpt", "unickpt.testing"]


def save_a4(rank: int, world: int, env: dict[str, str], url: str) -> None:
    """4 ranks save layout a4 to ``url``."""
    os.environ.update(env)  # forked from a fork server started before the test set it
    unickpt.save(build_state("a4", fill=True), url)


def load_d2_counting(rank: int, world: int, env: dict[str, str], url: str, out: str) -> None:
    """2 ranks load layout d2 from ``url`` (bitwise checked); each writes what it fetched:
    its GETs at the storage boundary and the bytes its read plan needed."""
    os.environ.update(env)
    from unickpt.storage.fsspec_store import TRANSFER

    sd = build_state("d2", fill=False)
    TRANSFER.reset()
    record = load_into(sd, url)
    check_state(sd, f"rank {rank}/{world} d2 from {url}")
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"get_bytes": TRANSFER.get_bytes, "gets": TRANSFER.gets, "ranges": TRANSFER.get_ranges,
                   "planned": record.bytes_read}, f)


def tiered_training(rank: int, world: int, env: dict[str, str], local: str, durable: str, out: str) -> None:
    """The example trainer with --ckpt-dir on S3, then with two tiers: resume from the
    object store after the local copy is deleted. Rank 0 writes each run's records."""
    os.environ.update(env)
    import shutil

    import torch.distributed as dist

    from unickpt.examples.train import run

    small = ["--steps", "8", "--seed", "3", "--print-every", "0"]
    runs = {
        "s3_full": run(small + ["--save-every", "4", "--ckpt-dir", f"{durable}/s3only"]),
    }
    dist.barrier()
    runs["tiers_first"] = run(small + ["--save-every", "2", "--stop-after", "4", "--ckpt-dir", local,
                                       "--durable-dir", f"{durable}/tiers", "--durable-every", "2"])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(local)  # the node's disk is gone
    dist.barrier()
    runs["tiers_resumed"] = run(small + ["--resume", "latest", "--ckpt-dir", local, "--durable-dir", f"{durable}/tiers"])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(runs, f)


def save_then_die(rank: int, world: int, env: dict[str, str], root: str, piddir: str) -> None:
    """2 ranks: commit step 1, then save step 5, where rank 1's file is small (it is
    complete at once) and rank 0's is 160 MiB (uploaded in parts while the test SIGKILLs
    both ranks)."""
    import torch

    os.environ.update(env)
    with open(os.path.join(piddir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    manager = unickpt.CheckpointManager(root)
    manager.save({"w": torch.arange(10.0)}, 1)
    big = torch.randn((40 << 20) if rank == 0 else 10)
    manager.save({"w": torch.arange(10.0), "mine": unickpt.PerRank(big)}, 5, threads=2)


class ThrottledProxy:
    """A TCP forwarder on 127.0.0.1 in front of ``port`` whose traffic (both directions,
    all connections together) is held to ``rate`` bytes per second: a storage made slow
    for real, on the network, with nothing of unickpt replaced."""

    def __init__(self, port: int, rate: float) -> None:
        import threading

        self.upstream, self.rate = port, rate
        self._lock = threading.Lock()
        self._next = time.monotonic()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def env(self) -> dict[str, str]:
        """The S3 client environment pointing at the proxy."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1"}

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:  # the server is gone: the client hears it at once, never waits for a timeout
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(16384):
                with self._lock:  # one schedule for every connection: the rate is the total
                    at = self._next = max(self._next, time.monotonic()) + len(data) / self.rate
                time.sleep(max(0.0, at - time.monotonic()))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        """Stop accepting (connections in flight end with their peers)."""
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (Linux)
        except OSError:
            pass
        self.server.close()
