"""The indexed manifest (format 2.0): a small root ``manifest.json`` and ``fragments.jsonl``.

At thousands of ranks nearly all of a manifest is fragment lists, and a loading rank needs
only those of its own tensors. An indexed checkpoint keeps the root document as in 1.x
(``files``, ``values``, every tensor's shape, dtype and layout) but moves each tensor's
fragment list to one line of ``fragments.jsonl``, the same JSON array 1.x stores inline;
a tensor's fragments, sorted by their boxes, are cut into lines of a few, and the root
gives each tensor's ``fragments_at``: ``[offset, length, crc32c, box offsets, box
lengths]`` per line (the box bounds the line's fragments). A reader parses the root,
then only the lines whose box meets what it needs, each checked against its CRC-32C
(the root itself is covered by its SHA-256 digest) and validated as 1.x fragments are. See docs/FORMAT.md, "Indexed manifests (2.0)".

Pure: the writer side turns fragment texts into documents, the reader side takes a
``read_range(offset, length) -> bytes`` callable for the index file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from ..errors import CorruptionError, ManifestError
from .checksum import crc32c

INDEX_NAME = "fragments.jsonl"
INDEXED_VERSION = (2, 0)
# an indexed manifest is written when a save stores more fragments than this
INDEX_FRAGMENTS = 20_000
CHUNK_FRAGMENTS = 4  # fragments per line of the index

IndexReader = Callable[[int, int], bytes]


def tensor_head(shape: list[int] | tuple[int, ...], dtype: str, layout: str) -> dict[str, Any]:
    """A tensor's entry in the manifest, without its fragments."""
    d: dict[str, Any] = {"shape": list(shape), "dtype": dtype}
    if layout:
        d["layout"] = layout
    return d


def _join(head: dict[str, Any], key: str, raw: str) -> str:
    """``head`` serialised compactly with ``key`` set to the JSON text ``raw`` as its last member."""
    text = json.dumps(head, separators=(",", ":"))
    return f"{text[:-1]}{',' if len(text) > 2 else ''}\"{key}\":{raw}}}"


@dataclass
class FragmentRows:
    """The fragments of a manifest being written, one row each (in the order they came):
    the tensor each belongs to (an index into the tensors list), its JSON text (bytes or
    a memoryview), and the box bounding its pieces (``lo``, ``length``: one column per
    dimension, zero past the tensor's own)."""

    tensor: np.ndarray  # int64
    texts: list[Any]
    text_len: np.ndarray  # int64: the length of each text
    lo: np.ndarray  # (rows, width) int64
    length: np.ndarray  # (rows, width) int64


def manifest_documents(
    head: dict[str, Any], tensors: list[tuple[str, dict[str, Any]]], rows: FragmentRows, tail: dict[str, Any], indexed: bool,
) -> tuple[str, bytes | None]:
    """The manifest text (before sealing) and, when ``indexed``, the index file.

    ``head``: the members before ``tensors`` (format, version, world_size, provenance,
    metadata, files); ``tensors``: ``(name, tensor_head(...))`` of each tensor; ``rows``:
    every fragment; ``tail``: the members after (values, rank_values, rank_tensors).
    Fragment texts are spliced in as they are (each rank serialised its own), so no
    fragment is parsed here. Not indexed, a tensor lists its fragments in the order they
    came. Indexed, a tensor's fragments are sorted by their bounding boxes and cut into
    lines of ``CHUNK_FRAGMENTS``, each listed in the root with its place in the index,
    CRC-32C and bounding box; this is done on arrays, a few operations for all fragments.
    """
    if not indexed:
        texts: list[list[Any]] = [[] for _ in tensors]
        for t, text in zip(rows.tensor.tolist(), rows.texts):
            texts[t].append(text)
        parts = [json.dumps(name) + ":" + _join(th, "fragments", "[" + b",".join(ts).decode() + "]")
                 for (name, th), ts in zip(tensors, texts)]
        text = _join(head, "tensors", "{" + ",".join(parts) + "}")
        rest = json.dumps(tail, separators=(",", ":"))
        return (text[:-1] + "," + rest[1:] if len(rest) > 2 else text), None
    index, lines = _index_lines(rows)
    chunks: list[list[Any]] = [[] for _ in tensors]
    ndims = [len(th["shape"]) for _, th in tensors]
    for t, at, n, crc, lo, length in lines:
        nd = ndims[t]
        chunks[t].append([at, n, crc, lo[:nd], length[:nd]])
    doc = dict(head, index={"file": INDEX_NAME, "size": len(index)},
               tensors={name: dict(th, fragments_at=c) for (name, th), c in zip(tensors, chunks)})
    doc.update(tail)
    return json.dumps(doc, separators=(",", ":")), index


