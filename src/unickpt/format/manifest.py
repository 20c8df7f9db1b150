"""The manifest: the one JSON document that describes (and, by existing, commits) a checkpoint.

See docs/FORMAT.md for the normative description. Parsing validates everything a reader
relies on, so later layers can trust a ``Manifest`` object: known format version, file
names that cannot leave the checkpoint directory, pieces inside their tensors, byte ranges
inside their files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ..errors import FormatVersionError, ManifestError
from ..plan.box import Box
from ..plan.piece import Piece
from .dtypes import itemsize

FORMAT_NAME = "unickpt"
FORMAT_VERSION = (1, 0)
MANIFEST_NAME = "manifest.json"
DEFAULT_BLOCK_BYTES = 4 << 20

_SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")


def check_file_name(name: str) -> str:
    """Refuse any file name that is not a plain name inside the checkpoint directory."""
    if not isinstance(name, str) or not _SAFE_FILE.fullmatch(name) or ".." in name:
        raise ManifestError(f"unsafe file name {name!r} in manifest: only plain names inside the checkpoint are allowed")
    return name


@dataclass
class Fragment:
    """The data one rank stored for one global tensor: a contiguous row-major array in a file."""

    file: str
    offset: int
    shape: tuple[int, ...]
    pieces: list[Piece]
    crc32c: list[int]
    block_bytes: int = DEFAULT_BLOCK_BYTES
    rank: int = 0

    def nbytes(self, dtype: str) -> int:
        """Size of the fragment's data in bytes."""
        return prod(self.shape) * itemsize(dtype)


@dataclass
class TensorEntry:
    """A global logical tensor and the fragments that hold it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    fragments: list[Fragment] = field(default_factory=list)
    layout: str = ""

    @property
    def nbytes(self) -> int:
        """Size of the whole global tensor in bytes."""
        return prod(self.shape) * itemsize(self.dtype)


@dataclass
class Manifest:
    """Everything a reader needs to find, check and reshard the checkpoint's contents."""

    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    rank_values: dict[str, list[Any]] = field(default_factory=dict)
    rank_tensors: dict[str, list[TensorEntry | None]] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    world_size: int = 1
    provenance: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    version: tuple[int, int] = FORMAT_VERSION

    def to_json(self) -> str:
        """Serialise to the JSON text stored in ``manifest.json``."""
        doc = {
            "format": FORMAT_NAME,
            "version": f"{self.version[0]}.{self.version[1]}",
            "world_size": self.world_size,
            "provenance": self.provenance,
            "metadata": self.metadata,
            "files": self.files,
            "tensors": {n: _tensor_to_json(t) for n, t in self.tensors.items()},
            "values": self.values,
            "rank_values": self.rank_values,
            "rank_tensors": {
                n: [None if t is None else _tensor_to_json(t) for t in ts] for n, ts in self.rank_tensors.items()
            },
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)

    @staticmethod
    def from_json(text: str | bytes) -> Manifest:
        """Parse and validate manifest text."""
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError("manifest does not declare format 'unickpt'")
        version = _parse_version(doc.get("version"))
        try:
            files = {check_file_name(k): int(v) for k, v in doc.get("files", {}).items()}
            m = Manifest(
                tensors={n: _tensor_from_json(n, t, files) for n, t in doc.get("tensors", {}).items()},
                values=dict(doc.get("values", {})),
                rank_values={k: list(v) for k, v in doc.get("rank_values", {}).items()},
                rank_tensors={
                    n: [None if t is None else _tensor_from_json(n, t, files) for t in ts]
                    for n, ts in doc.get("rank_tensors", {}).items()
                },
                files=files,
                world_size=int(doc.get("world_size", 1)),
                provenance=dict(doc.get("provenance", {})),
                metadata=dict(doc.get("metadata", {})),
                version=version,
            )
        except ManifestError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"malformed manifest: {type(e).__name__}: {e}") from None
        return m


