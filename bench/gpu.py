"""``python -m bench.gpu --out DIR``: one command that proves and measures unickpt's CUDA
paths on a GPU machine, and always brings figures back.

It runs, each part in a child process under its own time limit (a part that fails, hangs
or runs out of time is written down and the next one runs):

1. ``env``: device, driver, torch, CUDA, NCCL and Python versions, memory, shm, disk;
2. ``tests``: the suite's CUDA tests (``pytest -m cuda``; on a CPU machine they skip);
3. ``limits``: device-to-host into pinned and pageable memory, host-to-device, pinning;
4. ``async_save``: the training stall of one ``async_save`` of 1, 4 and 16 GiB of device
   state, eager and lazy, first save (pins its buffer) and later ones (reuse it), against
   the pinned copy of the same bytes and DCP's ``async_save`` with its pinned stager;
5. ``snapshot``: the same for an in-memory snapshot;
6. ``load``: a load into device tensors, cold and warm, against the disk and H2D limits;
7. ``restart``: a fresh process's import -> device context -> process group -> first
   step, against re-forming the group inside the process.

It writes ``DIR/gpu.json`` (every figure, every part's status) and ``DIR/gpu.md`` (the
same as tables) after every part, so even a run cut short leaves both. ``--dry-run``
runs every part on the CPU at tiny sizes (the test suite does, so the command never
rots). ``--parts a,b`` runs only those. The whole run keeps to ``--budget`` seconds
(default 450: one H100 call of 540 s with room for the machine's start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from .gpu_parts import PARTS, ROOT, scratch_dirs

# the most each part may take on the GPU machine (seconds); the budget may cut them
LIMITS = {"env": 40, "tests": 150, "limits": 60, "async_save": 200, "snapshot": 120, "load": 100, "restart": 90}


def run_part(name: str, out: str, dry: bool, limit: float) -> dict[str, Any]:
    """Run one part in a child process group; its status, time, figures and error."""
    path = os.path.join(out, f"part_{name}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable, "-m", "bench.gpu_parts", name, "--out", out, *(["--dry-run"] if dry else [])]
    # the part's scratch folders go inside two of this process's, removed here whatever the
    # part's end: one killed for its time cannot remove its own
    scratch = scratch_dirs()
    env = dict(os.environ, PYTHONUNBUFFERED="1", GPU_TESTS_TIMEOUT=str(max(10, limit - 10)),
               UNICKPT_BENCH_SCRATCH_SHM=scratch[0], UNICKPT_BENCH_SCRATCH_DISK=scratch[1])
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    try:
        log, _ = p.communicate(timeout=limit)
        status = "ok" if p.returncode == 0 else f"failed (exit {p.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        log, _ = p.communicate()
        status = f"timed out after {limit:.0f} s"
    finally:
        for d in scratch:
            shutil.rmtree(d, ignore_errors=True)
    figures = []
    if os.path.exists(path):
        with open(path) as f:
            figures = [json.loads(line) for line in f if line.strip()]
    result = {"status": status, "seconds": round(time.perf_counter() - t0, 1), "figures": figures}
    if status != "ok":
        result["log_tail"] = (log or "")[-4000:]
    return result


def markdown(doc: dict[str, Any]) -> str:
    """The run as readable tables: the machine first, then each part."""
    env = next(iter(doc["parts"].get("env", {}).get("figures", [])), {})
    head = ", ".join(f"{k} {env[k]}" for k in ("device", "driver", "torch", "cuda", "nccl", "python", "unickpt") if env.get(k))
    lines = ["# unickpt on a GPU: `python -m bench.gpu`", "",
             f"Machine: {head or 'no environment figures'}{' (DRY RUN: CPU, tiny sizes)' if doc['dry_run'] else ''}.",
             f"Run started {doc['started']}, took {doc['seconds']} s.", ""]
    for name, part in doc["parts"].items():
        lines += [f"## {name}: {part['status']} ({part['seconds']} s)", ""]
        if name == "env":
            lines += [f"- {k}: {v}" for f in part["figures"] for k, v in f.items() if k != "what"]
        figs = [f for f in part["figures"] if name != "env"]
        if figs:
            cols: list[str] = []
            for f in figs:
                cols += [k for k in f if k not in cols and not isinstance(f[k], (list, dict)) and k != "tail"]
            lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(str(f.get(c, "")) for c in cols) + " |" for f in figs]
            for f in figs:
                if f.get("failures"):
                    lines += ["", "```", *f["failures"], "```"]
                if f.get("tail"):
                    lines += ["", "```", f["tail"][-3000:], "```"]
        if part.get("log_tail"):
            lines += ["", "```", part["log_tail"][-3000:].rstrip(), "```"]
        lines.append("")
    return "\n".join(lines)


def write(out: str, doc: dict[str, Any]) -> None:
    """Write gpu.json and gpu.md (after every part)."""
    with open(os.path.join(out, "gpu.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out, "gpu.md"), "w") as f:
        f.write(markdown(doc))


def main(argv: list[str] | None = None) -> int:
    """Run the parts and write the report; exit 1 when a part did not end ok."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu.json and gpu.md")
    ap.add_argument("--dry-run", action="store_true", help="every part on the CPU at tiny sizes")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {','.join(PARTS)}")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    args = ap.parse_args(argv)
    names = [p for p in args.parts.split(",") if p]
    unknown = [p for p in names if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; the parts are {list(PARTS)}")
    os.makedirs(args.out, exist_ok=True)
    deadline = time.monotonic() + args.budget
    doc: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "dry_run": args.dry_run,
                           "seconds": 0.0, "parts": {}}
    t0 = time.perf_counter()
    for name in names:
        left = deadline - time.monotonic()
        if left < 3:
            doc["parts"][name] = {"status": "not run: the budget was spent", "seconds": 0.0, "figures": []}
        else:
            print(f"bench.gpu: {name} (at most {min(LIMITS[name], left):.0f} s) ...", flush=True)
            doc["parts"][name] = run_part(name, args.out, args.dry_run, min(LIMITS[name], left))
            print(f"bench.gpu: {name}: {doc['parts'][name]['status']} in {doc['parts'][name]['seconds']} s", flush=True)
        doc["seconds"] = round(time.perf_counter() - t0, 1)
        write(args.out, doc)
    bad = [n for n, p in doc["parts"].items() if p["status"] != "ok"]
    print(f"bench.gpu: wrote {os.path.join(args.out, 'gpu.md')}; "
          + (f"not ok: {', '.join(bad)}" if bad else "every part ok"), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
