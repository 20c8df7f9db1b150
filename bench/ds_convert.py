"""DeepSpeed ZeRO -> universal checkpoint conversion: unickpt vs DeepSpeed's ``ds_to_universal``.

    python -m bench.ds_convert [--configs 1GiB,5GiB] [--no-write]

For each configuration, trains the example model for one step with DeepSpeed ZeRO-2 on 2
CPU ranks (tests/ds_train.py), saves, then converts the same checkpoint with both tools,
each in its own process (``/usr/bin/time`` gives wall time and peak RSS), alternating,
twice, with a ``sync`` before each and a timed ``sync`` after. Reports the best time and
the highest peak RSS of each, their ratios, unickpt's floor on this machine (its start,
``unickpt --help``, plus writing its output at the disk's measured speed), the load
average around the conversions, and checks that both outputs hold the same parameters and
moments bitwise. Needs DeepSpeed (see README) and about 20 GB free.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from .machine import write_bandwidth
from .report import write_into

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one command."""
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], env=ENV, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return wall, int(r.stderr.strip().splitlines()[-1]) / 1024


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _same(a: str, b: str) -> int:
    """Compare the two universal outputs tensor by tensor; returns the tensors compared."""
    n = 0
    for param in sorted(os.listdir(os.path.join(a, "zero"))):
        pa = os.path.join(a, "zero", param)
        if not os.path.isdir(pa):
            continue
        for f in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
            x = torch.load(os.path.join(pa, f), weights_only=True)["param"]
            y = torch.load(os.path.join(b, "zero", param, f), weights_only=True)["param"]
            if x.shape != y.shape or not torch.equal(x, y):
                raise AssertionError(f"{param}/{f} differs between the two outputs")
            n += 1
    return n


CONFIGS = {  # name: (dim, layers, vocab) of the example model trained with DeepSpeed
    "1GiB": (768, 6, 8192),
    "5GiB": (1536, 8, 16384),
}


def _train(ckpt: str, dim: int, layers: int, vocab: int) -> str:
    subprocess.run([
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29631",
        os.path.join(REPO, "tests", "ds_train.py"), "--stage", "2", "--steps", "1", "--save-dir", ckpt,
        "--dim", str(dim), "--layers", str(layers), "--vocab", str(vocab), "--heads", "12", "--kv-heads", "4",
    ], env=ENV, check=True, capture_output=True)
    return os.path.join(ckpt, "global_step1")


def _measure(root: str, tag: str, reps: int) -> dict[str, tuple[float, float, float]]:
    """name -> (best wall seconds, then with a ``sync`` after it, highest peak RSS MiB)."""
    tools = {
        "ds_to_universal": lambda out: [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                        "--input_folder", tag, "--output_folder", out, "--inject_missing_state"],
        "unickpt": lambda out: [sys.executable, "-m", "unickpt", "convert", tag, out, "--to", "deepspeed"],
    }
    best = {k: (float("inf"), float("inf"), 0.0) for k in tools}
    for rep in range(reps):
        for name, cmd in tools.items():
            out = os.path.join(root, f"{name}_{rep}")
            os.sync()
            wall, rss = _timed(cmd(out))
            t0 = time.perf_counter()
            os.sync()  # what making the output durable still costs after the tool returned
            synced = wall + time.perf_counter() - t0
            print(f"  {name}: {wall:.2f} s ({synced:.2f} s with sync), peak RSS {rss:.0f} MiB", flush=True)
            b = best[name]
            best[name] = (min(b[0], wall), min(b[1], synced), max(b[2], rss))
            if rep:
                shutil.rmtree(out)
    return best


def _compile_sources() -> None:
    """Byte-compile unickpt's sources, as installing a package does (DeepSpeed's are, in
    site-packages): run from a source tree under ``PYTHONDONTWRITEBYTECODE`` the tool would
    otherwise compile every module on every run, a cost no installed copy pays."""
    import compileall

    compileall.compile_dir(os.path.join(REPO, "src", "unickpt"), quiet=1)