def _parse_version(text: Any) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in str(text).split("."))
    except ValueError:
        raise ManifestError(f"manifest has no valid version: {text!r}") from None
    if major > FORMAT_VERSION[0]:
        raise FormatVersionError(
            f"checkpoint format version {major}.{minor} is newer than this unickpt reads "
            f"({FORMAT_VERSION[0]}.x); upgrade unickpt to open it"
        )
    return major, minor


def _piece_to_json(p: Piece, fragment_shape: tuple[int, ...]) -> dict[str, Any]:
    d: dict[str, Any] = {"global": list(p.global_box.offsets), "lengths": list(p.global_box.lengths)}
    if any(p.local_offsets):
        d["local"] = list(p.local_offsets)
    if p.view != fragment_shape:
        d["view"] = list(p.view)
    if p.flat_offset:
        d["flat"] = p.flat_offset
    return d


def _piece_from_json(d: dict[str, Any], fragment_shape: tuple[int, ...]) -> Piece:
    lengths = tuple(int(x) for x in d["lengths"])
    return Piece(
        Box(tuple(int(x) for x in d["global"]), lengths),
        tuple(int(x) for x in d.get("local", [0] * len(lengths))),
        tuple(int(x) for x in d.get("view", fragment_shape)),
        int(d.get("flat", 0)),
    )


def fragment_to_json(f: Fragment) -> dict[str, Any]:
    """The JSON object of one fragment."""
    return {
        "rank": f.rank,
        "file": f.file,
        "offset": f.offset,
        "shape": list(f.shape),
        "block_bytes": f.block_bytes,
        "crc32c": f.crc32c,
        "pieces": [_piece_to_json(p, f.shape) for p in f.pieces],
    }


def fragment_from_json(fd: dict[str, Any]) -> Fragment:
    """Parse one fragment's JSON object (structure only; see ``_tensor_from_json`` for checks)."""
    shape = tuple(int(x) for x in fd["shape"])
    return Fragment(
        file=check_file_name(fd["file"]),
        offset=int(fd["offset"]),
        shape=shape,
        pieces=[_piece_from_json(p, shape) for p in fd["pieces"]],
        crc32c=[int(c) for c in fd["crc32c"]],
        block_bytes=int(fd.get("block_bytes", DEFAULT_BLOCK_BYTES)),
        rank=int(fd.get("rank", 0)),
    )


def _tensor_to_json(t: TensorEntry) -> dict[str, Any]:
    d: dict[str, Any] = {"shape": list(t.shape), "dtype": t.dtype}
    if t.layout:
        d["layout"] = t.layout
    d["fragments"] = [fragment_to_json(f) for f in t.fragments]
    return d


def _tensor_from_json(name: str, d: dict[str, Any], files: dict[str, int]) -> TensorEntry:
    t = TensorEntry(name, tuple(int(x) for x in d["shape"]), str(d["dtype"]), [], str(d.get("layout", "")))
    whole = Box.whole(t.shape)
    size = itemsize(t.dtype)
    for fd in d["fragments"]:
        frag = fragment_from_json(fd)
        shape = frag.shape
        nbytes = prod(shape) * size
        if frag.file not in files:
            raise ManifestError(f"tensor {name!r}: fragment file {frag.file!r} is not listed in the manifest")
        if frag.offset < 0 or frag.offset + nbytes > files[frag.file]:
            raise ManifestError(f"tensor {name!r}: fragment bytes lie outside file {frag.file!r}")
        if frag.block_bytes <= 0 or frag.block_bytes % size:
            raise ManifestError(f"tensor {name!r}: block_bytes {frag.block_bytes} is not a positive multiple of the item size {size}")
        if len(frag.crc32c) != max(1, -(-nbytes // frag.block_bytes)):
            raise ManifestError(f"tensor {name!r}: fragment in {frag.file!r} has a wrong number of checksums")
        n_local = prod(shape)
        for p in frag.pieces:
            if not whole.contains(p.global_box) or p.global_box.ndim != len(t.shape):
                raise ManifestError(f"tensor {name!r}: piece {p.global_box} lies outside shape {t.shape}")
            if p.flat_extent[1] > n_local:
                raise ManifestError(f"tensor {name!r}: piece reaches past its fragment's data")
        t.fragments.append(frag)
    return t
