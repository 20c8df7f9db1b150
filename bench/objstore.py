"""Object-store throughput: save and load of one state to an S3 server, against the local
disk and against PyTorch DCP's fsspec writer/reader on the same server.

    python -m bench.objstore [--mib 256] [--reps 2] [--endpoint http://host:port]

One process, no process group (each rank of a job does the same against its own file).
Without ``--endpoint`` a moto S3 server is started on 127.0.0.1 (in its own process: it
holds the objects in memory, so its speed is a floor, not S3's); with it, any S3
endpoint (credentials from the environment). The state: 16 MiB fp32 weights and two
small vectors per layer. Rows, best of ``reps`` (the local load right after the save
reads from the page cache):

- unickpt local: ``save``/``load`` to a directory under ``--dir``.
- unickpt s3 (threads=N): ``save``/``load`` to ``s3://bench/...``; N writer threads,
  so N parts of 16 MiB in flight per file on save; loads fetch 16 MiB ranges at once.
- dcp fsspec (thread_count=N): ``dcp.save(storage_writer=FsspecWriter(url, thread_count=N))``
  and ``dcp.load(storage_reader=FsspecReader(url))`` on the same server.

Prints a table and, with ``--json``, one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from .machine import best_time

MiB = 1 << 20


def build(mib: int, fill: bool) -> dict[str, torch.Tensor]:
    """About ``mib`` MiB of layers: a 2048x2048 fp32 weight and two 2048 vectors each."""
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(max(1, mib // 16)):
        for name, shape in ((f"layers.{i}.weight", (2048, 2048)), (f"layers.{i}.bias", (2048,)), (f"layers.{i}.norm", (2048,))):
            sd[name] = torch.randn(shape, generator=g) if fill else torch.zeros(shape)
    return sd


def start_moto() -> tuple[subprocess.Popen, str]:
    """A moto S3 server on a free port of 127.0.0.1."""
    import socket

    from unickpt.testing import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    """Run and print."""
    ap = argparse.ArgumentParser(prog="python -m bench.objstore", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--endpoint", default=None, help="an S3 endpoint URL (default: start a moto server)")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--dir", default=None, help="local scratch directory (default: ./.bench_tmp)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    proc = None
    endpoint = args.endpoint
    if endpoint is None:
        proc, endpoint = start_moto()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    import boto3
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import unickpt
    from unickpt.storage.fsspec_store import FsspecStorage

    s3 = boto3.client("s3", endpoint_url=endpoint)
    try:
        s3.create_bucket(Bucket=args.bucket)
    except Exception:
        pass
    base = args.dir or os.path.join(os.getcwd(), ".bench_tmp")
    os.makedirs(base, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="objstore_", dir=base)
    sd, target = build(args.mib, True), build(args.mib, False)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    rows = []

    def row(name: str, save_s: float, load_s: float) -> None:
        rows.append({"case": name, "mib": nbytes / MiB, "save_s": save_s, "load_s": load_s,
                     "save_mib_s": nbytes / MiB / save_s, "load_mib_s": nbytes / MiB / load_s})
        check = all(torch.equal(target[k], sd[k]) for k in sd)
        for t in target.values():
            t.zero_()
        if not check:
            raise SystemExit(f"{name}: loaded state differs")

    def clear_prefix(prefix: str) -> None:
        st = FsspecStorage(f"s3://{args.bucket}/{prefix}")
        st.remove_many(st.list_files())

    try:
        local = os.path.join(scratch, "local")
        s = best_time(lambda: unickpt.save(sd, local, overwrite=True), args.reps)
        lo = best_time(lambda: unickpt.load(target, local), args.reps)
        row("unickpt local (page cache)", s, lo)
        for threads in (1, 4):
            url = f"s3://{args.bucket}/unickpt_t{threads}"
            s = best_time(lambda: unickpt.save(sd, url, overwrite=True, threads=threads), args.reps)
            lo = best_time(lambda: unickpt.load(target, url, threads=threads), args.reps)
            row(f"unickpt s3 (threads={threads})", s, lo)
        for threads in (1, 4):
            url = f"s3://{args.bucket}/dcp_t{threads}"
            s = best_time(lambda: dcp.save(sd, storage_writer=FsspecWriter(url, thread_count=threads, overwrite=True)), args.reps,
                     lambda: clear_prefix(f"dcp_t{threads}"))
            lo = best_time(lambda: dcp.load(target, storage_reader=FsspecReader(url)), args.reps)
            row(f"dcp fsspec (thread_count={threads})", s, lo)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if proc is not None:
            proc.kill()
            proc.wait()
    print(f"{nbytes / MiB:.0f} MiB state, endpoint {endpoint}{' (moto)' if proc else ''}, best of {args.reps}")
    print(f"{'case':34} {'save s':>8} {'MiB/s':>8} {'load s':>8} {'MiB/s':>8}")
    for r in rows:
        print(f"{r['case']:34} {r['save_s']:8.2f} {r['save_mib_s']:8.0f} {r['load_s']:8.2f} {r['load_mib_s']:8.0f}")
        if args.json:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
