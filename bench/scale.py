"""Scale by simulation: unickpt's metadata path for a 405B model on 16,384 ranks.

    python -m bench.scale            # TP8 x PP16 x DP128 (16,384 ranks) -> TP8 x PP8 x DP96 (6,144)
    python -m bench.scale --quick    # 1/16 the ranks: DP8 -> DP6 (1,024 -> 384 ranks), under a minute
    python -m bench.scale --dp 8 16 32 64 128 --no-load   # the curves of docs/SCALE.md

No process is started and no byte of tensor data exists: every rank's state is built on
meta tensors by the real rules and ZeRO code (``bench/scale_model.py``), then driven
through the same functions ``save`` and ``load`` use: ``collect`` (what each rank
writes: replica ownership), ``data_file_layout``, ``rank_report``/``rank_message``
(what each rank sends to rank 0), ``manifest_document`` (rank 0's commit work: every
message -> checked, sealed ``manifest.json``), ``Manifest.from_json`` and ``plan_fill``
(each target rank's load plan). Prints only; see docs/SCALE.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import struct
import time
import tracemalloc
from typing import Any

from unickpt.engine.gc_pause import gc_paused
from unickpt.engine.replicated import shared_parts
from unickpt.engine.items import sharded_item
from unickpt.engine.tensor_reads import plan_fill
from unickpt.engine.assemble import manifest_document
from unickpt.engine.commit import rank_message
from unickpt.engine.state import Sharded, flatten
from unickpt.format.dtypes import itemsize
from unickpt.format.index import INDEX_NAME
from unickpt.format.manifest import DEFAULT_BLOCK_BYTES, MANIFEST_NAME, Manifest
from unickpt.format.rank_message import FragmentRecord
from unickpt.rules.coords import Coords

from .scale_model import LLAMA_405B, ModelSpec, rank_state, simulated_message

TARGETS = {"commit_s": 1.0, "commit_bytes": 1 << 30, "plan_s": 1.0, "plan_bytes": 200 << 20, "read_over": 0.01}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measured(fn, memory: bool = True) -> tuple[Any, float, int]:
    """``fn()``'s result, its CPU time (what it costs on a core of its own: no I/O is
    involved, and wall time on a shared machine measures the other jobs), and its peak
    of Python allocations (tracemalloc, in a second run when ``memory``: tracing slows the
    first). Run with the cyclic garbage collector paused, as ``save`` and ``load`` run."""
    gc.collect()
    t0 = time.process_time()
    with gc_paused():
        out = fn()
    dt = time.process_time() - t0
    peak = 0
    if memory:
        del out
        gc.collect()
        tracemalloc.start()
        with gc_paused():
            out = fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out, dt, peak


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _ratio(got: float, target: float) -> str:
    return f"{got / target:.2f}x of target ({'ok' if got < target else 'MISSES'})"


def simulate_save(
    spec: ModelSpec, tp: int, pp: int, dp: int, block_bytes: int = DEFAULT_BLOCK_BYTES, indexed: bool | None = None,
    cache: str | None = None,
) -> dict[str, Any]:
    """Every rank's commit message and written bytes, then rank 0's commit work."""
    rules = spec.rules()
    world = tp * pp * dp
    t0 = time.perf_counter()
    cached = os.path.join(cache, f"messages-tp{tp}-pp{pp}-dp{dp}-block{block_bytes}.bin") if cache else None
    if cached and os.path.exists(cached):
        messages, written = _read_messages(cached)
    else:
        messages, written = [], []
        for r in range(world):
            c = Coords.from_rank(r, tp=tp, pp=pp, dp=dp)
            msg, data = simulated_message(spec, rules, c, r, world, block_bytes)
            messages.append(msg)
            written.append(data)
        if cached:
            _write_messages(cached, messages, written)
    build = time.perf_counter() - t0
    metadata = {"layout": rules.metadata(Coords(tp=tp, pp=pp, dp=dp), zero={"stage": 1})}
    docs, commit_s, commit_peak = _measured(lambda: manifest_document(messages, world, metadata, indexed))
    groups: dict[tuple[int, int], list[int]] = {}  # replicas of the same model shards: same tp and pp rank
    for r, w in enumerate(written):
        c = Coords.from_rank(r, tp=tp, pp=pp, dp=dp)
        groups.setdefault((c.tp_rank, c.pp_rank), []).append(w)
    return {
        "world": world, "messages": [len(m) for m in messages], "written": written, "build_s": build,
        "docs": docs, "commit_s": commit_s, "commit_peak": commit_peak, "gathered": world * max(len(m) for m in messages),
        "group_balance": max(max(g) / statistics.fmean(g) for g in groups.values()),
        "snapshot": snapshot_manifest(messages, world, metadata, docs) if INDEX_NAME in docs else None,
    }


def snapshot_manifest(messages: list[bytes], world: int, metadata: dict[str, Any], docs: dict[str, bytes],
                      per_node: int = 8, parity: int = 1) -> dict[str, Any]:
    """The same save as an in-memory snapshot on ``world / per_node`` nodes: the bytes of
    manifest each node keeps in the index form (``snapshot.client.index_parts``: the root,
    its part of the index and a copy of ``parity`` neighbours' parts; node 0 the whole
    index) against the one 1.1 document every node kept before, and rank 0's added work
    (cutting the index into the parts it scatters)."""
    from types import SimpleNamespace

    from unickpt.snapshot.client import index_parts

    nodes = world // per_node
    rows = [SimpleNamespace(node=r // per_node, has_keeper=r % per_node == 0) for r in range(world)]
    parts = index_parts(rows, nodes, parity)  # type: ignore[arg-type]
    t0 = time.process_time()
    payloads = parts.payloads(docs[INDEX_NAME])
    cut_s = time.process_time() - t0
    kept = [len(p) - len(p.partition(b"\n")[0]) - 1 for p in payloads if p]
    single = len(manifest_document(messages, world, metadata, False)[MANIFEST_NAME])
    return {"nodes": nodes, "root": len(docs[MANIFEST_NAME]), "index": len(docs[INDEX_NAME]), "kept": kept,
            "single": single, "cut_s": cut_s, "parity": parity}


def _write_messages(path: str, messages: list[bytes], written: list[int]) -> None:
    """Keep the simulated ranks' messages (and bytes written) for a later run: each as
    its bytes written, its length and its bytes (little-endian 64-bit integers)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        for m, w in zip(messages, written):
            f.write(struct.pack("<QQ", w, len(m)))
            f.write(m)
    os.replace(path + ".tmp", path)


