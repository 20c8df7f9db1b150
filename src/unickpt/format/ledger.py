"""The ledger: an account of every tensor and every byte of a checkpoint's source.

A reader turns a checkpoint (unickpt's own or a foreign one) into a :class:`Manifest`.
The ledger says what that manifest accounts for, and what it does not:

* **read**: the tensors the manifest holds, and the bytes of the data files its
  fragments cover;
* **skipped**: what the reader left out on purpose, each with its reason (adapters record
  it in ``manifest.provenance["skipped"]`` as ``{name: reason}``);
* **replicas**: further copies of data the reader reads once from another copy (a
  replica written by several ranks, a module copy of the master weights); adapters
  record them in ``manifest.provenance["replicas"]`` as ``{name: reason}``. They are
  accounted for, and leave the source complete;
* **left out**: what a command chose not to write (``export`` writes the model only);
* **unaccounted**: byte ranges of a data file that no fragment covers, that are no known
  part of the file's structure (a header, an archive's records) and that belong to no
  item the reader read or reported. Data there would be dropped silently: commands fail
  on it.

Which byte ranges of a file are structure, and which item owns which range, depends on the
file format: the caller gives them as *declared regions* (``unickpt.adapters.regions``
finds them for safetensors files, PyTorch DCP items and DeepSpeed archives). Files without declared regions
are accounted for by tensor only (``files_unchecked``). Pure: no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..units import counted
from .manifest import Manifest


@dataclass(frozen=True)
class Region:
    """Bytes ``[start, stop)`` of ``file``. ``owner`` names the item of the source that
    holds them (a tensor or value name); None for the file's own structure (a header, an
    archive's directory)."""

    file: str
    start: int
    stop: int
    owner: str | None = None

    def __str__(self) -> str:
        who = f" ({self.owner})" if self.owner is not None else ""
        return f"{self.file} bytes {self.start}-{self.stop}{who}"


@dataclass
class Ledger:
    """What a reader accounts for in a checkpoint's source (see the module docstring)."""

    tensors: int = 0  # global tensors
    per_rank: int = 0  # per-rank tensor entries (each saved once per rank), counted apart as inspect and verify do
    bytes_read: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    replicas: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    unaccounted: list[Region] = field(default_factory=list)
    ignored_files: dict[str, str] = field(default_factory=dict)
    files_unchecked: list[str] = field(default_factory=list)
    bytes_checked: int = 0  # bytes of the data files whose every byte was accounted for

    @property
    def accounted(self) -> bool:
        """True when every byte of the checked files is read or reported."""
        return not self.unaccounted

    @property
    def complete(self) -> bool:
        """True when nothing of the source is left out: nothing skipped, nothing unaccounted."""
        return not self.unaccounted and not self.skipped

    @property
    def unaccounted_bytes(self) -> int:
        """Bytes neither read nor reported."""
        return sum(r.stop - r.start for r in self.unaccounted)

    def line(self, names: int | None = 5) -> str:
        """The totals in one line: ``412 tensors, 1.13 GiB read; 3 skipped: a, b because ...``
        (``412 tensors + 1 per-rank tensor, ...`` when there are per-rank ones); at most
        ``names`` names per reason and per kind (``... and 112 more``), every one when None."""
        rank = f" + {counted(self.per_rank, 'per-rank tensor')}" if self.per_rank else ""
        parts = [f"{counted(self.tensors, 'tensor')}{rank}, {size_text(self.bytes_read)} read"]
        if self.skipped:
            parts.append(f"{len(self.skipped)} skipped: {_because(self.skipped, names)}")
        if self.replicas:
            parts.append(f"{counted(len(self.replicas), 'replica')} read once from another copy")
        if self.left_out:
            parts.append(f"{len(self.left_out)} left out: {_because(self.left_out, names)}")
        if self.files_unchecked:
            parts.append(f"{counted(len(self.files_unchecked), 'file')} accounted for by tensor only, not byte by byte")
        if self.ignored_files:
            parts.append(f"{counted(len(self.ignored_files), 'file')} ignored: {_because(self.ignored_files, names)}")
        if self.unaccounted:
            regions = [str(r) for r in self.unaccounted]
            parts.append(f"{size_text(self.unaccounted_bytes)} neither read nor reported: {_some(regions, None if names is None else 3)}")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the ledger."""
        return {
            "tensors": self.tensors, "per_rank": self.per_rank, "bytes_read": self.bytes_read, "skipped": dict(self.skipped), "replicas": dict(self.replicas),
            "left_out": dict(self.left_out), "ignored_files": dict(self.ignored_files),
            "unaccounted": [{"file": r.file, "start": r.start, "stop": r.stop, "owner": r.owner} for r in self.unaccounted],
            "unaccounted_bytes": self.unaccounted_bytes, "bytes_checked": self.bytes_checked,
            "files_unchecked": list(self.files_unchecked), "complete": self.complete,
        }


def size_text(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units, as the command line prints sizes; three
    significant digits)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 999.5 or unit == "PiB":
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError  # pragma: no cover


def _some(names: list[str], limit: int | None) -> str:
    """``a, b, c and 4 more``: the first ``limit`` of ``names`` (all of them when None)."""
    if limit is None or len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def _because(reasons: dict[str, str], names_per_reason: int | None = 5) -> str:
    """``a, b because R1; c because R2``: names grouped by their reason (at most
    ``names_per_reason`` of each, every one when None)."""
    groups: dict[str, list[str]] = {}
    for name, reason in reasons.items():
        groups.setdefault(reason, []).append(name)
    return "; ".join(f"{_some(names, names_per_reason)} because {reason}" for reason, names in groups.items())


def no_equivalent(what: str, plural: bool, target: str, names: list[str]) -> str:
    """The warning of a writer that leaves out what ``target`` cannot hold, every name
    listed: ``per-rank state has no DCP equivalent and was left out: rng`` (``plural``:
    ``values have ... were ...``)."""
    verbs = ("have", "were") if plural else ("has", "was")
    return f"{what} {verbs[0]} no {target} equivalent and {verbs[1]} left out: {', '.join(names)}"


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _minus(spans: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` less ``cut`` (both sorted, disjoint)."""
    out: list[tuple[int, int]] = []
    j = 0
    for a, b in spans:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k = j
        while a < b:
            if k >= len(cut) or cut[k][0] >= b:
                out.append((a, b))
                break
            if cut[k][0] > a:
                out.append((a, cut[k][0]))
            a = max(a, cut[k][1])
            k += 1
    return out


