"""Reading a Megatron-Core ``torch_dist`` checkpoint: unickpt vs Megatron-Core's own
``dist_checkpointing.load``, in the same run.

    python -m bench.megatron_read [--gib 1] [--reps 3] [--no-write]

Megatron-Core's ``dist_checkpointing.save`` writes a checkpoint of about ``--gib`` GiB on 2
gloo ranks (tensor parallel 2: a column-parallel fc1 and a row-parallel fc2 stacked over 8
layers, fp32). One process (a gloo group of 1, as Megatron-Core's loader needs) then reads
every tensor whole, alternating Megatron-Core's ``dist_checkpointing.load`` and
``unickpt.load`` into existing tensors (allocated and touched before the clock starts, as a
model's parameters are), ``--reps`` times each, and checks that both read the same bytes. The page cache is warm (the files are read once before; dropping it would
disturb other jobs on a shared machine): this measures each reader's own cost, not the
disk. Reports the best time of each, their ratio and the load average around the reads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

from unickpt.testing import run_ranks

from .report import write_into

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS, HIDDEN = 8, 2048
PRELOAD = ["torch", "torch.distributed.checkpoint", "megatron.core.dist_checkpointing", "unickpt"]


def _cpu() -> None:
    torch.cuda.synchronize = lambda *a, **k: None  # Megatron-Core's writer syncs CUDA after staging
    torch.cuda.current_device = lambda: "cpu"


def _shapes(gib: float) -> dict[str, tuple[int, ...]]:
    ffn = int(gib * (1 << 30) / 4 / 2 / LAYERS / HIDDEN) // 256 * 256
    return {"decoder.layers.mlp.linear_fc1.weight": (LAYERS, ffn, HIDDEN),
            "decoder.layers.mlp.linear_fc2.weight": (LAYERS, HIDDEN, ffn)}


def save(rank: int, world: int, path: str, gib: float) -> None:
    """Megatron-Core's save: fc1 cut on its output dim, fc2 on its input dim (TP = ``world``)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    _cpu()
    g = torch.Generator().manual_seed(rank)
    sd = {}
    for key, shape in _shapes(gib).items():
        axis = 1 if "fc1" in key else 2
        local = list(shape)
        local[axis] //= world
        sd[key] = ShardedTensor.from_rank_offsets(key, torch.randn(*local, generator=g), (axis, rank, world),
                                                  replica_id=0)
    dist_checkpointing.save(sd, path)


def read(rank: int, world: int, path: str, gib: float, reps: int, out: str) -> None:
    """Both readers, alternating, on this one process; timings to ``out``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    import unickpt

    _cpu()
    shapes = _shapes(gib)
    times: dict[str, list[float]] = {"megatron": [], "unickpt": []}
    same = True
    for rep in range(reps):
        order = ("megatron", "unickpt") if rep % 2 == 0 else ("unickpt", "megatron")
        got = {}
        for who in order:
            targets = {k: torch.zeros(s) for k, s in shapes.items()}  # touched, as a model's parameters are
            t0 = time.perf_counter()
            if who == "megatron":
                sharded = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in targets.items()}
                loaded = dist_checkpointing.load(sharded, path)
            else:
                unickpt.load(targets, path)
                loaded = targets
            times[who].append(time.perf_counter() - t0)
            got[who] = loaded
        same = same and all(torch.equal(got["megatron"][k], got["unickpt"][k]) for k in shapes)
        del got
    with open(out, "w") as f:
        json.dump({"times": times, "same": same}, f)


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _warm(path: str) -> None:
    for d, _, fs in os.walk(path):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(16 << 20):
                    pass


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and report."""
    ap = argparse.ArgumentParser(prog="python -m bench.megatron_read", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="scratch directory (default: ./.bench_tmp)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/PERFORMANCE.md alone")
    args = ap.parse_args(argv)
    base = os.path.abspath(args.dir or ".bench_tmp")
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="mcore_", dir=base)
    started = time.time()
    try:
        path = os.path.join(root, "ckpt")
        os.makedirs(path)
        print(f"saving ~{args.gib:g} GiB with Megatron-Core's dist_checkpointing.save on 2 ranks ...", flush=True)
        run_ranks(save, 2, path, args.gib, preload=PRELOAD, timeout=1200)
        size = _bytes(path)
        _warm(path)
        load_before = os.getloadavg()[0]
        run_ranks(read, 1, path, args.gib, args.reps, os.path.join(root, "times.json"), preload=PRELOAD, timeout=1200)
        load_after = os.getloadavg()[0]
        with open(os.path.join(root, "times.json")) as f:
            res = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mt, ut = min(res["times"]["megatron"]), min(res["times"]["unickpt"])
    import megatron.core

    gb = size / 1e9
    lines = [
        "### Megatron-Core torch_dist read: unickpt vs `dist_checkpointing.load`",
        "",
        f"`python -m bench.megatron_read --gib {args.gib:g} --reps {args.reps}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, megatron-core {getattr(megatron.core, '__version__', '?')}): a {size / 2**30:.2f} GiB "
        "checkpoint that Megatron-Core's `dist_checkpointing.save` wrote on 2 gloo ranks (TP 2, fc1 and fc2 of 8 "
        "stacked layers, fp32), read whole in one process by each reader into existing (touched) tensors, alternating, best of "
        f"{args.reps}; warm page cache. Load average (1 minute) before / after the reads: {load_before:.1f} / "
        f"{load_after:.1f}: the machine was shared with other jobs, so single timings are noisy; the ratio comes "
        "from the same run. Both readers returned the same bytes: "
        + ("**yes**." if res["same"] else "**NO**."),
        "",
        "| reader | best wall time | throughput | all runs |",
        "|---|---|---|---|",
        f"| Megatron-Core `dist_checkpointing.load` | {mt:.2f} s | {gb / mt:.2f} GB/s | "
        + ", ".join(f"{t:.2f}" for t in res["times"]["megatron"]) + " s |",
        f"| unickpt `load` | {ut:.2f} s | {gb / ut:.2f} GB/s | " + ", ".join(f"{t:.2f}" for t in res["times"]["unickpt"]) + " s |",
        f"| **ratio (Megatron-Core / unickpt)** | **{mt / ut:.2f}x** | | |",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        doc = os.path.join(REPO, "docs", "PERFORMANCE.md")
        write_into(doc, text, "megatron_read")
        print(f"\nwritten into {doc}")


if __name__ == "__main__":
    main()