def legacy_message(message: bytes) -> bytes:
    """A message of the JSON form ranks sent before the binary one (a ``--cache`` kept
    from then: one JSON line, then the fragments' texts) in today's form, exactly as
    ``rank_message`` builds it from the same payload (the checks' keys were hex there)."""
    line, _, tail = message.partition(b"\n")
    payload = json.loads(line)
    frags = []
    for name, d in payload.get("fragments", {}).items():
        a, n = d["fragment"]
        frags.append(FragmentRecord(name, d["shape"], d["dtype"], d["layout"], tail[a : a + n], d["volume"],
                                    int(d["boxes"], 16), int(d["crcs"], 16), tuple(d["bbox"])))
    return rank_message(dict(payload, fragments=frags))


def _read_messages(path: str) -> tuple[list[bytes], list[int]]:
    with open(path, "rb") as f:
        raw = f.read()
    messages, written, at = [], [], 0
    while at < len(raw):
        w, n = struct.unpack_from("<QQ", raw, at)
        m = raw[at + 16 : at + 16 + n]
        messages.append(legacy_message(m) if m[:1] == b"{" else m)
        written.append(w)
        at += 16 + n
    return messages, written


def _sample(tp: int, pp: int, dp: int, n: int) -> list[Coords]:
    """Target ranks to plan: every pipeline stage, first/last tp rank, first/middle/last dp rank."""
    picks = []
    for p in range(pp):
        for t in sorted({0, tp - 1}):
            for d in sorted({0, dp // 2, dp - 1}):
                picks.append(Coords(tp=tp, tp_rank=t, pp=pp, pp_rank=p, dp=dp, dp_rank=d))
    if n and len(picks) > n:
        step = len(picks) / n
        picks = [picks[int(i * step)] for i in range(n)]
    return picks


def plan_rank(state: dict[str, Any], docs: dict[str, bytes], share: int | None = None) -> dict[str, Any]:
    """One target rank's load plan, as ``load`` makes it: parse the manifest (the root
    only, when indexed, then the index lines of the tensors it fills), plan every tensor.
    Returns bytes needed, bytes read, files opened, index bytes parsed, and the bytes read
    with ``broadcast_replicated=True`` when this rank is replica ``share`` of its shards."""
    index = docs.get(INDEX_NAME, b"")
    lines = [0]

    def read_range(at: int, n: int) -> bytes:
        lines[0] += n
        return index[at : at + n]

    manifest = Manifest.from_json(docs[MANIFEST_NAME], index=read_range)
    need = read = 0
    files: set[str] = set()
    holders: set[str] = set()
    line = []
    for leaf in flatten(state):
        v = leaf.value
        if not isinstance(v, Sharded):
            continue
        entry = manifest.tensors[leaf.name]
        item = sharded_item(leaf.name, v)
        _, sources, plan = plan_fill(entry, item.pieces)
        size = itemsize(entry.dtype)
        need += sum(p.global_box.volume for p in item.pieces) * size
        read += sum(sp.stop - sp.start for sp in plan.spans)
        files.update(sp.file for sp in plan.spans)
        for s in sources:  # files that hold some element this rank needs
            if any(_touches(p, s.pieces) for p in item.pieces):
                holders.add(s.file)
        if item.replicas > 1:
            line.append((entry, item))
    shared = read  # with broadcast_replicated=True: this replica's share of the replicated shards
    if line and share is not None:
        line.sort(key=lambda ei: (ei[1].name, ei[1].shard_key))
        shared -= sum(sum(sp.stop - sp.start for sp in plan_fill(e, i.pieces)[2].spans) for e, i in line)
        shared += sum(sum(sp.stop - sp.start for sp in plan_fill(e, i.pieces)[2].spans)
                      for e, i in shared_parts(line, line[0][1].replicas, share))
    return {"need": need, "read": read, "files": len(files), "extra_files": len(files - holders), "index_read": lines[0],
            "shared": shared}


def _touches(target, pieces) -> bool:
    from unickpt.plan.box import intersect

    return any(intersect(target.global_box, s.global_box) is not None for s in pieces)


def simulate_load(spec: ModelSpec, docs: dict[str, bytes], tp: int, pp: int, dp: int, sample: int, traced: int) -> dict[str, Any]:
    """Each sampled target rank: parse the manifest and plan its reads (a fresh parse per
    rank: each rank is its own process). The rank's state (what it loads into) is built
    first, outside the measurement. Memory is traced for the first ``traced`` ranks."""
    rows = []
    rules = spec.rules()
    for k, c in enumerate(_sample(tp, pp, dp, sample)):
        state = rank_state(spec, rules, c, "load")
        got, plan_s, plan_peak = _measured(lambda: plan_rank(state, docs), memory=k < traced)
        got.update(plan_s=plan_s, plan_peak=plan_peak, rank=c.rank(), shared=plan_rank(state, docs, c.dp_rank)["shared"])
        rows.append(got)
    return {"rows": rows, "world": tp * pp * dp, "rss": _rss(), "traced": min(traced, len(rows))}


def report_save(s: dict[str, Any], tp: int, pp: int, dp: int) -> None:
    """Print the save side."""
    msgs, written = s["messages"], s["written"]
    mean = statistics.fmean(written)
    print(f"source TP{tp} x PP{pp} x DP{dp} ZeRO-1: {s['world']} ranks, {sum(written) / 1e12:.2f} TB written "
          f"(simulated in {s['build_s']:.1f} s)")
    print(f"  writes per rank: mean {_mb(mean)}, max {_mb(max(written))} = {max(written) / mean:.3f}x the mean "
          f"(target <= 1.1x: {'ok' if max(written) <= 1.1 * mean else 'MISSES'}), min {_mb(min(written))}, "
          f"{sum(1 for w in written if w == 0)} ranks write nothing")
    print(f"  message to rank 0 per rank: min {min(msgs)} B, mean {statistics.fmean(msgs):.0f} B, max {max(msgs)} B; "
          f"rank 0 receives {_mb(sum(msgs))} ({_mb(s['gathered'])} with gather_bytes' padding to the longest)")
    docs = s["docs"]
    kind = "indexed (2.0)" if INDEX_NAME in docs else "one document (1.1)"
    print(f"  manifest on disk, {kind}: manifest.json {_mb(len(docs[MANIFEST_NAME]))}"
          + (f" + {INDEX_NAME} {_mb(len(docs[INDEX_NAME]))}" if INDEX_NAME in docs else ""))
    snap = s.get("snapshot")
    if snap:
        root, mean = snap["root"], statistics.fmean(snap["kept"])
        print(f"  as an in-memory snapshot on {snap['nodes']} nodes (parity {snap['parity']}): each node keeps the root "
              f"{_mb(root)} + {min(snap['kept']) / 1e3:.1f} .. {max(snap['kept']) / 1e3:.1f} KB of index parts = {_mb(root + mean)} "
              f"on average (node 0: {_mb(root + snap['index'])}, the whole index), against {_mb(snap['single'])} for the "
              f"one 1.1 document every node kept before: {(root + mean) / snap['single']:.3f}x; rank 0 cuts the parts in "
              f"{snap['cut_s']:.3f} s of CPU")
    print(f"  model replicas (same tp and pp rank): the most-loaded writer is {s['group_balance']:.3f}x its group's mean "
          "(the rest of the spread is pipeline stages of 7 and 8 layers, and the embeddings)")
    print(f"  commit work on rank 0 (manifest_document: parse every message, assemble, check, serialise, seal): "
          f"{s['commit_s']:.2f} s of CPU [{_ratio(s['commit_s'], TARGETS['commit_s'])}], "
          f"peak {_mb(s['commit_peak'])} of Python allocations [{_ratio(s['commit_peak'], TARGETS['commit_bytes'])}]")


def report_load(lo: dict[str, Any], tp: int, pp: int, dp: int) -> None:
    """Print the load side."""
    rows = lo["rows"]
    plan = [r["plan_s"] for r in rows]
    peak = [r["plan_peak"] for r in rows]
    over = [r["read"] / r["need"] - 1 for r in rows]
    files = [r["files"] for r in rows]
    print(f"target TP{tp} x PP{pp} x DP{dp} ZeRO-1: {lo['world']} ranks; {len(rows)} sampled ranks planned "
          f"(every stage; tp first/last; dp first/middle/last)")
    total_s, total_b = max(plan), max(peak)
    what = "the root manifest + the index lines of its tensors" if rows[0]["index_read"] else "the whole manifest"
    print(f"  per-rank load plan (parse {what}, "
          f"plan every tensor): CPU median {statistics.median(plan):.3f} s, worst {total_s:.3f} s "
          f"(rank {max(rows, key=lambda r: r['plan_s'])['rank']}) "
          f"[{_ratio(total_s, TARGETS['plan_s'])}]; peak {_mb(total_b)} of Python allocations (traced on {lo['traced']}) "
          f"[{_ratio(total_b, TARGETS['plan_bytes'])}]"
          + (f"; index read per rank {_mb(max(r['index_read'] for r in rows))} at most" if rows[0]["index_read"] else ""))
    print(f"  bytes read over bytes needed: median +{statistics.median(over) * 100:.3f}%, worst +{max(over) * 100:.3f}% "
          f"(target within 1%: {'ok' if max(over) <= TARGETS['read_over'] else 'MISSES'}); "
          f"needed per rank {_mb(min(r['need'] for r in rows))} .. {_mb(max(r['need'] for r in rows))}")
    shared = [r["shared"] for r in rows]
    print(f"  with broadcast_replicated=True (each replica reads its share of the replicated shards, then they broadcast): "
          f"read per rank {_mb(min(shared))} .. {_mb(max(shared))}, {sum(shared) / sum(r['read'] for r in rows):.3f} of the "
          "bytes read without")
    print(f"  source files opened per rank: min {min(files)}, median {statistics.median(files):.0f}, max {max(files)}; "
          f"files opened holding none of the rank's bytes: {sum(r['extra_files'] for r in rows)} "
          f"(target 0: {'ok' if not any(r['extra_files'] for r in rows) else 'MISSES'})")


def main(argv: list[str] | None = None) -> None:
    """Run and print."""
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1/16 the ranks (DP8 -> DP6): under a minute")
    ap.add_argument("--dp", type=int, nargs="*", help="source dp degrees to run (a curve); default 128 (8 with --quick)")
    ap.add_argument("--target-dp", type=int, default=None, help="target dp degree (default 3/4 of the source's)")
    ap.add_argument("--sample", type=int, default=0, help="target ranks to plan (default 48, 16 with --quick)")
    ap.add_argument("--no-load", action="store_true", help="the save side only")
    ap.add_argument("--format", choices=("auto", "indexed", "single"), default="auto",
                    help="manifest form: as save chooses (auto), indexed 2.0, or one 1.1 document (the design before)")
    ap.add_argument("--cache", default=None, help="a directory keeping the simulated ranks' messages between runs "
                    "(only the commit and the loads are redone; delete it after changing what ranks send)")
    ap.add_argument("--block-kib", type=int, default=DEFAULT_BLOCK_BYTES >> 10, help="checksum block size (KiB)")
    args = ap.parse_args(argv)
    spec = LLAMA_405B
    print(f"model: Llama-3-405B-shaped, {spec.layers} layers, hidden {spec.hidden}, heads {spec.heads}/{spec.kv_heads}, "
          f"vocab {spec.vocab}, ffn {spec.ffn}: {spec.parameters / 1e9:.1f} B parameters, "
          f"{spec.parameters * 14 / 1e12:.2f} TB at 14 bytes a parameter")
    for dp in args.dp or [8 if args.quick else 128]:
        s = simulate_save(spec, 8, 16, dp, args.block_kib << 10, {"auto": None, "indexed": True, "single": False}[args.format],
                          args.cache)
        report_save(s, 8, 16, dp)
        if not args.no_load:
            tdp = args.target_dp or max(1, dp * 3 // 4)
            lo = simulate_load(spec, s["docs"], 8, 8, tdp, args.sample or (16 if args.quick else 48), 4 if args.quick else 12)
            report_load(lo, 8, 8, tdp)
        del s
        gc.collect()


if __name__ == "__main__":
    main()
