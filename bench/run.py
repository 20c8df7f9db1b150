"""``python -m bench.run [--quick] [--dir DIR] [--no-write]``: unickpt vs DCP and the
machine's limits, in one run; prints the table and writes it into docs/PERFORMANCE.md.

Full run: states of 1 GiB and 4 GiB (7-8 minutes on the 2-core machine it was written
on; needs about 12 GB of free disk and 14 GB of free memory). ``--quick``: 64 MiB and
256 MiB, one repetition (under 2 minutes). The page cache is dropped between every write
and the read that follows when the run has root; the table says when reads were warm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import torch

from unickpt.testing import run_ranks

from . import cases, machine, report
from .state import GiB, MiB


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and report."""
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small states (64 MiB, 256 MiB): a few minutes")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: ./.bench_tmp)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/PERFORMANCE.md alone")
    ap.add_argument("--doc", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "PERFORMANCE.md"))
    args = ap.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = os.path.abspath(args.dir or ".bench_tmp")
    os.makedirs(root, exist_ok=True)
    root = tempfile.mkdtemp(prefix="run_", dir=root)
    out = os.path.join(root, "results.jsonl")
    sizes = [64 * MiB, 256 * MiB] if args.quick else [GiB, 4 * GiB]
    cfg = {
        "root": root, "out": out, "sizes": sizes, "reps": 1 if args.quick else 2, "stall": True,
        "stall_saves": 3 if args.quick else 4, "compute_s": 0.5 if args.quick else 1.5,
        "replicated_bytes": 64 * MiB if args.quick else 512 * MiB,
    }
    started = time.time()
    load_before = os.getloadavg()
    print(f"bench: {'quick' if args.quick else 'full'} run in {root}", flush=True)
    try:
        print("machine limits ...", flush=True)
        limits = machine.measure(root, 256 * MiB if args.quick else GiB)
        print("  ", json.dumps(limits), flush=True)
        for world in (1, 4):
            print(f"sync save/load on {world} rank(s) ...", flush=True)
            run_ranks(cases.sync_save_load, world, {**cfg, "stall": world == 4}, timeout=3600)
        print("resharded load on 2 ranks ...", flush=True)
        run_ranks(cases.reshard_load, 2, cfg, timeout=3600)
        print("replicated reads on 4 ranks ...", flush=True)
        run_ranks(cases.replicated_reads, 4, cfg, timeout=3600)
        rows = [json.loads(line) for line in open(out)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    context = {
        "mode": "quick" if args.quick else "full",
        "command": "python -m bench.run" + (" --quick" if args.quick else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "minutes": (time.time() - started) / 60,
        "load_before": load_before, "load_after": os.getloadavg(),
        "cpus": os.cpu_count(), "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB,
        "torch": torch.__version__, "python": platform.python_version(),
    }
    text = report.render(rows, limits, context)
    print()
    print(text)
    if not args.no_write:
        report.write_into(args.doc, text, context["mode"])
        print(f"\nwritten into {args.doc}")


if __name__ == "__main__":
    main()
