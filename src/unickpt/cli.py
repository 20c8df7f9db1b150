"""The ``unickpt`` command line: ``inspect``, ``verify``, ``demo`` and more.

Each command is a thin layer over the library (``unickpt.read_manifest``,
``unickpt.verify``, ``unickpt.demo``). Errors unickpt raises on purpose (every
``UnickptError``) are printed as one red ``error: ...`` line with exit code 2; exit code
1 means "ran fine, and the answer is no" (a corrupt checkpoint, a failed demo check).

Each command is a function here, registered with ``@app.command`` and wrapped in
``@_errors``: ``inspect``, ``verify``, ``convert``, ``export``, ``store``, ``snapshots``,
``demo``; ``launch`` comes from :mod:`unickpt.live.launch_cli`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
import typer.exceptions
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .version import __version__
from .errors import UnickptError, os_error_text
from .live import launch_cli
from .units import counted, human_bytes

if TYPE_CHECKING:
    from .format.ledger import Ledger

app = typer.Typer(
    name="unickpt",
    help="Universal checkpoints for distributed PyTorch: inspect, verify, convert, export; launch, store, snapshots (live recovery); demo.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2

F = TypeVar("F", bound=Callable[..., Any])


# Columns when the output is not a terminal: a pipe or a file has no width to fit, and
# rich would otherwise assume 80 columns and fold long tensor names.
NO_WRAP_WIDTH = 1 << 16


def _console(stderr: bool = False) -> Console:
    # Created per use so it writes to whatever sys.stdout is now (tests swap it).
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console.width = NO_WRAP_WIDTH
    return console


def _out() -> Console:
    return _console()


def _err() -> Console:
    return _console(stderr=True)


def _fail(message: str) -> typer.Exit:
    _err().print(Text(f"error: {message}", style="bold red"), soft_wrap=True)
    return typer.Exit(EXIT_ERROR)


def _errors(fn: F) -> F:
    """Turn unickpt's own errors (and unreadable paths) into ``error: ...`` + exit 2; any
    other exception too (one line naming it, never a traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UnickptError as e:
            raise _fail(str(e)) from None
        except OSError as e:
            raise _fail(f"{os_error_text(e)}: {e.filename}" if e.filename else os_error_text(e)) from None
        except (typer.Exit, typer.Abort, typer.exceptions.TyperException):  # typer's own exits and usage errors
            raise
        except Exception as e:  # last resort: bad input must never end in a traceback
            raise _fail(f"unexpected {type(e).__name__} ({e}); this is a bug in unickpt, please report it") from None

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"unickpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Universal checkpoints for distributed PyTorch: inspect, verify, convert, export; launch, store, snapshots (live recovery); demo."""


# ---------------------------------------------------------------- helpers


def _short_repr(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _shape(shape: tuple[int, ...] | list[int]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _tensor_count(manifest: Any) -> str:
    """``"156 tensors"``, or ``"156 tensors + 1 per-rank tensor"``: the same count as
    ``inspect``'s totals (global tensors), per-rank tensors (one per name) named apart."""
    text = counted(len(manifest.tensors), "tensor")
    if manifest.rank_tensors:
        text += f" + {counted(len(manifest.rank_tensors), 'per-rank tensor')}"
    return text


def _summary(path: str) -> tuple[dict[str, Any], Ledger]:
    """Everything ``inspect`` shows, as JSON-ready data, and the checkpoint's ledger."""
    from .adapters.checkpoint import open_checkpoint
    from .adapters.regions import source_ledger
    from .format.dtypes import itemsize
    from .format.values import decode_value

    with open_checkpoint(path, bases=False) as ckpt:  # an incremental checkpoint is shown even when a base is gone
        m = ckpt.manifest
        ledger = source_ledger(ckpt)
        file_problems = _file_problems(ckpt.storage, m.files)
    tensors = []
    for t in m.tensors.values():
        stored = sum(prod(f.shape) for f in t.fragments) * itemsize(t.dtype)
        tensors.append({
            "name": t.name, "shape": list(t.shape), "dtype": t.dtype, "nbytes": t.nbytes,
            "stored_bytes": stored, "fragments": len(t.fragments), "layout": t.layout,
        })
    values = []
    for name, enc in m.values.items():
        v = decode_value(enc)
        values.append({"name": name, "type": type(v).__name__, "repr": _short_repr(v), "value": enc})
    per_rank = []
    for name, row in m.rank_values.items():
        decoded = [decode_value(v) for v in row]
        types = sorted({type(v).__name__ for v in decoded})
        per_rank.append({
            "name": name, "kind": "value", "ranks": len(row), "type": "/".join(types),
            "repr": _short_repr(decoded[0]) if decoded else "", "values": row,
        })
    for name, entries in m.rank_tensors.items():
        present = [e for e in entries if e is not None]
        shapes = sorted({tuple(e.shape) for e in present})
        dtypes = sorted({e.dtype for e in present})
        per_rank.append({
            "name": name, "kind": "tensor", "ranks": len(present), "type": "/".join(dtypes),
            "repr": " ".join(_shape(s) for s in shapes[:3]) + (" ..." if len(shapes) > 3 else ""),
            "shapes": [None if e is None else list(e.shape) for e in entries],
            "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
            "nbytes": sum(e.nbytes for e in present),
            "fragments": sum(len(e.fragments) for e in present),
        })
    n_frag = sum(t["fragments"] for t in tensors) + sum(p.get("fragments", 0) for p in per_rank)
    return {
        "path": str(path),
        "format": m.provenance.get("format", "unickpt"),
        "format_version": f"{m.version[0]}.{m.version[1]}",
        "world_size": m.world_size,
        "provenance": m.provenance,
        "metadata": m.metadata,
        "files": m.files,
        "tensors": tensors,
        "values": values,
        "per_rank": per_rank,
        "totals": {
            "tensors": len(tensors),
            "tensor_bytes": sum(t["nbytes"] for t in tensors),
            "stored_bytes": sum(t["stored_bytes"] for t in tensors) + sum(p.get("nbytes", 0) for p in per_rank),
            "values": len(values),
            "per_rank": len(per_rank),
            "files": len(m.files),
            "file_bytes": sum(m.files.values()),
            "fragments": n_frag,
        },
        "ledger": ledger.to_json(),
        "file_problems": file_problems,
        **_incremental_summary(path, m),
    }, ledger


def _file_problems(storage: Any, files: dict[str, int]) -> dict[str, str]:
    """The checkpoint's own files (not its bases') that are missing or not of the size its
    manifest gives: one stat each, no byte read (``verify`` reads them)."""
    from .format.refs import split_key

    problems: dict[str, str] = {}
    for key, size in files.items():
        if split_key(key)[0] is not None:
            continue
        try:
            got = storage.size(key)
        except Exception:  # missing, or unreadable: said, never a traceback
            problems[key] = "missing"
            continue
        if got != size:
            problems[key] = f"holds {got} bytes, the manifest says {size}"
    return problems


def _incremental_summary(path: str, m: Any) -> dict[str, Any]:
    """``{"incremental": ...}`` for a checkpoint that references bases: bytes written in
    its own files against bytes referenced, its bases (holders) and the chain it was saved
    against; empty for a self-contained checkpoint."""
    if not m.bases and m.incremental is None:
        return {}
    from .api.incremental import chain, stored_bytes
    from .engine.bases import base_problems

    written, referenced = stored_bytes(m)
    broken = dict(base_problems(path, m))
    return {"incremental": {
        "bytes_written": written, "bytes_referenced": referenced,
        "bases": {b: ("missing or replaced" if b in broken else "ok") for b in sorted(m.bases)},
        "chain": [{"base": b, "state": st} for b, st in chain(path)],
        "depth": (m.incremental or {}).get("depth", 0),
    }}


def _print_incremental(inc: dict[str, Any]) -> None:
    """The incremental lines of ``inspect``: written vs referenced, bases, chain."""
    out = _out()
    w, r = inc["bytes_written"], inc["bytes_referenced"]
    share = f" ({100 * w / (w + r):.1f}% written)" if w + r else ""
    out.print(f"[bold]incremental[/]: {human_bytes(w)} written ({w} bytes), {human_bytes(r)} referenced ({r} bytes)"
              f"{share}, {counted(len(inc['bases']), 'base')}", soft_wrap=True)
    for b, state in inc["bases"].items():
        out.print(Text(f"  base {b}: {state}", style="" if state == "ok" else "bold red"), soft_wrap=True)
    links = " <- ".join(f"{c['base']}" + ("" if c["state"] == "ok" else f" ({c['state']})") for c in inc["chain"])
    out.print(escape(f"chain of bases (depth {inc['depth']}): {links or '(none)'}"), soft_wrap=True)


def _print_ledger(ledger: Ledger) -> None:
    """The ledger's totals in one line, then each skipped item and unaccounted range. On a
    terminal the line names a few items of each kind (``... and 112 more``); to a pipe or a
    file it names every one, as the output there is never cut."""
    out = _out()
    line = ledger.line() if out.is_terminal else ledger.line(names=None)
    out.print(Text(f"source: {line}", style="yellow" if not ledger.complete else ""), soft_wrap=True)
    for name, reason in ledger.skipped.items():
        out.print(Text(f"  skipped {name}: {reason}", style="yellow"), soft_wrap=True)
    for r in ledger.unaccounted:
        out.print(Text(f"  neither read nor reported: {r}", style="red"), soft_wrap=True)


def _refuse_incomplete(ledger: Ledger, allow_skip: bool, what: str) -> None:
    """Exit 1 before writing anything when the source has skipped or unaccounted data,
    unless ``--allow-skip``: no command prints OK while data is dropped."""
    if ledger.complete or allow_skip:
        return
    _print_ledger(ledger)
    _err().print(Text(f"nothing {what}: the source holds data that would be left out (listed above); "
                      "pass --allow-skip to go on without it", style="bold red"), soft_wrap=True)
    raise typer.Exit(EXIT_FAILED)


_ALLOW_SKIP_HELP = "Go on when the source holds data unickpt does not read (it is listed, then left out)."


def _print_warnings(warnings: list[str]) -> None:
    """One ``warning: ...`` line per warning of a report (stdout, with the report)."""
    out = _out()
    for w in warnings:
        out.print(Text(f"warning: {w}", style="yellow"), soft_wrap=True)


def ledger_warnings(ledger: Ledger) -> list[str]:
    """One warning when ``--allow-skip`` let a command go on without part of its source."""
    if ledger.complete:
        return []
    what = []
    if ledger.skipped:
        what.append(f"{counted(len(ledger.skipped), 'item')} skipped")
    if ledger.unaccounted:
        what.append(f"{human_bytes(ledger.unaccounted_bytes)} neither read nor reported")
    return [f"the source's {' and '.join(what)}, left out as --allow-skip allows (listed below)"]


def _ok(warnings: list[str]) -> str:
    """``"OK"``, or ``"OK with 2 warnings"`` when something was left out as the user allowed."""
    return f"OK with {counted(len(warnings), 'warning')}" if warnings else "OK"


# The library's errors name its keyword arguments; on the command line the flag is meant.
_FLAG_NAMES = {"overwrite=True": "--overwrite"}


def _cli_flag_names(fn: F) -> F:
    """A command whose library errors tell the user to pass a keyword argument
    (``pass overwrite=True``) names the command-line flag instead (``pass --overwrite``)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UnickptError as e:
            message = str(e)
            for keyword, flag in _FLAG_NAMES.items():
                message = message.replace(keyword, flag)
            e.args = (message,)
            raise

    return wrapper  # type: ignore[return-value]


# ---------------------------------------------------------------- inspect


# Locations may be URLs (s3://bucket/run/step_5, any fsspec file system); the command line
# takes their options from the environment, as the file systems read it (AWS_ENDPOINT_URL,
# AWS_ACCESS_KEY_ID, ...; docs: README "Object stores").
_LOCATION_HELP = "Checkpoint directory, or URL (s3://..., gs://..., any fsspec file system; options from the environment)."


@app.command("inspect", short_help="Show tensors, values, totals and the ledger of any checkpoint.")
@_errors
def inspect_cmd(
    path: Annotated[str, typer.Argument(metavar="PATH", help=_LOCATION_HELP, show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")] = False,
) -> None:
    """Show tensors, values, per-rank state, totals, provenance and the ledger (what the
    reader reads, skips and why); exit 1 if bytes of the source are neither read nor reported,
    or a file the manifest lists is missing or not of its size (no tensor byte is read).
    On a CheckpointManager's root: its step_* checkpoints, committed or not, whole or not."""
    from .errors import NotACheckpointError
    from .format.values import decode_value

    try:
        s, ledger = _summary(str(path))
    except NotACheckpointError:
        if not _inspect_root(str(path), as_json):
            raise
        return
    if as_json:
        typer.echo(json.dumps(s, indent=2))
        if not ledger.accounted or s["file_problems"]:
            raise typer.Exit(EXIT_FAILED)
        return
    out = _out()
    out.print(Text(f"checkpoint {s['path']}", style="bold"), soft_wrap=True)
    head = Table.grid(padding=(0, 2))
    head.add_column(style="dim")
    head.add_column()
    head.add_row("format", f"unickpt {s['format_version']}" if s["format"] == "unickpt" else f"{s['format']} (read in place; no checksums)")
    head.add_row("world size", str(s["world_size"]))
    for k, v in s["provenance"].items():
        if k not in ("world_size", "format"):  # both said above
            head.add_row(escape(str(k)), escape(str(v)))
    for k, v in s["metadata"].items():
        v = decode_value(v)
        head.add_row(escape(f"metadata.{k}"), escape(v if isinstance(v, str) else _short_repr(v, 80)))
    out.print(head)

    if s["tensors"]:
        t = Table(title="tensors", title_justify="left")
        for col, just in (("name", "left"), ("shape", "left"), ("dtype", "left"), ("size", "right"),
                          ("frags", "right"), ("saved layout", "left")):
            t.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
        for e in s["tensors"]:
            t.add_row(escape(e["name"]), _shape(e["shape"]), e["dtype"], human_bytes(e["nbytes"]),
                      str(e["fragments"]), escape(e["layout"]))
        out.print(t)
    if s["values"]:
        t = Table(title="values", title_justify="left")
        t.add_column("name", overflow="fold")
        t.add_column("type")
        t.add_column("value")
        for v in s["values"]:
            t.add_row(escape(v["name"]), v["type"], escape(v["repr"]))
        out.print(t)
    if s["per_rank"]:
        t = Table(title="per-rank state", title_justify="left")
        for col in ("name", "kind", "ranks", "type", "rank 0 / shapes", "size"):
            t.add_column(col, overflow="fold")
        for p in s["per_rank"]:
            t.add_row(escape(p["name"]), p["kind"], str(p["ranks"]), escape(p["type"]), escape(p["repr"]),
                      human_bytes(p["nbytes"]) if "nbytes" in p else "")
        out.print(t)
    tot = s["totals"]
    out.print(
        f"[bold]totals[/]: {counted(tot['tensors'], 'tensor')}, {human_bytes(tot['tensor_bytes'])} ({tot['tensor_bytes']} bytes), "
        f"{counted(tot['values'], 'value')}, {counted(tot['per_rank'], 'per-rank entry').replace('entrys', 'entries')}, "
        f"{counted(tot['fragments'], 'fragment')}, {counted(tot['files'], 'file')} ({human_bytes(tot['file_bytes'])})",
        soft_wrap=True,
    )
    if "incremental" in s:
        _print_incremental(s["incremental"])
    _print_ledger(ledger)
    for name, why in s["file_problems"].items():
        out.print(Text(f"file {name}: {why} (`unickpt verify` reads every byte)", style="bold red"), soft_wrap=True)
    if not ledger.accounted or s["file_problems"]:
        raise typer.Exit(EXIT_FAILED)


def _inspect_root(root: str, as_json: bool) -> bool:
    """List the step_* checkpoints of a manager's root; False when it holds none."""
    from .api.tiers import describe_root

    try:
        rows = describe_root(root)
    except (UnickptError, OSError):
        return False
    if not rows:
        return False
    if as_json:
        typer.echo(json.dumps({"root": root, "checkpoints": rows}, indent=2))
        return True
    out = _out()
    whole = [r for r in rows if r["whole"]]
    out.print(Text(f"checkpoints under {root} (a CheckpointManager's root): {len(rows)}, {len(whole)} committed and "
                   "whole", style="bold"), soft_wrap=True)
    t = Table(title_justify="left")
    for col, just in (("checkpoint", "left"), ("committed", "left"), ("whole", "left"), ("files", "right"),
                      ("size", "right"), ("problem", "left")):
        t.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
    for r in rows:
        t.add_row(r["name"], "yes" if r["committed"] else "no", "-" if r["whole"] is None else "yes" if r["whole"] else "no",
                  str(r["files"]), human_bytes(r["bytes"]), escape(r["problem"] or ""))
    out.print(t)
    if whole:
        newest = whole[-1]["name"]
        out.print(f"newest whole: {newest} (sizes checked; every checksum: unickpt verify {root.rstrip('/')}/{newest})",
                  soft_wrap=True)
    return True


# ---------------------------------------------------------------- verify


def _with_byte_progress(label: str, total: int, work: Callable[[Callable[[int], None] | None], Any]) -> Any:
    """Run ``work(progress)`` with a byte progress bar on a terminal (stderr); pipes and
    logs get no bar (``progress`` is then None) and only the result."""
    err = _err()
    if not err.is_terminal:
        return work(None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(binary_units=True),
        TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=True,
    ) as bar:
        task = bar.add_task(label, total=total)
        return work(lambda n: bar.advance(task, n))


@app.command("verify", short_help="Re-check every checksum and file size; exit 1 on corruption.")
@_errors
def verify_cmd(
    path: Annotated[str, typer.Argument(metavar="PATH", help=_LOCATION_HELP, show_default=False)],
    threads: Annotated[int, typer.Option(min=1, help="Parallel reads.")] = 4,
    limit: Annotated[int, typer.Option(min=0, help="Problems to list at most (0: all).")] = 50,
    allow_skip: Annotated[bool, typer.Option("--allow-skip", help="Accept a source holding items unickpt does not read (listed).")] = False,
) -> None:
    """Re-check every checksum and file size; exit 1 if anything is corrupt, or the source
    holds anything unickpt does not read (unless --allow-skip)."""
    from .adapters.checkpoint import open_checkpoint
    from .api.verify import total_bytes, verify

    with open_checkpoint(str(path), bases=False) as ckpt:  # a missing base is reported as a problem
        manifest = ckpt.manifest
        total = total_bytes(manifest)
        t0 = time.perf_counter()
        report = _with_byte_progress("verifying", total, lambda progress: verify(ckpt, progress=progress, threads=threads))
    elapsed = time.perf_counter() - t0
    out = _out()
    tensors = _tensor_count(manifest)
    if report.ok and not report.complete and not allow_skip:
        _print_ledger(report.ledger)
        out.print(Text(f"INCOMPLETE: {counted(len(report.ledger.skipped), 'item')} of {report.path} not read by unickpt "
                       "(listed above; --allow-skip accepts that)", style="bold yellow"), soft_wrap=True)
        raise typer.Exit(EXIT_FAILED)
    if report.ok and report.bytes_unverifiable:
        out.print(Text(f"OK ({report.format}): {tensors}, structure sound; {report.bytes_unverifiable} bytes not "
                       f"verifiable (the format stores no checksums) ({counted(report.files, 'file')}, {elapsed:.2f} s)",
                       style="green"), soft_wrap=True)
        _print_ledger(report.ledger)
        return
    if report.ok:
        out.print(
            Text(f"OK: {tensors}, {report.bytes_checked} bytes verified "
                 f"({human_bytes(report.bytes_checked)} in {counted(report.files, 'file')}, {elapsed:.2f} s)", style="green"),
            soft_wrap=True,
        )
        if report.digest_line:
            out.print(report.digest_line, soft_wrap=True)
        _print_ledger(report.ledger)
        return
    _print_ledger(report.ledger)
    out.print(Text(f"CORRUPT: {len(report.problems)} problem(s) in {report.path}", style="bold red"), soft_wrap=True)
    shown = report.problems if limit == 0 else report.problems[:limit]
    for p in shown:
        out.print(Text(f"  {p}", style="red"), soft_wrap=True)
    if len(shown) < len(report.problems):
        out.print(f"  ... and {len(report.problems) - len(shown)} more (use --limit 0 to list all)")
    out.print(f"{report.bytes_checked} of {report.bytes_total} bytes verified clean", soft_wrap=True)
    if report.digest_line:
        out.print(report.digest_line, soft_wrap=True)
    raise typer.Exit(EXIT_FAILED)


# ---------------------------------------------------------------- convert


@app.command("convert", short_help="Rewrite a checkpoint: to unickpt (--consolidate), PyTorch DCP or DeepSpeed universal.")
@_errors
@_cli_flag_names
def convert_cmd(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Checkpoint to read (unickpt, PyTorch DCP, DeepSpeed, Hugging Face; a URL: unickpt).",
                                       show_default=False)],
    dst: Annotated[str, typer.Argument(metavar="DST", help="Directory or URL of the new checkpoint.", show_default=False)],
    to: Annotated[
        str, typer.Option("--to", help="Output format: unickpt, dcp (PyTorch DCP), deepspeed (DeepSpeed universal checkpoint).")
    ] = "unickpt",
    consolidate: Annotated[
        bool, typer.Option("--consolidate", help="Store every tensor whole, in one fragment (the universal form; "
                                                "--to dcp and --to deepspeed always do).")
    ] = False,
    threads: Annotated[int, typer.Option(min=1, help="Parallel reads and writes.")] = 4,
    buffer_mib: Annotated[int, typer.Option(min=1, help="Read buffer (MiB): memory is bounded by the largest tensor plus this.")] = 64,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a checkpoint already at DST.")] = False,
    allow_skip: Annotated[
        bool, typer.Option("--allow-skip", help="Go on when some of the state is left out: data of the source unickpt "
                           "does not read, or state the output format cannot hold (--to dcp / --to deepspeed: per-rank "
                           "state such as RNG, the metadata; --to deepspeed also anything but parameters and their "
                           "optimizer state); each is listed.")
    ] = False,
) -> None:
    """Rewrite a checkpoint in another form, streaming with bounded memory: a foreign checkpoint
    into unickpt's format, or any checkpoint into PyTorch DCP or DeepSpeed's universal format;
    --consolidate stores one fragment per tensor. State is never dropped silently: when the
    source holds data unickpt does not read, or the output format cannot hold some of the
    state, convert lists it and writes nothing (exit 1) unless --allow-skip."""
    from .adapters.checkpoint import open_checkpoint

    if to not in ("unickpt", "dcp", "deepspeed"):
        raise _fail(f"unknown output format {to!r}: choose unickpt, dcp or deepspeed")
    if to != "unickpt" and _is_remote(dst):
        raise _fail(f"--to {to} writes a local directory; {dst} is a URL (convert to unickpt's format there, or to a local path)")
    with open_checkpoint(str(src)) as ckpt:
        _convert(ckpt, dst, to, consolidate, threads, buffer_mib, overwrite, allow_skip)


def _convert(ckpt: Any, dst: Path, to: str, consolidate: bool, threads: int, buffer_mib: int, overwrite: bool,
             allow_skip: bool) -> None:
    """``convert`` of an open checkpoint: its manifest and ledger are built once, here."""
    from .adapters.regions import source_ledger

    src, source_format, manifest = ckpt.location, ckpt.format, ckpt.manifest
    if to == "unickpt" and source_format == "unickpt" and not consolidate:
        raise _fail("nothing to do: pass --consolidate, or --to dcp / --to deepspeed")
    ledger = source_ledger(ckpt)
    _refuse_incomplete(ledger, allow_skip, "written")
    total = manifest.tensor_bytes()
    if to != "unickpt":
        if to == "dcp":  # the DCP writer imports torch, the DeepSpeed one does not
            from .adapters.dcp_writer import left_out
        else:
            from .adapters.deepspeed_writer import left_out

        dropped = left_out(manifest)
        if dropped and not allow_skip:
            _print_warnings(dropped)
            target = "PyTorch DCP" if to == "dcp" else "DeepSpeed's universal format"
            _out().print(Text(f"NOT CONVERTED: {target} cannot hold all of {src} (listed above); "
                              "nothing was written. Pass --allow-skip to write it without them.",
                              style="bold red"), soft_wrap=True)
            _print_ledger(ledger)
            raise typer.Exit(EXIT_FAILED)
    if to == "unickpt":
        from .api.convert import convert

        kwargs: dict[str, Any] = {"consolidate": True, "threads": threads, "buffer_bytes": buffer_mib << 20, "overwrite": overwrite}
        report = _with_byte_progress("converting", total, lambda progress: convert(ckpt, str(dst), progress=progress, ledger=ledger,
                                                                                       **kwargs))
        what = f"{report.tensors} tensors " + ("consolidated" if source_format == "unickpt" else "imported")
    elif to == "dcp":
        from .adapters.dcp_writer import write_dcp

        report = _with_byte_progress("writing DCP", total, lambda progress: write_dcp(ckpt, str(dst), progress=progress, threads=threads, overwrite=overwrite))
        what = f"{report.tensors} tensors"
    else:
        from .adapters.deepspeed_writer import write_universal

        report = _with_byte_progress(
            "writing DeepSpeed universal", total, lambda progress: write_universal(ckpt, str(dst), progress=progress, threads=threads, overwrite=overwrite)
        )
        what = f"{report.params} parameters"
    warnings = list(getattr(report, "warnings", [])) + ledger_warnings(ledger)
    _print_warnings(warnings)
    _out().print(
        Text(f"{_ok(warnings)}: {what} ({source_format} -> {to}), {human_bytes(report.bytes_written)} written to "
             f"{dst} ({counted(report.files, 'file')}, {report.seconds:.2f} s)", style="yellow" if warnings else "green"),
        soft_wrap=True,
    )
    _print_ledger(ledger)


# ---------------------------------------------------------------- export


@app.command("export", short_help="Export the model as a Hugging Face safetensors folder.")
@_errors
@_cli_flag_names
def export_cmd(
    src: Annotated[str, typer.Argument(metavar="SRC", help=_LOCATION_HELP, show_default=False)],
    dst: Annotated[str, typer.Argument(metavar="DST", help="Folder or URL to write.", show_default=False)],
    fmt: Annotated[str, typer.Option("--format", help="Output format: hf (Hugging Face safetensors).")] = "hf",
    max_shard_size: Annotated[str, typer.Option(help="Largest shard: bytes, or e.g. 500MB, 5GB, 2GiB.")] = "5GB",
    dtype: Annotated[
        str | None, typer.Option(help="Cast floating tensors: bf16, fp16, fp32 or fp64 (default: as saved).", show_default=False)
    ] = None,
    names: Annotated[str, typer.Option(help="Name mapping: auto (the first of llama, mixtral, megatron-llama that every "
                                            "name fits), llama, mixtral, megatron-llama, keep.")] = "auto",
    prefix: Annotated[
        str | None,
        typer.Option(help="Export the tensors named PREFIX... (prefix removed). Default: 'model.', or none for a "
                          "checkpoint converted from Hugging Face (all its tensors are the model).", show_default=False),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(help="HF config.json to write (and to take head counts from) instead of the checkpoint's model_args.",
                     show_default=False),
    ] = None,
    threads: Annotated[int, typer.Option(min=1, help="Parallel reads.")] = 4,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an export already at DST.")] = False,
    allow_skip: Annotated[bool, typer.Option("--allow-skip", help=_ALLOW_SKIP_HELP)] = False,
    no_config: Annotated[bool, typer.Option("--no-config", help="Export without config.json when the checkpoint does "
                                            "not know its model's config: you will add it yourself.")] = False,
) -> None:
    """Export the model as a Hugging Face folder (shards + index.json + config.json), streaming.
    Every other tensor is listed; exit 1, writing nothing, when model weights would be left
    out or the source holds data unickpt does not read, unless --allow-skip; or when no
    config.json can be written (the checkpoint does not know its model's config), unless
    --config FILE or --no-config."""
    from .adapters.checkpoint import open_checkpoint
    from .adapters.hf_export import export_hf, export_ledger, parse_size, plan_hf_export
    from .format.values import loads_json

    if fmt != "hf":
        raise _fail(f"unknown export format {fmt!r} (known: hf)")
    parse_size(max_shard_size)  # a bad size fails before anything is read
    hf_config = None
    if config is not None:
        try:
            hf_config = loads_json(config.read_text())
        except ValueError as e:
            raise _fail(f"{config} is not valid JSON: {e}") from None
        if not isinstance(hf_config, dict):
            raise _fail(f"{config} does not hold a JSON object")
    kwargs: dict[str, Any] = {"dtype": dtype, "names": names, "prefix": prefix, "config": hf_config}
    with open_checkpoint(str(src)) as ckpt:
        manifest = ckpt.manifest
        plan = plan_hf_export(manifest, **kwargs)
        _refuse_incomplete(export_ledger(ckpt, manifest, plan), allow_skip, "exported")
        if plan.config is None and not no_config:
            _err().print(Text("nothing exported: the checkpoint does not know its model's config (no model_args, no "
                              "hf_config in its metadata), and from_pretrained needs config.json; pass --config "
                              "CONFIG.json, or --no-config if you will add it yourself", style="bold red"), soft_wrap=True)
            raise typer.Exit(EXIT_FAILED)
        total = plan.total_bytes
        report = _with_byte_progress("exporting", total, lambda progress: export_hf(
            ckpt, str(dst), max_shard_size=max_shard_size, threads=threads, overwrite=overwrite, progress=progress, **kwargs))
    extra = ", config.json" if report.config_written else ", no config.json (--no-config: add it yourself)"
    warnings = list(getattr(report, "warnings", [])) + ledger_warnings(report.ledger)
    _print_warnings(warnings)
    _out().print(
        Text(f"{_ok(warnings)}: {report.tensors} tensors exported (names: {report.names}), {human_bytes(report.bytes_written)} in "
             f"{counted(len(report.shards), 'shard')} to {report.dst}{extra} ({report.seconds:.2f} s)",
             style="yellow" if warnings else "green"),
        soft_wrap=True,
    )
    _print_ledger(report.ledger)


# ---------------------------------------------------------------- launch


# torchrun's flags and live recovery's: the one Typer command of live/launch_cli.py (the
# script's arguments after its path are passed through untouched)
app.command(**launch_cli.COMMAND)(launch_cli.launch)


@app.command("store", short_help="Host a live-recovery job's store and coordinator off the training nodes.")
@_errors
def store_cmd(
    port: Annotated[int, typer.Option("--port", help="The port to serve on (0: a free one, printed).")] = 29500,
    host: Annotated[str, typer.Option("--host", help="The address to listen on.")] = "0.0.0.0",
) -> None:
    """The control plane of a ``unickpt launch`` job on a host of its own (a CPU head node):
    start it first, then every node's launcher with ``--store HOST:PORT``. Losing node 0 is
    then a node loss like any other. Serves one job; exits with the job's status."""
    from .live.store_host import serve

    raise typer.Exit(serve(port, host))


# ---------------------------------------------------------------- demo


# ---------------------------------------------------------------- snapshots


@app.command("snapshots", short_help="List (and --free) the in-memory snapshots and keeper this node holds.")
@_errors
def snapshots_cmd(
    shm_root: Annotated[str | None, typer.Argument(metavar="[SHM_ROOT]", show_default=False,
                                                   help="The node's shm root (default: $UNICKPT_SHM_ROOT, else /dev/shm).")] = None,
    free: Annotated[bool, typer.Option("--free", help="Stop the keeper and delete every snapshot it holds "
                                       "(only when no job of this node is running: a running job loses its memory tier).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
    force: Annotated[bool, typer.Option("--force", help="With --free: free them even while a job of this node "
                                        "runs (it loses its memory tier).")] = False,
) -> None:
    """List the keeper process and the snapshots held in this node's host memory; a job
    killed and not relaunched leaves them held. --free stops the keeper and deletes them
    (refused while a job of this node runs, unless --force). Run it on every node of the job."""
    from .snapshot.leftovers import free_snapshots, held_snapshots, running_jobs
    from .snapshot.paths import base_dir, shm_root as default_root

    root = shm_root or default_root()
    if not os.path.exists(root):  # a job that closed cleanly removes the root it made: nothing is held
        if as_json:
            typer.echo(json.dumps({"keeper": None, "jobs": [], "freed": free, "root_exists": False}, indent=2))
        else:
            _out().print(f"{root}: no such directory, so no keeper and no snapshots (the node's shm root: give it, or "
                         "set $UNICKPT_SHM_ROOT)", soft_wrap=True)
        return
    if not os.path.isdir(root):
        raise _fail(f"{root}: not a directory (the node's shm root: give it, or set $UNICKPT_SHM_ROOT)")
    if not os.path.exists(base_dir(root)) and any(n == "manifest.json" or re.fullmatch(r"step_\d+", n) for n in os.listdir(root)):
        # a checkpoint directory given for the shm root: "no keeper" would be said of the wrong place
        raise _fail(f"{root} is a checkpoint directory, not a shm root: snapshots live in the node's shm root, "
                    f"{default_root()} here ($UNICKPT_SHM_ROOT, else /dev/shm; `unickpt snapshots` without an argument)")
    if free and not force:
        running = running_jobs(root)
        if running:
            _fail(f"a job of this node is running on {root} (pid {', '.join(map(str, running[:4]))}): --free would take "
                  "its snapshots away; stop it first, or add --force")
            raise typer.Exit(1)
    held = free_snapshots(root) if free else held_snapshots(root)
    if as_json:
        typer.echo(json.dumps({**held, "freed": free}, indent=2))
        return
    out = _out()
    keeper = held["keeper"]
    total = sum(j["bytes"] for j in held["jobs"])
    out.print(f"{root}: " + (f"keeper pid {keeper['pid']} (job {escape(keeper['job'])}, {keeper['host']}:{keeper['port']})"
                             if keeper else "no keeper running") + f"; {human_bytes(total)} of snapshots", soft_wrap=True)
    for j in held["jobs"]:
        steps = ", ".join(str(s) for s in j["steps"]) or "none"
        out.print(f"  job {escape(j['job'])}: steps {steps} (whole: {', '.join(map(str, j['whole'])) or 'none'}), "
                  f"{human_bytes(j['bytes'])}", soft_wrap=True)
        m = j.get("memory")
        if m:
            # of tensors: the files' headers and the manifests come besides (what dominates a tiny state)
            out.print(f"    node {m['node']} holds at most {human_bytes(m['total'])} of tensors: ring {m['ring_slots']} x "
                      f"{human_bytes(m['state'])} = {human_bytes(m['ring'])}, parity {human_bytes(m['parity'])} (files' "
                      f"headers and manifests besides); cap {human_bytes(m['cap'])}", soft_wrap=True)
    if free:
        out.print(f"freed: {human_bytes(total)}" + (f", keeper {keeper['pid']} stopped" if keeper else ""), soft_wrap=True)
    elif keeper or held["jobs"]:
        out.print(f"free them (when no job of this node runs): unickpt snapshots {root} --free", soft_wrap=True)


@app.command("demo", short_help="Train on tp2 x dp2, lose the job, resume on 3 ranks; or lose a rank and go on (--fault-tolerance).")
@_errors
def demo_cmd(
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Keep checkpoints under this directory (default: a temporary one)."),
    ] = None,
    reshard: Annotated[
        bool, typer.Option("--reshard", help="Instead: save a toy Llama on 4 ranks, load it resharded on 2.")
    ] = False,
    plot: Annotated[Path, typer.Option("--plot", help="Where to write the PNG of both loss curves.")] = Path(
        "unickpt_demo_resume.png"
    ),
    fault_tolerance: Annotated[
        bool, typer.Option("--fault-tolerance", help="Instead: live recovery under `unickpt launch`: rank 2 of 4 is "
                           "killed, the survivors go on in their own processes from memory, a replacement joins "
                           "(PNG: unickpt_demo_fault.png unless --plot).")
    ] = False,
    node_loss: Annotated[
        bool, typer.Option("--node-loss", help="With --fault-tolerance: 4 simulated nodes (torchrun) with in-memory "
                           "snapshots and parity lose one; the job is restarted on 3 from memory.")
    ] = False,
    tp: Annotated[
        int, typer.Option("--tp", help="With --fault-tolerance: FSDP2 x TP on a dp2 x tp2 mesh (2); the world stays a "
                          "multiple of it: 4 -> 2 ranks + 1 hot spare -> 4.")
    ] = 1,
) -> None:
    """Train on tp2 x dp2, lose the job, resume on 3 ranks: the loss curve goes on (CPU, gloo)."""
    png = str(plot) if plot != Path("unickpt_demo_resume.png") else "unickpt_demo_fault.png"
    if fault_tolerance and not node_loss:
        from .demo_live import run_live_demo

        if tp not in (1, 2):
            raise typer.BadParameter(f"--tp {tp}: the live demo runs 4 ranks, with --tp 1 or 2", param_hint="--tp")
        live = run_live_demo(str(directory) if directory else None, png, _out(), tp)
        if not live.ok:
            _err().print(Text("demo FAILED: the survivors did not go on from memory on the unbroken curve", style="bold red"))
            raise typer.Exit(EXIT_FAILED)
        return
    if fault_tolerance:
        from .demo_fault import run_fault_demo

        ft = run_fault_demo(str(directory) if directory else None, png, _out())
        if not ft.ok:
            _err().print(Text("demo FAILED: the survivors did not continue from memory on the unbroken curve", style="bold red"))
            raise typer.Exit(EXIT_FAILED)
        return
    if reshard:
        from .demo import run_demo

        result = run_demo(directory, _out())
        if not result.ok:
            _err().print(Text("demo FAILED: some state did not come back bitwise equal", style="bold red"))
            raise typer.Exit(EXIT_FAILED)
        return
    from .demo_resume import run_resume_demo

    resumed = run_resume_demo(str(directory) if directory else None, str(plot), _out())
    if not resumed.ok:
        _err().print(Text("demo FAILED: the resumed loss curve departs from the unbroken one", style="bold red"))
        raise typer.Exit(EXIT_FAILED)


def _is_remote(location: str) -> bool:
    from .storage.open import is_remote

    return is_remote(location)


def main() -> None:
    """Entry point of the ``unickpt`` script and ``python -m unickpt``."""
    for stream in (sys.stdout, sys.stderr):
        # a name that the terminal's encoding cannot show is escaped, never a crash mid-output
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
