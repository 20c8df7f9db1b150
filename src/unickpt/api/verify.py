"""``verify``: re-check every byte of a committed checkpoint against its manifest.

What is checked, per data file and per fragment (``tensors`` and ``rank_tensors``):

* the file exists and has exactly the size the manifest records (missing / truncated /
  grown files);
* its safetensors header parses, and the header entry of each fragment (key = tensor
  name) agrees with the manifest: dtype, shape and absolute byte range;
* every checksum block of every fragment: its CRC-32C equals the one in the manifest;
* the fragments of each tensor hold as many elements as the tensor has (a tensor with
  missing shards cannot be loaded whole);
* the manifest itself: reading it checks its SHA-256 digest (format 1.1 on; the report's
  ``manifest_digest``, or None for an older manifest without one);
* an incremental checkpoint's referenced fragments, in its bases' files, like its own;
  a base that is missing or was replaced is a problem of kind ``"base"`` naming it.

Foreign formats (PyTorch DCP, DeepSpeed, Hugging Face) store no checksums: for them the
check is structural (every metadata record and archive parses, every fragment lies inside
an existing file, every tensor is covered) and the report counts their bytes as
``bytes_unverifiable``.

Every checkpoint also gets its ledger (:mod:`unickpt.format.ledger`): the tensors and
bytes read, what the reader skipped and why, and byte ranges of the data files that are
neither read nor reported. Such an unaccounted range is a problem (kind
``"unaccounted"``): data there would be dropped silently. Skipped items are not
problems (the checkpoint is sound), but the report is then not ``complete``.

Nothing is raised for a corrupt checkpoint: every problem found is collected in the
returned :class:`VerifyReport`, each naming the file, the tensor and the byte range, so
one run tells everything that is wrong. Only a path without a committed manifest (or an
unreadable manifest) raises, as ``load`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ..adapters.checkpoint import OpenCheckpoint, using_checkpoint
from ..adapters.regions import source_ledger
from ..engine.reads import Segment, SpanRead, block_checks, execute
from ..errors import CorruptionError, StorageError, UnickptError
from ..format.dtypes import itemsize
from ..format.ledger import Ledger
from ..format.manifest import Fragment, Manifest, TensorEntry
from ..format.safetensors_header import parse_entry, read_header
from ..plan.box import tiling_problem
from ..storage.base import Storage
from ..engine.gc_pause import gc_paused
from ..engine.bases import base_problems
from ..storage.open import is_remote

__all__ = ["verify", "VerifyReport", "Problem"]

# Several checksum blocks are read at once when blocks are small, to keep syscalls few.
READ_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    ``start``/``stop`` are absolute byte offsets in ``file`` (both None when the problem
    concerns no byte range, e.g. a tensor whose fragments do not cover it); ``file`` is
    None for problems of a tensor as a whole, ``tensor`` None for problems of a file.
    """

    kind: str
    message: str
    file: str | None = None
    tensor: str | None = None
    start: int | None = None
    stop: int | None = None

    def __str__(self) -> str:
        where = []
        if self.file is not None:
            where.append(f"file {self.file}")
        if self.tensor is not None:
            where.append(f"tensor {self.tensor!r}")
        if self.start is not None and self.stop is not None:
            where.append(f"bytes {self.start}-{self.stop}")
        return f"{', '.join(where)}: {self.message}" if where else self.message


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`."""

    path: str
    problems: list[Problem] = field(default_factory=list)
    bytes_checked: int = 0
    bytes_total: int = 0
    tensors: int = 0  # global tensors + per-rank tensor names
    fragments: int = 0
    files: int = 0
    format: str = "unickpt"
    bytes_unverifiable: int = 0  # bytes of fragments whose format stores no checksums
    ledger: Ledger = field(default_factory=Ledger)
    manifest_digest: str | None = None  # "sha256:<hex>" checked on reading; None: the manifest has none

    @property
    def digest_line(self) -> str:
        """What became of the manifest's own digest (unickpt format only; empty otherwise)."""
        if self.format != "unickpt":
            return ""
        if self.manifest_digest is None:
            return "manifest digest: absent (older format)"
        algorithm, _, hexdigest = self.manifest_digest.partition(":")
        return f"manifest digest: {algorithm} {hexdigest[:16]} verified"

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems

    @property
    def complete(self) -> bool:
        """True when nothing is wrong and the reader skipped nothing of the source."""
        return self.ok and self.ledger.complete

    def __str__(self) -> str:
        if self.ok and self.bytes_unverifiable:
            return (f"OK ({self.format}): {self.tensors} tensors, structure sound; {self.bytes_unverifiable} bytes "
                    "not verifiable (the format stores no checksums)")
        if self.ok:
            lines = [f"OK: {self.tensors} tensors, {self.bytes_checked} bytes verified"]
        else:
            lines = [f"CORRUPT: {len(self.problems)} problem(s) in {self.path}"]
            lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines + [self.digest_line] if self.digest_line else lines)


def _entries(manifest: Manifest) -> list[TensorEntry]:
    out = list(manifest.tensors.values())
    for row in manifest.rank_tensors.values():
        out.extend(e for e in row if e is not None)
    return out


def total_bytes(manifest: Manifest) -> int:
    """Bytes of tensor data :func:`verify` reads for ``manifest`` when every file is intact
    (the total to give a progress bar)."""
    size = 0
    for e in _entries(manifest):
        isz = itemsize(e.dtype)
        size += sum(prod(f.shape) * isz for f in e.fragments if f.crc32c)
    return size


@dataclass
class _FileState:
    expected: int
    actual: int | None  # None: missing
    header: dict | None = None  # None: unreadable or missing


def _check_files(storage: Storage, manifest: Manifest, problems: list[Problem], headers: bool) -> dict[str, _FileState]:
    states: dict[str, _FileState] = {}
    for name, expected in sorted(manifest.files.items()):
        try:
            actual = storage.size(name)
        except CorruptionError:
            problems.append(Problem("missing", f"data file is missing (manifest expects {expected} bytes)", name))
            states[name] = _FileState(expected, None)
            continue
        except (OSError, StorageError) as e:
            problems.append(Problem("unreadable", f"cannot stat data file: {e}", name))
            states[name] = _FileState(expected, None)
            continue
        st = _FileState(expected, actual)
        states[name] = st
        if actual < expected:
            problems.append(Problem(
                "truncated", f"file is truncated: {actual} bytes on disk, manifest expects {expected}",
                name, None, actual, expected,
            ))
        elif actual > expected:
            problems.append(Problem(
                "size", f"file size mismatch: {actual} bytes on disk, manifest expects {expected}",
                name, None, expected, actual,
            ))
        if not headers:
            continue
        try:
            header, data_start = read_header(storage.reader(name))
            if not isinstance(header, dict):
                raise UnickptError("safetensors header is not a JSON object")
            st.header = {"entries": header, "data_start": data_start}
        except (UnickptError, OSError) as e:
            problems.append(Problem("header", f"safetensors header does not parse: {e}", name))
    return states


def _check_header(entry: TensorEntry, frag: Fragment, st: _FileState, problems: list[Problem]) -> None:
    """The file's own header entry for the tensor must describe the fragment's bytes."""
    if st.header is None:
        return
    nbytes = frag.nbytes(entry.dtype)
    span = (frag.file, entry.name, frag.offset, frag.offset + nbytes)
    h = st.header["entries"].get(entry.name)
    if not isinstance(h, dict):
        problems.append(Problem("header", "safetensors header has no entry for this tensor", *span))
        return
    try:
        dtype, shape, lo, hi = parse_entry(h)
    except ValueError as e:  # not JSON integers (1e999, true, 3.5), out of bounds, unknown dtype
        problems.append(Problem("header", f"safetensors header entry is malformed: {e}", *span))
        return
    base = st.header["data_start"]
    diffs = []
    if dtype != entry.dtype:
        diffs.append(f"dtype {dtype} (manifest: {entry.dtype})")
    if shape != tuple(frag.shape):
        diffs.append(f"shape {list(shape)} (manifest: {list(frag.shape)})")
    if (base + lo, base + hi) != (frag.offset, frag.offset + nbytes):
        diffs.append(f"bytes {base + lo}-{base + hi} (manifest: {frag.offset}-{frag.offset + nbytes})")
    if diffs:
        problems.append(Problem("header", "safetensors header disagrees with the manifest: " + "; ".join(diffs), *span))


def _check_coverage(entry: TensorEntry, problems: list[Problem]) -> None:
    why = tiling_problem(entry.shape, [p.global_box for f in entry.fragments for p in f.pieces])
    if why is not None:
        problems.append(Problem("coverage", f"{why}; the tensor cannot be loaded whole", None, entry.name))


def _span_reads(entry: TensorEntry, frag: Fragment) -> list[SpanRead]:
    """The fragment's checksummed bytes as span reads of at most ``READ_CHUNK_BYTES``
    (whole blocks), into scratch; none when the format stores no checksums."""
    nbytes = frag.nbytes(entry.dtype)
    nblocks = len(frag.crc32c)
    per = max(1, READ_CHUNK_BYTES // frag.block_bytes)
    out = []
    for b0 in range(0, nblocks, per):
        b1 = min(nblocks, b0 + per)
        start, stop = min(nbytes, b0 * frag.block_bytes), min(nbytes, b1 * frag.block_bytes)
        out.append(SpanRead(frag.file, frag.offset + start, stop - start, [Segment(0, stop - start)], tensor=entry.name,
                            checks=block_checks(frag.crc32c, frag.block_bytes, nbytes, start, b0, b1)))
    return out


_MESSAGES = {
    "checksum": "checksum mismatch (data corrupt)",
    "truncated": "data lies past the end of the truncated file",
    "missing": "data file is missing",
}


@gc_paused()
def verify(path: str | OpenCheckpoint, *, progress: Callable[[int], None] | None = None, threads: int = 4,
           storage_options: dict[str, Any] | None = None) -> VerifyReport:
    """Re-check every checksum of the checkpoint at ``path`` (or of a checkpoint the caller
    opened) and report what is wrong.

    ``progress``, if given, is called from the calling thread with the number of bytes
    just processed (for a progress bar over :func:`total_bytes`). Reads run on
    ``threads`` threads. Raises :class:`~unickpt.NotACheckpointError` when ``path``
    holds no committed checkpoint and :class:`~unickpt.ManifestError` when its manifest
    is invalid; every other problem is reported, not raised. ``path`` may be a URL
    (``storage_options`` for its file system); a store that cannot be reached is a
    :class:`~unickpt.StorageError`.

    Args:
        path: The checkpoint's directory or URL, or a checkpoint opened by the caller.
        progress: Called with the bytes just checked.
        threads: Parallel reads.
        storage_options: Options of a URL's file system (fsspec).

    Returns:
        A :class:`VerifyReport`: ``ok``, and each problem with the file it is in.

    Raises:
        NotACheckpointError: ``path`` holds no committed checkpoint.
        ManifestError: Its manifest is invalid.
        StorageError: The store cannot be reached.
    """
    with using_checkpoint(path, storage_options, bases=False) as ckpt:  # a missing base is a problem reported
        return _verify(ckpt, progress, threads)


def _base_problems(ckpt: OpenCheckpoint, manifest: Manifest) -> list[tuple[str, str]]:
    """The bases of an incremental checkpoint that are missing or replaced."""
    if not manifest.bases:
        return []
    if is_remote(ckpt.storage):
        return [("", "an incremental checkpoint (it references bases) on an object store: not supported")]
    return base_problems(str(ckpt.storage.root), manifest)


def _verify(ckpt: OpenCheckpoint, progress: Callable[[int], None] | None, threads: int) -> VerifyReport:
    storage, manifest = ckpt.storage, ckpt.manifest
    report = VerifyReport(ckpt.location, format=ckpt.format, manifest_digest=manifest.digest)
    problems: list[Problem] = []
    problems += [Problem("base", what) for _, what in _base_problems(ckpt, manifest)]
    try:
        states = _check_files(storage, manifest, problems, headers=report.format == "unickpt")
        entries = _entries(manifest)
        report.tensors = len(manifest.tensors) + len(manifest.rank_tensors)  # per-rank: one per name
        report.files = len(manifest.files)
        report.bytes_total = total_bytes(manifest)
        reads: list[SpanRead] = []
        ordered: list[SpanRead] = []
        for entry in entries:
            _check_coverage(entry, problems)
            for frag in entry.fragments:
                report.fragments += 1
                _check_header(entry, frag, states[frag.file], problems)
                if not frag.crc32c:
                    report.bytes_unverifiable += frag.nbytes(entry.dtype)
                    continue
                for r in _span_reads(entry, frag):
                    if states[frag.file].actual is None:  # reported per range below, nothing to read
                        r.problems.append(("missing", r.offset, r.offset + r.nbytes, ""))
                        if progress is not None and r.nbytes:
                            progress(r.nbytes)
                    else:
                        reads.append(r)
                    ordered.append(r)
        execute(storage, [r for r in reads if r.nbytes], threads=threads, max_group=READ_CHUNK_BYTES, report=True,
                progress=progress)
        for r in ordered:  # in the manifest's order: the report is deterministic
            report.bytes_checked += r.bytes_checked
            problems.extend(Problem(kind, message or _MESSAGES[kind], r.file, r.tensor, lo, hi)
                            for kind, lo, hi, message in sorted(r.problems, key=lambda q: q[1]))
    finally:
        storage.close()
    report.ledger = source_ledger(ckpt)
    for r in report.ledger.unaccounted:
        what = f"bytes of {r.owner!r}, which the reader neither read nor reported" if r.owner else \
            "bytes no tensor, header or item of the checkpoint accounts for"
        problems.append(Problem("unaccounted", f"{what} (data unickpt would drop)", r.file, None, r.start, r.stop))
    report.problems = _merge(problems)
    return report


def _merge(problems: list[Problem]) -> list[Problem]:
    """Join problems of the same kind, file and tensor whose byte ranges touch."""
    out: list[Problem] = []
    for p in problems:
        if out:
            q = out[-1]
            if (
                q.kind == p.kind and q.file == p.file and q.tensor == p.tensor and q.message == p.message
                and q.stop is not None and p.start is not None and q.stop == p.start
            ):
                out[-1] = Problem(q.kind, q.message, q.file, q.tensor, q.start, p.stop)
                continue
        out.append(p)
    return out
