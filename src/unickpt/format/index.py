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
from typing import Any

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


def manifest_documents(
    head: dict[str, Any],
    tensors: list[tuple[str, dict[str, Any], list[bytes], list[tuple[list[int], list[int]]]]],
    tail: dict[str, Any],
    indexed: bool,
) -> tuple[str, bytes | None]:
    """The manifest text (before sealing) and, when ``indexed``, the index file.

    ``head``: the members before ``tensors`` (format, version, world_size, provenance,
    metadata, files); ``tensors``: ``(name, tensor_head(...), [fragment JSON texts, UTF-8],
    [bounding box (offsets, lengths) of each fragment])``; ``tail``: the members after
    (values, rank_values, rank_tensors). Fragment texts are spliced in as they are (each
    rank serialised its own), so no fragment is parsed here. Indexed, a tensor's fragments
    are sorted by their boxes and cut into lines of ``CHUNK_FRAGMENTS``, each listed in the
    root with its place in the index, CRC-32C and bounding box.
    """
    parts = []
    index: list[bytes] = []
    at = 0
    for name, th, texts, boxes in tensors:
        if not indexed:
            parts.append(json.dumps(name) + ":" + _join(th, "fragments", "[" + b",".join(texts).decode() + "]"))
            continue
        order = sorted(range(len(texts)), key=boxes.__getitem__)
        chunks = []
        for c in range(0, len(order), CHUNK_FRAGMENTS):
            ks = order[c : c + CHUNK_FRAGMENTS]
            raw = b"[" + b",".join([texts[k] for k in ks]) + b"]"
            index.append(raw + b"\n")
            lo = list(map(min, zip(*[boxes[k][0] for k in ks])))
            hi = list(map(max, zip(*[[o + n for o, n in zip(*boxes[k])] for k in ks])))
            chunks.append([at, len(raw), crc32c(raw), lo, [h - o for h, o in zip(hi, lo)]])
            at += len(raw) + 1
        parts.append(json.dumps(name) + ":" + _join(th, "fragments_at", json.dumps(chunks, separators=(",", ":"))))
    if indexed:
        head = dict(head, index={"file": INDEX_NAME, "size": at})
    text = _join(head, "tensors", "{" + ",".join(parts) + "}")
    rest = json.dumps(tail, separators=(",", ":"))
    if len(rest) > 2:
        text = text[:-1] + "," + rest[1:]
    return text, (b"".join(index) if indexed else None)


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