def _seconds(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=ENV, capture_output=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    """Run the conversion benchmark and report."""
    ap = argparse.ArgumentParser(prog="python -m bench.ds_convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="scratch directory (default: ./.bench_tmp)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/PERFORMANCE.md alone")
    args = ap.parse_args(argv)
    base = os.path.abspath(args.dir or ".bench_tmp")
    os.makedirs(base, exist_ok=True)
    started = time.time()
    _compile_sources()
    disk = write_bandwidth(base, 1 << 30)
    imports = min(_seconds([sys.executable, "-c", "import torch"]) for _ in range(2))
    startup = min(_seconds([sys.executable, "-m", "unickpt", "--help"]) for _ in range(2))
    print(f"disk write+fsync {disk:.2f} GB/s; python -c 'import torch' {imports:.2f} s; unickpt --help {startup:.2f} s",
          flush=True)
    rows = []
    loads: dict[str, tuple[float, float]] = {}
    for cfg in args.configs.split(","):
        dim, layers, vocab = CONFIGS[cfg]
        root = tempfile.mkdtemp(prefix="ds_", dir=base)
        try:
            print(f"{cfg}: training one ZeRO-2 step on 2 ranks (dim {dim}, {layers} layers, vocabulary {vocab}) and saving ...", flush=True)
            tag = _train(os.path.join(root, "ckpt"), dim, layers, vocab)
            load_before = os.getloadavg()[0]
            best = _measure(root, tag, args.reps)
            loads[cfg] = (load_before, os.getloadavg()[0])
            compared = _same(os.path.join(root, "ds_to_universal_0"), os.path.join(root, "unickpt_0"))
            rows.append((cfg, dim, layers, vocab, _tree_bytes(tag), _tree_bytes(os.path.join(root, "unickpt_0")), best, compared))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    lines = [
        "### DeepSpeed ZeRO-2 -> universal conversion",
        "",
        f"`python -m bench.ds_convert` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}): ZeRO-2 checkpoints of the example model saved by "
        f"DeepSpeed on 2 ranks, converted by each tool in its own process (imports included), best of {args.reps}. "
        f"`ds_to_universal` does not fsync its output, unickpt does: the \"+ sync\" column adds the `sync` run right "
        f"after each tool, what making the output durable still cost. Measured in the same run: the disk writes "
        f"{disk:.2f} GB/s with fsync, `python -c 'import torch'` takes {imports:.2f} s (`ds_to_universal` pays it, "
        f"unickpt's conversion imports no torch) and `unickpt --help` {startup:.2f} s. Load average (1 minute) "
        "before / after the conversions: " + ", ".join(f"{c} {a:.1f} / {b:.1f}" for c, (a, b) in loads.items())
        + " (other jobs shared the machine when well above 0).",
        "",
        "| checkpoint | tool | wall time | + sync | peak RSS | floor: start + write at disk speed |",
        "|---|---|---|---|---|---|",
    ]
    verdicts = []
    for cfg, dim, layers, vocab, size, out_size, best, compared in rows:
        (dt, ds, dm), (ut, us, um) = best["ds_to_universal"], best["unickpt"]
        floor = startup + out_size / 1e9 / disk
        what = f"{size / 2**30:.2f} GiB (dim {dim}, {layers} layers, vocab {vocab}; {compared} tensors bitwise equal)"
        lines += [
            f"| {what} | DeepSpeed `ds_to_universal` | {dt:.2f} s | {ds:.2f} s | {dm:.0f} MiB | |",
            f"| | unickpt `convert --to deepspeed` | {ut:.2f} s | {us:.2f} s | {um:.0f} MiB | {floor:.2f} s |",
            f"| | **ratio (DeepSpeed / unickpt)** | **{dt / ut:.2f}x** | **{ds / us:.2f}x** | **{dm / um:.2f}x** | |",
        ]
        verdicts.append(
            f"- {size / 2**30:.2f} GiB: {dt / ut:.2f}x faster ({ds / us:.2f}x with both durable; target 5x), "
            f"{dm / um:.2f}x less peak memory (target 4x): **{'met' if dt / ut >= 5 and dm / um >= 4 else 'not met'}**")
    text = "\n".join(lines + ["", "Targets: at least 5x faster and at most a quarter of the peak memory.", "", *verdicts])
    print()
    print(text)
    if not args.no_write:
        doc = os.path.join(REPO, "docs", "PERFORMANCE.md")
        write_into(doc, text, "ds_convert")
        print(f"\nwritten into {doc}")


if __name__ == "__main__":
    main()