def build_ledger(
    manifest: Manifest,
    declared: dict[str, list[Region]] | None = None,
    ignored_files: dict[str, str] | None = None,
) -> Ledger:
    """The ledger of ``manifest`` (a reader's account of a source checkpoint).

    ``declared`` gives, per data file, its known regions (structure, or bytes owned by a
    named item); those files are checked byte by byte, the others only by tensor.
    ``ignored_files`` are files of the directory that are not part of the checkpoint
    (with the reason), left out of the byte count.
    """
    declared = declared or {}
    ignored = dict(ignored_files or {})
    entries = list(manifest.tensors.values()) + [e for row in manifest.rank_tensors.values() for e in row if e is not None]
    covered: dict[str, list[tuple[int, int]]] = {}
    for e in entries:
        for f in e.fragments:
            covered.setdefault(f.file, []).append((f.offset, f.offset + f.nbytes(e.dtype)))
    merged = {name: _union(spans) for name, spans in covered.items()}
    skipped = manifest.provenance.get("skipped")
    replicas = manifest.provenance.get("replicas")
    led = Ledger(
        tensors=len(manifest.tensors),
        per_rank=len(manifest.rank_tensors),
        bytes_read=sum(b - a for spans in merged.values() for a, b in spans),
        skipped={str(k): str(v) for k, v in skipped.items()} if isinstance(skipped, dict) else {},
        replicas={str(k): str(v) for k, v in replicas.items()} if isinstance(replicas, dict) else {},
        ignored_files=ignored,
    )
    read_names = set(manifest.tensors) | set(manifest.rank_tensors) | set(manifest.values) | set(manifest.rank_values)

    def reported(owner: str) -> bool:
        if owner in read_names or owner in led.skipped or owner in led.replicas:
            return True
        # a value read whole holds the items of its parts (DCP's ``param_groups.0.lr``)
        parts = owner.split(".")
        return any(".".join(parts[:i]) in read_names for i in range(1, len(parts)))

    for file, size in sorted(manifest.files.items()):
        if file in ignored:
            continue
        if file not in declared:
            led.files_unchecked.append(file)
            continue
        holes = _minus([(0, size)], merged.get(file, []))
        owned = [r for r in declared[file] if r.owner is not None]
        # structure, and bytes of items read or reported, are accounted for
        known = _union([(r.start, r.stop) for r in declared[file] if r.owner is None or reported(r.owner)])
        rest = _minus(holes, known)
        bad = sorted((r for r in owned if not reported(r.owner)), key=lambda r: r.start)  # type: ignore[arg-type]
        found: list[Region] = []
        j = 0
        for a, b in rest:  # sorted: one sweep names the owner of each unaccounted part
            while j < len(bad) and bad[j].stop <= a:
                j += 1
            k, at = j, a
            while k < len(bad) and bad[k].start < b:
                lo, hi = max(at, bad[k].start), min(b, bad[k].stop)
                if lo > at:
                    found.append(Region(file, at, lo))
                if hi > lo:
                    found.append(Region(file, lo, hi, bad[k].owner))
                    at = hi
                k += 1
            if at < b:
                found.append(Region(file, at, b))
        found.sort(key=lambda r: r.start)
        if found:
            led.unaccounted += _merge(found)
        else:
            led.bytes_checked += size
    return led


def _merge(regions: list[Region]) -> list[Region]:
    out: list[Region] = []
    for r in regions:
        if out and out[-1].owner == r.owner and out[-1].stop >= r.start:
            out[-1] = Region(r.file, out[-1].start, max(out[-1].stop, r.stop), r.owner)
        else:
            out.append(r)
    return out
