"""Damaging the files of a frozen shm root, and relaunching the example trainer on each
damaged copy in-process (the rank function of tests/test_snapshot_fuzz.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

CORRUPTIONS = ("flipped", "digit", "truncated", "emptied", "deleted", "directory")


def corrupt(path: str, how: str) -> None:
    """Damage one file: ``flipped`` (three bytes XORed, at a quarter, half and three
    quarters of it; an empty file stays empty), ``digit`` (the first decimal digit from
    the middle on changed: a JSON file stays valid JSON), ``truncated`` (to half), ``emptied``,
    ``deleted``, or ``directory`` (replaced by a directory holding one file)."""
    if how == "flipped":
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            for at in sorted({size // 4, size // 2, 3 * size // 4} if size else ()):
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0x5A]))
    elif how == "digit":
        with open(path, "r+b") as f:
            data = f.read()
            at = next((i for i in range(len(data) // 2, len(data)) if data[i:i + 1].isdigit()), None)
            if at is not None:
                f.seek(at)
                f.write(str((int(data[at:at + 1]) + 1) % 10).encode())
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "emptied":
        os.truncate(path, 0)
    elif how == "deleted":
        os.unlink(path)
    elif how == "directory":
        os.unlink(path)
        os.makedirs(path)
        with open(os.path.join(path, "x"), "wb") as f:
            f.write(b"x")
    else:
        raise ValueError(how)


def relaunch_cases(rank: int, world: int, tmp: str, job: str, flags: list[str],
                   cases: list[tuple[str, list[tuple[int, str, str]], int]], out: str) -> None:
    """Rank ``rank`` as node ``rank`` (its own shm root). For each case ``(name, damage, stop)``:
    the node's shm root is a fresh copy of ``<tmp>/frozen<rank>``, the durable tier one of
    ``<tmp>/ck``, and the files ``(node, path under the root, corruption)`` of ``damage``
    on this node are damaged; then the example trainer runs as a relaunch would (its
    recovery at start, then training to step ``stop``) and the keepers it started are
    killed. Rank 0 writes, per case, the recovery line and the losses of the steps trained."""
    import torch.distributed as dist

    from unickpt.examples.train import run
    from unickpt.snapshot import keeper_admin as keepers

    os.environ.update(UNICKPT_JOB_ID=job, GROUP_RANK=str(rank), LOCAL_RANK="0")
    results = {}
    for name, damage, stop in cases:
        work = os.path.join(tmp, "case")
        root = os.path.join(work, f"shm{rank}")
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(os.path.join(tmp, f"frozen{rank}"), root, symlinks=True)
        if rank == 0:
            shutil.rmtree(os.path.join(work, "ck"), ignore_errors=True)
            shutil.copytree(os.path.join(tmp, "ck"), os.path.join(work, "ck"))
        for node, rel, how in damage:
            if node == rank:
                corrupt(os.path.join(root, rel), how)
        dist.barrier()
        os.environ["UNICKPT_SHM_ROOT"] = root
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            records = run([*flags, "--ckpt-dir", os.path.join(work, "ck"), "--stop-after", str(stop)])
        dist.barrier()  # each node's keeper waits for the other's word before its last step is whole
        for p in list(keepers._CHILDREN):  # the keeper this relaunch started on this node
            p.kill()
            p.wait()
            keepers._CHILDREN.remove(p)
        lines = [ln for ln in printed.getvalue().splitlines() if ln.startswith(("resumed step", "starting fresh"))]
        results[name] = {"lines": lines, "losses": {r["step"]: r["loss"] for r in records}}
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
