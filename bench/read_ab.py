"""Before/after of the read path: the same timings run with two source trees, alternating.

    python -m bench.read_ab --before /work/main/src [--after src] [--rounds 3] [--mib 512]

Each round runs, for each tree, in a fresh process (page cache warm, one process, no
process group): ``load``, ``load_tensor`` of every tensor, ``convert --consolidate`` and
``verify`` of a checkpoint of ``--mib`` MiB in 16 tensors (best of 3 in the process,
the functions imported before timing), then ``bench.many_tensors``
(2000 small tensors: the fixed costs). Prints the best of all rounds per operation and
tree, and the ratio. Prints only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

SNIPPET = r"""
import json, os, shutil, sys, time
import torch, unickpt
root, mib = sys.argv[1], int(sys.argv[2])
ck, out = os.path.join(root, "ck"), os.path.join(root, "out")
n = 16
rows = mib * (1 << 20) // 4 // n // 1024
if not os.path.exists(os.path.join(ck, "manifest.json")):
    unickpt.save({f"w{i}": torch.randn(rows, 1024) for i in range(n)}, ck)
target = {f"w{i}": torch.empty(rows, 1024) for i in range(n)}
load, load_tensor, convert_, verify = unickpt.load, unickpt.load_tensor, unickpt.convert, unickpt.verify  # imported before timing
def timed(fn):
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t0)
    return best
def convert():
    shutil.rmtree(out, ignore_errors=True); convert_(ck, out)
res = {
    "load": timed(lambda: load(target, ck)),
    "load_tensor (each)": timed(lambda: [load_tensor(ck, f"w{i}") for i in range(n)]),
    "convert --consolidate": timed(convert),
    "verify": timed(lambda: verify(ck)),
}
print(json.dumps(res))
"""


def run_tree(src: str, root: str, mib: int) -> dict[str, float]:
    """One round of timings with the unickpt of ``src``."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", SNIPPET, root, str(mib)], env=env, capture_output=True, text=True, check=True)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    m = subprocess.run([sys.executable, "-m", "bench.many_tensors", "--reps", "2", "--dir", root], env=env,
                       capture_output=True, text=True, check=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for line in m.stdout.splitlines()[1:]:
        found = re.match(r"\s+(.+?)\s+([\d.]+) s\s", line)
        if found:
            res[f"2000 tensors: {found.group(1)}"] = float(found.group(2))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="src")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=512)
    args = ap.parse_args()
    best: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory(dir=os.path.abspath(".bench_tmp") if os.path.isdir(".bench_tmp") else None) as root:
        for _ in range(args.rounds):
            for which, src in (("before", args.before), ("after", args.after)):
                for k, v in run_tree(src, root, args.mib).items():
                    best[which][k] = min(v, best[which].get(k, float("inf")))
    print(f"{'operation':<32} {'before':>9} {'after':>9} {'after/before':>13}   (best of {args.rounds}, load average {os.getloadavg()[0]:.1f})")
    for k in best["before"]:
        b, a = best["before"][k], best["after"][k]
        print(f"{k:<32} {b:>8.3f}s {a:>8.3f}s {a / b:>12.2f}x")


if __name__ == "__main__":
    main()
