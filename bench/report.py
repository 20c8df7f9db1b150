"""Turning the benchmark's measurements into Markdown tables with ratios and targets."""

from __future__ import annotations

import os

from .state import GiB, MiB


def _size(n: int) -> str:
    return f"{n / GiB:g} GiB" if n >= GiB else f"{n / MiB:g} MiB"


def _x(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _pick(rows: list[dict], **kw) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def _of_disk(row: dict, disk_r: float) -> str:
    """A load's speed as a share of the disk's cold read speed."""
    return f"{100 * row['bytes'] / 1e9 / row['load_s'] / disk_r:.0f}%" if row.get("load_s") else ""


def render(rows: list[dict], limits: dict, ctx: dict) -> str:
    """The Markdown report of one run."""
    disk_w = max(limits[k] for k in ("write_fsync_1", "write_fsync_4_writeback", "write_fsync_4files"))
    disk_r = max(limits[k] for k in ("read_cold_1", "read_cold_4", "read_cold_4files"))
    cold = all(r.get("cold", True) for r in rows) and limits["cold"] == 1.0
    out = [
        f"Run: `{ctx['command']}` on {ctx['date']}, {ctx['minutes']:.1f} min; {ctx['cpus']} CPUs, "
        f"{ctx['mem_gib']:.0f} GiB RAM; torch {ctx['torch']}, Python {ctx['python']}.",
        f"Load average before / after: {ctx['load_before'][0]:.2f} / {ctx['load_after'][0]:.2f} "
        "(other jobs shared the machine when this is well above 0).",
        "Reads are " + ("**cold**: the page cache was dropped between every write and the read after it."
                        if cold else "**warm** (the page cache could not be dropped: not root)."),
        "",
        "**Machine limits** (GB/s, measured in this run)",
        "",
    ]
    out += _table(
        ["write+fsync: 1 stream", "4 threads, early writeback", "4 files", "cold read: 1 stream",
         "4 threads", "4 files", "page-cache read", "memcpy (touched dst)", "memcpy (fresh dst)"],
        [[f"{limits[k]:.2f}" for k in ("write_fsync_1", "write_fsync_4_writeback", "write_fsync_4files", "read_cold_1",
                                        "read_cold_4", "read_cold_4files", "read_warm_4", "memcpy", "memcpy_fresh")]],
    )
    out += ["", f"Disk bandwidth used below: the best of these, {disk_w:.2f} GB/s write and {disk_r:.2f} GB/s cold read."]
    out += ["", "**Sync save and load** (GB/s of the whole state; best of the repetitions; save includes fsync)", ""]
    body = []
    for r in [r for r in rows if r["kind"] == "sync" and r["lib"] == "unickpt"]:
        d = _pick(rows, kind="sync", lib="dcp", world=r["world"], bytes=r["bytes"]) or {}
        body.append([
            str(r["world"]), _size(r["bytes"]),
            f"{r['save_gbs']:.2f}", f"{d.get('save_gbs', 0):.2f}", _x(r["save_gbs"], d.get("save_gbs")),
            f"{100 * r['save_gbs'] / disk_w:.0f}%",
            f"{r['load_gbs']:.2f}", f"{d.get('load_gbs', 0):.2f}", _x(r["load_gbs"], d.get("load_gbs")),
            f"{100 * r['load_gbs'] / disk_r:.0f}%",
        ])
    out += _table(["ranks", "state", "unickpt save", "DCP save", "ratio", "of disk write", "unickpt load",
                   "DCP load", "ratio", "of disk read"], body)
    out += ["", "**Training stall per save**, 4 ranks (seconds the training loop is blocked, slowest rank; "
            "steady = median after the first save)", ""]
    body = []
    for b in [r for r in rows if r["kind"] == "memcpy_bound"]:
        u = _pick(rows, kind="stall", mode="unickpt", bytes=b["bytes"]) or {}
        for mode in ("unickpt", "unickpt_lazy", "dcp_thread", "dcp_thread_cached", "dcp_process"):
            s = _pick(rows, kind="stall", mode=mode, bytes=b["bytes"]) or {}
            if "error" in s:
                why = "n/a: pins memory, needs an accelerator" if "accelerator" in s["error"] else "failed: " + s["error"][:60]
                body.append([_size(b["bytes"]), mode, why, "", "", ""])
                continue
            body.append([
                _size(b["bytes"]), mode, f"{s.get('first_s', 0):.3f}", f"{s.get('steady_s', 0):.3f}",
                _x(s.get("steady_s"), b["seconds"]),
                "" if mode.startswith("unickpt") else _x(s.get("steady_s"), u.get("steady_s")),
            ])
        body.append([_size(b["bytes"]), f"memcpy of the rank's {_size(b['rank_bytes'])}", "", f"{b['seconds']:.3f}", "1.00x", ""])
    out += _table(["state", "mode", "first", "steady", "vs memcpy", "vs unickpt"], body)
    out += ["", "**Resharded load**: saved by 4 ranks (all Shard(0)), loaded by 2 ranks with weights Shard(1) and "
            "vectors replicated; both read every byte of the checkpoint once from the disk (each row holds "
            "columns of both ranks), so the disk's cold read speed is the floor", ""]
    body = []
    for r in [r for r in rows if r["kind"] == "reshard" and r["lib"] == "unickpt"]:
        d = _pick(rows, kind="reshard", lib="dcp", bytes=r["bytes"]) or {}
        body.append([_size(r["bytes"]), f"{r['load_s']:.2f} s", _of_disk(r, disk_r), f"{d.get('load_s', 0):.2f} s", _of_disk(d, disk_r),
                     _x(d.get("load_s"), r["load_s"])])
    out += _table(["state", "unickpt", "of disk read", "DCP", "of disk read", "unickpt faster by"], body)
    out += ["", "**Replicated tensors on load**, 4 ranks, plain tensors every rank needs whole", ""]
    body = [[_size(r["bytes"]), r["cache"], r["mode"], f"{r['load_s']:.2f} s"] for r in rows if r["kind"] == "replicated"]
    out += _table(["state", "cache", "mode", "time"], body)
    out += ["", "**Targets**", ""] + _targets(rows, disk_w, disk_r)
    return "\n".join(out)


def _targets(rows: list[dict], disk_w: float, disk_r: float) -> list[str]:
    lines = []
    big = max((r["bytes"] for r in rows if r["kind"] == "sync"), default=0)
    for r in [r for r in rows if r["kind"] == "sync" and r["lib"] == "unickpt"]:
        d = _pick(rows, kind="sync", lib="dcp", world=r["world"], bytes=r["bytes"])
        if not d:
            continue
        for what, disk in (("save", disk_w), ("load", disk_r)):
            ratio = r[f"{what}_gbs"] / d[f"{what}_gbs"]
            frac = r[f"{what}_gbs"] / disk
            ok = ratio >= 1.5 and (frac >= 0.8 or r["bytes"] < big)
            lines.append(f"- sync {what}, {r['world']} rank(s), {_size(r['bytes'])}: {ratio:.2f}x DCP (target 1.5x), "
                         f"{100 * frac:.0f}% of the disk (target 80%): **{'met' if ok else 'not met'}**")
    for b in [r for r in rows if r["kind"] == "memcpy_bound"]:
        u = _pick(rows, kind="stall", mode="unickpt", bytes=b["bytes"]) or {}
        d = _pick(rows, kind="stall", mode="dcp_thread", bytes=b["bytes"]) or {}
        if u.get("steady_s") and d.get("steady_s"):
            vs_mem, vs_dcp = u["steady_s"] / b["seconds"], d["steady_s"] / u["steady_s"]
            ok = vs_mem <= 1.2 and vs_dcp >= 3
            lines.append(f"- async stall, {_size(b['bytes'])}: {vs_mem:.2f}x memcpy (target <= 1.2x), {vs_dcp:.1f}x lower than "
                         f"DCP async_save (target >= 3x): **{'met' if ok else 'not met'}**")
            lazy = _pick(rows, kind="stall", mode="unickpt_lazy", bytes=b["bytes"]) or {}
            if lazy.get("steady_s"):
                vs_dcp = d["steady_s"] / lazy["steady_s"]
                lines.append(f"- async stall with `lazy=True`, {_size(b['bytes'])}: {vs_dcp:.0f}x lower than DCP async_save "
                             f"(target >= 3x): **{'met' if vs_dcp >= 3 else 'not met'}**")
    for r in [r for r in rows if r["kind"] == "reshard" and r["lib"] == "unickpt"]:
        d = _pick(rows, kind="reshard", lib="dcp", bytes=r["bytes"])
        if d:
            ratio = d["load_s"] / r["load_s"]
            lines.append(f"- resharded load, {_size(r['bytes'])}: {ratio:.2f}x faster than DCP (target 1.5x): "
                         f"**{'met' if ratio >= 1.5 else 'not met'}**")
    return lines


def write_into(doc: str, text: str, mode: str) -> None:
    """Put ``text`` between this mode's markers in ``doc`` (appended when absent)."""
    begin, end = f"<!-- bench:{mode}:begin -->", f"<!-- bench:{mode}:end -->"
    old = open(doc).read() if os.path.exists(doc) else "# Performance\n"
    block = f"{begin}\n{text}\n{end}"
    if begin in old and end in old:
        new = old[: old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    with open(doc, "w") as f:
        f.write(new)