def _index_lines(rows: FragmentRows) -> tuple[bytes, Any]:
    """The index file and, for each of its lines: tensor, offset, length, CRC-32C, box
    offsets and box lengths, the box in ``rows.lo``'s width."""
    import numpy as np  # here: reading a manifest needs no numpy (the command line starts faster)

    n, width = rows.lo.shape
    if n == 0:
        return b"", []
    keys = [np.arange(n)] + [rows.length[:, d] for d in reversed(range(width))]
    keys += [rows.lo[:, d] for d in reversed(range(width))] + [rows.tensor]
    order = np.lexsort(keys)  # by tensor, then box (offsets, then lengths), then as they came
    tensor = rows.tensor[order]
    new_tensor = np.ones(n, dtype=bool)
    new_tensor[1:] = tensor[1:] != tensor[:-1]
    at = np.arange(n)
    first = np.maximum.accumulate(np.where(new_tensor, at, 0))  # of each row's tensor
    new_line = (at - first) % CHUNK_FRAGMENTS == 0
    starts = np.nonzero(new_line)[0]
    lo = rows.lo[order]
    line_lo = np.minimum.reduceat(lo, starts, axis=0)
    line_hi = np.maximum.reduceat(lo + rows.length[order], starts, axis=0)
    text_len = rows.text_len[order]
    count = np.diff(np.append(starts, n))
    line_len = np.add.reduceat(text_len, starts) + count + 1  # "[", "]" and the commas between
    line_at = np.zeros(len(starts), dtype=np.int64)
    np.cumsum(line_len[:-1] + 1, out=line_at[1:])
    out: list[Any] = [None] * (2 * n + 1)
    out[0] = b"["
    out[1::2] = [rows.texts[k] for k in order.tolist()]
    out[2::2] = [b"]\n[" if s else b"," for s in new_line[1:].tolist()] + [b"]\n"]
    index = b"".join(out)
    whole = memoryview(index)
    ats, lens = line_at.tolist(), line_len.tolist()
    crcs = [crc32c(whole[a : a + k]) for a, k in zip(ats, lens)]
    return index, zip(tensor[starts].tolist(), ats, lens, crcs, line_lo.tolist(), (line_hi - line_lo).tolist())


def index_chunks(d: Any, name: str, ndim: int, index_size: int) -> list[tuple[int, int, int, tuple[int, ...], tuple[int, ...]]]:
    """A tensor's ``fragments_at``: ``(offset, length, crc32c, box offsets, box lengths)``
    of each of its lines, checked to lie in the index."""
    def bad() -> ManifestError:
        return ManifestError(f"malformed manifest: tensor {name!r}: fragments_at is {d!r:.60}, not a list of "
                             f"[offset, length, crc32c, box offsets, box lengths] inside the index ({index_size} bytes)")

    if not isinstance(d, list):
        raise bad()
    out = []
    for c in d:
        if not isinstance(c, list) or len(c) != 5 or not all(_nat(x) for x in c[:3]) or c[2] > 0xFFFFFFFF or c[0] + c[1] > index_size:
            raise bad()
        if not all(isinstance(v, list) and len(v) == ndim and all(_nat(x) for x in v) for v in c[3:]):
            raise bad()
        out.append((c[0], c[1], c[2], tuple(c[3]), tuple(c[4])))
    return out


def _nat(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_line(read_range: IndexReader | None, name: str, offset: int, length: int, crc: int) -> bytes:
    """The bytes of one line of a tensor's fragments in the index, checked against its CRC-32C."""
    if read_range is None:
        raise ManifestError(f"tensor {name!r}: its fragments are in {INDEX_NAME}, which this reader was not given")
    raw = read_range(offset, length)
    if len(raw) != length:
        raise CorruptionError(f"{INDEX_NAME} is truncated: tensor {name!r} needs bytes {offset}-{offset + length}")
    if crc32c(raw) != crc:
        raise CorruptionError(f"checksum mismatch in {INDEX_NAME} (tensor {name!r}, bytes {offset}-{offset + length}): "
                              "the checkpoint's index was changed after it was written")
    return raw


# -- an index spread over machines (the in-memory snapshots) ------------------------------
def part_name(part: int) -> str:
    """File name of part ``part`` of an index cut into parts (:func:`part_bounds`)."""
    return f"fragments_{part:05d}.jsonl"


def line_offsets(index: bytes | memoryview) -> list[int]:
    """Where each line of an index file starts (its lines end with a newline)."""
    import numpy as np

    ends = np.flatnonzero(np.frombuffer(index, dtype=np.uint8) == 10) + 1
    return [0, *ends[:-1].tolist()] if len(ends) else []


def part_bounds(offsets: list[int], size: int, count: int) -> list[int]:
    """The ``count + 1`` byte bounds of an index of ``size`` bytes cut into ``count`` parts
    at line starts: part ``j`` holds the lines starting in ``[j * size / count, (j + 1) *
    size / count)``. Computed alike from the index (``line_offsets``) by its writer and
    from the root's ``fragments_at`` by a reader; a part may be empty."""
    import bisect

    starts = sorted(offsets)
    bounds = [0]
    for j in range(1, count):
        k = bisect.bisect_left(starts, -(-j * size // count))
        bounds.append(max(bounds[-1], starts[k] if k < len(starts) else size))
    return [*bounds, size] if count else [0]


def root_lines(doc: dict[str, Any]) -> dict[int, tuple[int, int]]:
    """``offset -> (length, crc32c)`` of every line an indexed root lists (unchecked
    entries are left out: the manifest's own parse names them)."""
    out: dict[int, tuple[int, int]] = {}
    for t in (doc.get("tensors") or {}).values():
        for c in (t.get("fragments_at") or []) if isinstance(t, dict) else []:
            if isinstance(c, list) and len(c) == 5 and all(_nat(x) for x in c[:3]):
                out[c[0]] = (c[1], c[2])
    return out
