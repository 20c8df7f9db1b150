"""The manifest: the one JSON document that describes (and, by existing, commits) a checkpoint.

See docs/FORMAT.md for the normative description. Parsing validates everything a reader
relies on, so later layers can trust a ``Manifest`` object: known format version, file
names that cannot leave the checkpoint directory, pieces inside their tensors, byte ranges
inside their files, integers of sane magnitude, per-rank rows of ``world_size`` entries,
values that decode. A hostile or damaged manifest therefore raises a ``ManifestError`` (or,
when its digest does not match, a ``CorruptionError``), never another exception.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ..errors import CorruptionError, FormatVersionError, LayoutError, ManifestError
from ..plan.box import Box
from ..plan.piece import Piece
from .dtypes import DTYPES as _DTYPE_NAMES  # names known without torch
from .dtypes import itemsize
from .refs import BaseRef, check_base_path, check_digest_text, ref_key, split_key
from .index import INDEX_NAME, INDEXED_VERSION, IndexReader, index_chunks, read_line
from .values import check_text, decode_value

FORMAT_NAME = "unickpt"
FORMAT_VERSION = (1, 2)
DIGEST_SINCE = (1, 1)  # manifests of this version on carry a digest
DIGEST_ALGORITHM = "sha256"
_DIGEST_TAIL = re.compile(rb',"digest":"sha256:([0-9a-f]{64})"\}\s*\Z')
# bounds a parsed manifest must respect (a hostile one cannot make readers allocate or loop)
MAX_INT = (1 << 63) - 1  # byte offsets and sizes
MAX_DIM = 1 << 48  # one dimension of a shape
MAX_NDIM = 64
MAX_WORLD_SIZE = 1 << 24
MAX_DEPTH = 100  # nesting of free-form JSON (provenance)
MANIFEST_NAME = "manifest.json"
DEFAULT_BLOCK_BYTES = 4 << 20

_SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")
_IDENTITY = re.compile(r"^[0-9a-f]{32}$")


def check_file_name(name: str) -> str:
    """Refuse any file name that is not a plain name inside the checkpoint directory."""
    if not isinstance(name, str) or not _SAFE_FILE.fullmatch(name) or ".." in name:
        raise ManifestError(f"unsafe file name {name!r} in manifest: only plain names inside the checkpoint are allowed")
    return name


def check_fragment_file(key: str) -> str:
    """A fragment's file: a plain name in the checkpoint, or ``<base path>/<plain name>``
    in a base checkpoint that holds referenced bytes (format 1.2; the base must be listed
    in the manifest's ``bases``, which the caller checks through ``files``)."""
    base, name = split_key(key) if isinstance(key, str) else (None, key)
    if base is not None:
        try:
            check_base_path(base)
            check_file_name(name)
        except ManifestError:
            raise ManifestError(f"unsafe file name {key!r:.300} in manifest: only plain names inside the checkpoint, "
                                "or plain names in a listed base checkpoint, are allowed") from None
    check_file_name(name)
    return key


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
    # identity of the data (checksum.identity: xxh3-128 of the blocks' xxh3-128), 1.2 on
    xxh3: str | None = None

    @property
    def base(self) -> str | None:
        """Path (relative to the checkpoint) of the base checkpoint holding this fragment's
        bytes, or None when the checkpoint holds them itself (unickpt manifests only: the
        files of other formats, read in place, may lie in subdirectories)."""
        return split_key(self.file)[0]

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

    def fragments_touching(self, boxes: list[Box]) -> list[Fragment]:
        """The fragments a reader of ``boxes`` (global boxes) must consider: all of them
        here; an indexed manifest's entry reads only those near the boxes."""
        return self.fragments


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
    # incremental checkpoints (1.2): the checkpoints holding referenced bytes (``files``
    # also lists their referenced files, under ``<base path>/<name>``), and the base this
    # one was saved against: {"base": path, "digest": its digest, "depth": saves since a full one}
    bases: dict[str, BaseRef] = field(default_factory=dict)
    incremental: dict[str, Any] | None = None
    # the digest checked when the manifest was parsed ("sha256:<hex>"); None when the
    # manifest has none (format 1.0) or was built in memory
    digest: str | None = field(default=None, compare=False)

    def tensor_bytes(self) -> int:
        """Bytes of tensor data a consolidation writes (global and per-rank tensors that
        have fragments): the total for a progress bar."""
        n = sum(e.nbytes for e in self.tensors.values() if e.fragments)
        return n + sum(e.nbytes for row in self.rank_tensors.values() for e in row if e is not None and e.fragments)

    def to_json(self) -> str:
        """Serialise to the JSON text stored in ``manifest.json``, sealed with its digest."""
        doc = {
            "format": FORMAT_NAME,
            # this method writes fragments inline: an indexed (2.0) manifest becomes a 1.x one
            "version": "{}.{}".format(*(self.version if self.version < INDEXED_VERSION else FORMAT_VERSION)),
            "world_size": self.world_size,
            "provenance": self.provenance,
            "metadata": self.metadata,
            "files": {k: v for k, v in self.files.items() if split_key(k)[0] is None},
            **_refs_to_json(self),
            "tensors": {n: _tensor_to_json(t) for n, t in self.tensors.items()},
            "values": self.values,
            "rank_values": self.rank_values,
            "rank_tensors": {
                n: [None if t is None else _tensor_to_json(t) for t in ts] for n, ts in self.rank_tensors.items()
            },
        }
        return seal(json.dumps(doc, separators=(",", ":"), allow_nan=False))

    @staticmethod
    def from_json(text: str | bytes, index: IndexReader | None = None) -> Manifest:
        """Parse and validate manifest text: structure, types and ranges first (a
        :class:`~unickpt.ManifestError` says what is wrong), then the digest (a
        :class:`~unickpt.CorruptionError` when the text was changed after it was written).

        ``index(offset, length) -> bytes`` reads the index file of an indexed manifest
        (format 2.0, ``format/index.py``): each tensor's fragments are read, checked and
        parsed when first used."""
        raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
        doc = _parse_json(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError("manifest does not declare format 'unickpt'")
        version = _parse_version(doc.get("version"))
        digest = doc.pop("digest", None)
        try:
            m = _manifest_from_doc(doc, version, index)
        except ManifestError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError, IndexError) as e:
            raise ManifestError(f"malformed manifest: {type(e).__name__}: {e}") from None
        m.digest = _check_digest(raw, digest, version)
        return m


def seal(text: str) -> str:
    """``text`` (a manifest's JSON object, compact, without a digest) with its digest
    appended as the last member: ``..., "digest":"sha256:<hex>"}`` where ``<hex>`` is the
    SHA-256 of ``text`` itself (see docs/FORMAT.md, "Manifest digest")."""
    if not text.endswith("}") or text == "{}":
        raise ValueError("seal() takes a non-empty JSON object")
    return f'{text[:-1]},"digest":"{DIGEST_ALGORITHM}:{hashlib.sha256(text.encode("utf-8")).hexdigest()}"}}'


def _check_digest(raw: bytes, digest: Any, version: tuple[int, int]) -> str | None:
    if digest is None:
        if version >= DIGEST_SINCE:
            raise ManifestError(
                f"manifest of format {version[0]}.{version[1]} has no digest (every writer of this format adds one): "
                "it was edited after it was written"
            )
        return None
    tail = _DIGEST_TAIL.match(raw, max(0, raw.rfind(b',"digest":"')))
    if tail is None:
        raise ManifestError(
            f"manifest digest {digest!r:.80} is not in its place (the last member, written compactly): "
            "manifest.json was rewritten after it was saved"
        )
    expected = tail.group(1).decode("ascii")
    got = hashlib.sha256(raw[: tail.start()] + b"}").hexdigest()
    if got != expected:
        raise CorruptionError(
            f"manifest digest mismatch: manifest.json was changed after it was written "
            f"(recorded sha256 {expected[:16]}..., content hashes to {got[:16]}...)"
        )
    return f"{DIGEST_ALGORITHM}:{expected}"


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        raise ManifestError("manifest is not valid: JSON nested too deeply") from None
    except UnicodeDecodeError as e:
        raise ManifestError(f"manifest is not valid UTF-8: {e}") from None
    except ValueError as e:
        raise ManifestError(f"manifest is not valid JSON: {e}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _manifest_from_doc(doc: dict[str, Any], version: tuple[int, int], index: IndexReader | None = None) -> Manifest:
    world = _int(doc.get("world_size", 1), "world_size", 1, MAX_WORLD_SIZE)
    files = {check_file_name(k): _int(v, f"size of file {k!r}") for k, v in _dict(doc.get("files", {}), "files").items()}
    bases = _bases_from_json(doc.get("bases", {}))
    for b in bases.values():
        files.update({ref_key(b.path, n): size for n, size in b.files.items()})
    incremental = _incremental_from_json(doc["incremental"]) if "incremental" in doc else None
    total = sum(files.values())
    raw_tensors = _dict(doc.get("tensors", {}), "tensors")
    if version >= INDEXED_VERSION:
        at = _dict(doc.get("index"), "index")
        if at.get("file") != INDEX_NAME:
            raise ManifestError(f"malformed manifest: index file is {at.get('file')!r:.40}, not {INDEX_NAME!r}")
        size = _int(at.get("size"), "index size")
        tensors: dict[str, TensorEntry] = {
            n: IndexedTensorEntry.parse(n, t, files, total, world, size, index) for n, t in raw_tensors.items()
        }
    else:
        tensors = {n: _tensor_from_json(n, t, files, total, world) for n, t in raw_tensors.items()}
    values = _dict(doc.get("values", {}), "values")
    for k, v in values.items():
        decode_value(v, k)
    rank_values = {}
    for k, row in _dict(doc.get("rank_values", {}), "rank_values").items():
        _rank_row(row, f"rank_values {k!r}", world)
        for v in row:
            decode_value(v, k)
        rank_values[k] = list(row)
    rank_tensors = {}
    for n, row in _dict(doc.get("rank_tensors", {}), "rank_tensors").items():
        _rank_row(row, f"rank_tensors {n!r}", world)
        rank_tensors[n] = [None if t is None else _tensor_from_json(n, t, files, total, world) for t in row]
    metadata = _dict(doc.get("metadata", {}), "metadata")
    decode_value(metadata, "metadata")
    provenance = _dict(doc.get("provenance", {}), "provenance")
    _check_plain(provenance, "provenance")
    return Manifest(
        tensors=tensors, values=dict(values), rank_values=rank_values, rank_tensors=rank_tensors, files=files,
        world_size=world, provenance=dict(provenance), metadata=dict(metadata), version=version,
        bases=bases, incremental=incremental,
    )


def _refs_to_json(m: Manifest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if m.bases:
        out["bases"] = {p: {"digest": b.digest, "files": b.files} for p, b in m.bases.items()}
    if m.incremental is not None:
        out["incremental"] = m.incremental
    return out


def _bases_from_json(doc: Any) -> dict[str, BaseRef]:
    out = {}
    for path, d in _dict(doc, "bases").items():
        d = _dict(d, f"base {path!r}")
        files = {check_file_name(k): _int(v, f"size of file {k!r} of base {path!r}") for k, v in _dict(d["files"], "base files").items()}
        out[check_base_path(path)] = BaseRef(path, check_digest_text(d["digest"], f"base {path!r}"), files)
    return out


def _incremental_from_json(doc: Any) -> dict[str, Any]:
    d = _dict(doc, "incremental")
    return {
        "base": check_base_path(d["base"]),
        "digest": check_digest_text(d["digest"], "incremental base"),
        "depth": _int(d["depth"], "incremental depth", 1, MAX_INT),
    }


def _brief(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"an integer of {v.bit_length()} bits"
    return f"{v!r:.40}"


def _int(v: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """``v`` when it is an integer (not a bool, not a float) in ``[lo, hi]``."""
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ManifestError(f"malformed manifest: {what} is {_brief(v)}, not an integer in [{lo}, {hi}]")
    return v


def _ints(v: Any, what: str, hi: int = MAX_INT) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise ManifestError(f"malformed manifest: {what} is {_brief(v)}, not a list of at most {MAX_NDIM} integers")
    return tuple(_int(x, what, 0, hi) for x in v)


def _dict(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ManifestError(f"malformed manifest: {what} is {_brief(v)}, not an object")
    return v


def _rank_row(row: Any, what: str, world: int) -> None:
    if not isinstance(row, list) or len(row) != world:
        n = len(row) if isinstance(row, list) else _brief(row)
        raise ManifestError(f"malformed manifest: {what} holds {n} entries, world_size is {world} (one per rank)")


def _check_plain(obj: Any, what: str) -> None:
    """Free-form JSON (provenance): at most ``MAX_DEPTH`` deep, every string valid Unicode."""
    stack = [(obj, 0)]
    while stack:
        o, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ManifestError(f"malformed manifest: {what} is nested more than {MAX_DEPTH} levels deep")
        if isinstance(o, str):
            check_text(o, what)
        elif isinstance(o, dict):
            for k, v in o.items():
                check_text(k, what)
                stack.append((v, depth + 1))
        elif isinstance(o, list):
            stack.extend((v, depth + 1) for v in o)


def _parse_version(text: Any) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in str(text).split("."))
    except ValueError:
        raise ManifestError(f"manifest has no valid version: {text!r:.40}") from None
    if major > INDEXED_VERSION[0]:
        raise FormatVersionError(
            f"checkpoint format version {major}.{minor} is newer than this unickpt reads "
            f"({FORMAT_VERSION[0]}.x and {INDEXED_VERSION[0]}.x); upgrade unickpt to open it"
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


def _piece_from_json(d: Any, fragment_shape: tuple[int, ...]) -> Piece:
    d = _dict(d, "a piece")
    lengths = _ints(d["lengths"], "piece lengths")
    return Piece(
        Box(_ints(d["global"], "piece offsets"), lengths),
        _ints(d["local"], "piece local offsets") if "local" in d else (0,) * len(lengths),
        _ints(d["view"], "piece view", MAX_DIM) if "view" in d else fragment_shape,
        _int(d.get("flat", 0), "piece flat offset"),
    )


def fragment_to_json(f: Fragment) -> dict[str, Any]:
    """The JSON object of one fragment."""
    d = {
        "rank": f.rank,
        "file": f.file,
        "offset": f.offset,
        "shape": list(f.shape),
        "block_bytes": f.block_bytes,
        "crc32c": f.crc32c,
        "pieces": [_piece_to_json(p, f.shape) for p in f.pieces],
    }
    if f.xxh3 is not None:
        d["xxh3"] = f.xxh3
    return d


def fragment_from_json(fd: Any) -> Fragment:
    """Parse one fragment's JSON object (structure only; see ``_tensor_from_json`` for checks)."""
    fd = _dict(fd, "a fragment")
    shape = _ints(fd["shape"], "fragment shape", MAX_DIM)
    crcs = fd["crc32c"]
    if not isinstance(crcs, list):
        raise ManifestError(f"malformed manifest: fragment checksums are {_brief(crcs)}, not a list")
    pieces = fd["pieces"]
    if not isinstance(pieces, list):
        raise ManifestError(f"malformed manifest: fragment pieces are {_brief(pieces)}, not a list")
    xxh3 = fd.get("xxh3")
    if xxh3 is not None and not (isinstance(xxh3, str) and _IDENTITY.fullmatch(xxh3)):
        raise ManifestError(f"malformed manifest: fragment identity {_brief(xxh3)} is not 32 hex digits")
    return Fragment(
        file=check_fragment_file(fd["file"]),
        offset=_int(fd["offset"], "fragment offset", -MAX_INT),  # negative: "outside file" below
        shape=shape,
        pieces=[_piece_from_json(p, shape) for p in pieces],
        crc32c=[_int(c, "a checksum", 0, 0xFFFFFFFF) for c in crcs],
        block_bytes=_int(fd.get("block_bytes", DEFAULT_BLOCK_BYTES), "block_bytes", 1, MAX_INT),
        rank=_int(fd.get("rank", 0), "fragment rank", 0, MAX_WORLD_SIZE),
        xxh3=xxh3,
    )


def _tensor_to_json(t: TensorEntry) -> dict[str, Any]:
    d: dict[str, Any] = {"shape": list(t.shape), "dtype": t.dtype}
    if t.layout:
        d["layout"] = t.layout
    d["fragments"] = [fragment_to_json(f) for f in t.fragments]
    return d


def _tensor_from_json(name: str, d: Any, files: dict[str, int], total_bytes: int, world: int) -> TensorEntry:
    check_text(name, "tensor name")
    d = _dict(d, f"tensor {name!r}")
    dtype = d["dtype"]
    try:
        itemsize(dtype)
    except (LayoutError, TypeError):
        raise ManifestError(f"tensor {name!r}: unknown dtype {_brief(dtype)}") from None
    layout = d.get("layout", "")
    if not isinstance(layout, str):
        raise ManifestError(f"tensor {name!r}: layout is {_brief(layout)}, not a string")
    t = TensorEntry(name, _ints(d["shape"], f"tensor {name!r}: shape", MAX_DIM), dtype, [], check_text(layout, name))
    if t.nbytes > total_bytes:
        raise ManifestError(
            f"tensor {name!r}: shape {_brief(list(t.shape))} needs {t.nbytes} bytes, more than all the checkpoint's "
            f"files hold ({total_bytes})"
        )
    whole = Box.whole(t.shape)
    size = itemsize(t.dtype)
    fragments = d["fragments"]
    if not isinstance(fragments, list):
        raise ManifestError(f"tensor {name!r}: fragments are {_brief(fragments)}, not a list")
    for fd in fragments:
        frag = fragment_from_json(fd)
        shape = frag.shape
        nbytes = prod(shape) * size
        if frag.file not in files and frag.base is not None:
            raise ManifestError(f"unsafe file name {frag.file!r} in manifest: {frag.base!r} is not a base listed in the manifest")
        if frag.file not in files:
            raise ManifestError(f"tensor {name!r}: fragment file {frag.file!r} is not listed in the manifest")
        if frag.offset < 0 or frag.offset + nbytes > files[frag.file]:
            raise ManifestError(f"tensor {name!r}: fragment bytes lie outside file {frag.file!r}")
        if frag.rank >= world:
            raise ManifestError(f"tensor {name!r}: a fragment of rank {frag.rank}, world_size is {world}")
        if frag.block_bytes % size:
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


class IndexedTensorEntry(TensorEntry):
    """A tensor of an indexed manifest (format 2.0): its fragments are read from lines of
    the index file, checked and validated like inline ones, when first used; a reader
    that needs only some boxes reads only the lines whose bounding box meets them."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, layout: str, chunks: Any, context: tuple) -> None:
        super().__init__(name, shape, dtype, [], layout)
        self._fragments: list[Fragment] | None = None
        self._raw_chunks, self._context = chunks, context
        self._chunks: list[tuple[int, int, int, tuple[int, ...], tuple[int, ...]]] | None = None
        self._loaded: dict[int, list[Fragment]] = {}

    @property  # type: ignore[override]
    def fragments(self) -> list[Fragment]:
        """Every fragment (its lines read from the index on first use)."""
        if self._fragments is None:
            self._fragments = self._load(range(len(self._chunk_list())))
        return self._fragments

    @fragments.setter
    def fragments(self, value: list[Fragment]) -> None:
        self._fragments = value

    def fragments_touching(self, boxes: list[Box]) -> list[Fragment]:
        """The fragments of the lines whose bounding box meets one of ``boxes`` (every
        fragment holding an element of them, and a few neighbours)."""
        if self._fragments is not None:
            return self._fragments
        chunks = self._chunk_list()
        return self._load([k for k, c in enumerate(chunks) if any(_meets(c[3], c[4], b) for b in boxes)])

    def _chunk_list(self) -> list[tuple[int, int, int, tuple[int, ...], tuple[int, ...]]]:
        if self._chunks is None:
            self._chunks = index_chunks(self._raw_chunks, self.name, len(self.shape), self._context[3])
        return self._chunks

    def _load(self, which: Any) -> list[Fragment]:
        files, total, world, _, index, head = self._context
        out: list[Fragment] = []
        for k in which:
            if k not in self._loaded:
                off, length, crc, lo, lens = self._chunk_list()[k]
                line = _parse_json(read_line(index, self.name, off, length, crc))
                frags = _tensor_from_json(self.name, dict(head, fragments=line), files, total, world).fragments
                box = Box(lo, lens)
                if any(not box.contains(p.global_box) for f in frags for p in f.pieces):
                    raise ManifestError(f"malformed manifest: tensor {self.name!r}: a fragment lies outside the box its "
                                        f"line of {INDEX_NAME} is listed with")
                self._loaded[k] = frags
            out.extend(self._loaded[k])
        return out

    @staticmethod
    def parse(
        name: str, d: Any, files: dict[str, int], total: int, world: int, index_size: int, index: IndexReader | None
    ) -> IndexedTensorEntry:
        """A root entry ``{shape, dtype, layout, fragments_at}``, validated; fragments later."""
        if type(d) is not dict:
            raise ManifestError(f"malformed manifest: tensor {name!r} is {_brief(d)}, not an object")
        if "fragments" in d:
            raise ManifestError(f"malformed manifest: tensor {name!r} lists fragments inline in an indexed manifest")
        head = {k: d[k] for k in ("shape", "dtype", "layout") if k in d}
        shape, dtype, layout = d.get("shape"), d.get("dtype"), d.get("layout", "")
        if (
            type(shape) is list and len(shape) <= MAX_NDIM and all(type(x) is int and 0 <= x <= MAX_DIM for x in shape)
            and dtype in _DTYPE_NAMES and type(layout) is str and name.isascii() and layout.isascii()
            and prod(shape) * itemsize(dtype) <= total
        ):  # the common case, checked fast; anything else gets the full check and its message
            t = TensorEntry(name, tuple(shape), dtype, [], layout)
        else:
            t = _tensor_from_json(name, dict(head, fragments=[]), files, total, world)
        return IndexedTensorEntry(t.name, t.shape, t.dtype, t.layout, d.get("fragments_at"),
                                  (files, total, world, index_size, index, head))


def _meets(offsets: tuple[int, ...], lengths: tuple[int, ...], b: Box) -> bool:
    return all(o < bo + bn and bo < o + n for o, n, bo, bn in zip(offsets, lengths, b.offsets, b.lengths))
