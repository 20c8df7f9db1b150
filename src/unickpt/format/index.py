"""The indexed manifest (format 2.0): a small root ``manifest.json`` and ``fragments.jsonl``.

At thousands of ranks nearly all of a manifest is fragment lists, and a loading rank needs
only those of its own tensors. An indexed checkpoint keeps the root document as in 1.x
(``files``, ``values``, every tensor's shape, dtype and layout) but moves each tensor's
fragment list to one line of ``fragments.jsonl``, the same JSON array 1.x stores inline;
the root gives each tensor's ``fragments_at``: ``[offset, length, crc32c]`` of its line.
A reader parses the root, then only the lines of the tensors it touches, each checked
against its CRC-32C (the root itself is covered by its SHA-256 digest) and validated as
1.x fragments are. See docs/FORMAT.md, "Indexed manifests (2.0)".

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
    tensors: list[tuple[str, dict[str, Any], list[str]]],
    tail: dict[str, Any],
    indexed: bool,
) -> tuple[str, bytes | None]:
    """The manifest text (before sealing) and, when ``indexed``, the index file.

    ``head``: the members before ``tensors`` (format, version, world_size, provenance,
    metadata, files); ``tensors``: ``(name, tensor_head(...), [fragment JSON texts])``;
    ``tail``: the members after (values, rank_values, rank_tensors). Fragment texts are
    spliced in as they are (each rank serialised its own), so no fragment is parsed here.
    """
    parts = []
    index: list[bytes] = []
    at = 0
    for name, th, texts in tensors:
        line = "[" + ",".join(texts) + "]"
        if indexed:
            raw = line.encode()
            index.append(raw + b"\n")
            parts.append(json.dumps(name) + ":" + _join(th, "fragments_at", f"[{at},{len(raw)},{crc32c(raw)}]"))
            at += len(raw) + 1
        else:
            parts.append(json.dumps(name) + ":" + _join(th, "fragments", line))
    if indexed:
        head = dict(head, index={"file": INDEX_NAME, "size": at})
    text = _join(head, "tensors", "{" + ",".join(parts) + "}")
    rest = json.dumps(tail, separators=(",", ":"))
    if len(rest) > 2:
        text = text[:-1] + "," + rest[1:]
    return text, (b"".join(index) if indexed else None)


def index_range(d: Any, name: str, index_size: int) -> tuple[int, int, int]:
    """A tensor's ``fragments_at`` (offset, length, crc32c), checked to lie in the index."""
    if (
        not isinstance(d, list) or len(d) != 3
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in d)
        or d[2] > 0xFFFFFFFF or d[0] + d[1] > index_size
    ):
        raise ManifestError(f"malformed manifest: tensor {name!r}: fragments_at is {d!r:.60}, not [offset, length, crc32c] "
                            f"inside the index ({index_size} bytes)")
    return d[0], d[1], d[2]


def read_line(read_range: IndexReader | None, name: str, at: tuple[int, int, int]) -> bytes:
    """The bytes of a tensor's line of the index, checked against its CRC-32C."""
    if read_range is None:
        raise ManifestError(f"tensor {name!r}: its fragments are in {INDEX_NAME}, which this reader was not given")
    offset, length, crc = at
    raw = read_range(offset, length)
    if len(raw) != length:
        raise CorruptionError(f"{INDEX_NAME} is truncated: tensor {name!r} needs bytes {offset}-{offset + length}")
    if crc32c(raw) != crc:
        raise CorruptionError(f"checksum mismatch in {INDEX_NAME} (tensor {name!r}, bytes {offset}-{offset + length}): "
                              "the checkpoint's index was changed after it was written")
    return raw
