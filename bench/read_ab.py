"""Before/after of the read path: the same timings run with two source trees, alternating.

    python -m bench.read_ab --before /work/main/src [--after src] [--rounds 3] [--mib 512] [--threads N]

Each round runs, for each tree, in a fresh process (page cache warm, one process, no
process group, the functions imported before timing): ``load``, ``load_tensor`` of every
tensor, ``convert --consolidate`` and ``verify`` of a checkpoint of ``--mib`` MiB in 16
tensors, then load, convert and verify of 2000 tensors of 64x64 (the fixed costs, as
``bench.many_tensors``); ``--threads``: the loads' (default: unickpt's own). Prints the best wall and CPU time (the process's, all threads:
steadier than wall time on a shared machine) per operation and tree. Prints only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SNIPPET = r"""
import json, os, shutil, sys, time
import torch, unickpt
root, mib = sys.argv[1], int(sys.argv[2])
threads = int(sys.argv[3]) or None
load, load_tensor, convert_, verify = unickpt.load, unickpt.load_tensor, unickpt.convert, unickpt.verify  # imported before timing
def timed(fn):
    wall = cpu = float("inf")
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return wall, cpu
res = {}
for label, n, shape in ((f"{mib} MiB in 16 tensors", 16, (mib * (1 << 20) // 4 // 16 // 1024, 1024)), ("2000 tensors of 64x64", 2000, (64, 64))):
    ck, out = os.path.join(root, f"ck{n}"), os.path.join(root, f"out{n}")
    if not os.path.exists(os.path.join(ck, "manifest.json")):
        unickpt.save({f"w{i}": torch.randn(shape) for i in range(n)}, ck)
    target = {f"w{i}": torch.empty(shape) for i in range(n)}
    def convert():
        shutil.rmtree(out, ignore_errors=True); convert_(ck, out)
    res[f"{label}: load"] = timed(lambda: load(target, ck) if threads is None else load(target, ck, threads=threads))
    if n == 16:
        res[f"{label}: load_tensor each"] = timed(lambda: [load_tensor(ck, f"w{i}") for i in range(n)])
    res[f"{label}: convert"] = timed(convert)
    res[f"{label}: verify"] = timed(lambda: verify(ck))
print(json.dumps(res))
"""


def run_tree(src: str, root: str, mib: int, threads: int = 0) -> dict[str, list[float]]:
    """One round of timings with the unickpt of ``src``: ``{operation: [wall, cpu]}``
    (``threads``: the loads'; 0: unickpt's default)."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", SNIPPET, root, str(mib), str(threads)], env=env, capture_output=True,
                       text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="src")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="the loads' threads (0: unickpt's default)")
    args = ap.parse_args()
    best: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory(dir=os.path.abspath(".bench_tmp") if os.path.isdir(".bench_tmp") else None) as root:
        for _ in range(args.rounds):
            for which, src in (("before", args.before), ("after", args.after)):
                for k, (wall, cpu) in run_tree(src, root, args.mib, args.threads).items():
                    w, c = best[which].get(k, [float("inf")] * 2)
                    best[which][k] = [min(w, wall), min(c, cpu)]
    print(f"best of {3 * args.rounds} (3 per process, {args.rounds} processes per tree, alternating); "
          f"load threads {args.threads or 'default'}; load average {os.getloadavg()[0]:.1f}")
    print("| operation | wall before | wall after | CPU before | CPU after | CPU after/before |")
    print("|---|---|---|---|---|---|")
    for k in best["before"]:
        (wb, cb), (wa, ca) = best["before"][k], best["after"][k]
        print(f"| {k} | {wb:.3f} s | {wa:.3f} s | {cb:.3f} s | {ca:.3f} s | {ca / cb:.2f}x |")


if __name__ == "__main__":
    main()
