"""Hugging Face safetensors folders as checkpoints (import side; export: ``hf_export``).

An HF model folder holds ``model.safetensors`` or ``model-0000x-of-0000y.safetensors``
shards with ``model.safetensors.index.json`` (and usually ``config.json``).
:func:`read_hf` describes such a folder as an in-memory :class:`Manifest` whose fragments
point *into* the HF files (nothing is copied): every tensor is one fragment of one whole
piece, with no checksums (``crc32c=[]``, this format has none). ``unickpt load``,
``convert`` and ``verify`` then read it like any checkpoint. What transformers would not
load either (a tensor of a shard that the index maps elsewhere or not at all, a shard the
index does not list) is left out and named in ``provenance["skipped"]``.
"""

from __future__ import annotations

from typing import Any

from ..errors import NotACheckpointError, UnickptError
from ..format.dtypes import itemsize
from ..format.manifest import MANIFEST_NAME, Fragment, Manifest, TensorEntry, check_file_name
from ..format.safetensors_header import header_tensors, read_header
from ..format.values import encode_value, loads_json
from ..plan.box import Box
from ..plan.piece import Piece, whole_piece
from ..rules.hf import HfMapping, heads_from_config, hf_row_of
from ..storage.local import LocalStorage
from ..storage.open import open_storage

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


class HfError(UnickptError):
    """A Hugging Face folder cannot be read or written as asked."""


def is_hf(path: str) -> bool:
    """True when ``path`` is a folder of HF safetensors: ``model.safetensors.index.json``
    or ``*.safetensors`` files, and no ``manifest.json`` (that would be a unickpt checkpoint)."""
    files = open_storage(path).names()
    return MANIFEST_NAME not in files and (INDEX_NAME in files or any(f.endswith(".safetensors") for f in files))


def _read_json(storage: LocalStorage, name: str) -> Any:
    """The JSON document ``name`` of the folder (it exists); HfError naming it when it is
    not a regular file (a directory) or not JSON."""
    try:
        return loads_json(storage.read_small(name))
    except NotACheckpointError:
        raise HfError(f"{storage.root / name} cannot be read: not a regular file (a directory, a pipe)") from None
    except ValueError as e:
        raise HfError(f"{storage.root / name} is not valid JSON: {e}") from None


def _shard_files(storage: LocalStorage) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to read, and the index's weight map (None without an index)."""
    if storage.exists(INDEX_NAME):
        doc = _read_json(storage, INDEX_NAME)
        wmap = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise HfError(f"{storage.root / INDEX_NAME} has no valid weight_map")
        return sorted({check_file_name(f) for f in wmap.values()}), wmap
    files = [f for f in storage.names() if f.endswith(".safetensors")]
    if not files:
        raise HfError(f"{storage.root}: no *.safetensors files and no {INDEX_NAME}")
    return files, None


def _file_tensors(storage: LocalStorage, name: str) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """``{tensor: (dtype, shape, absolute data offset)}`` of one safetensors file, checked
    against the file's size; every error names the file."""
    where = str(storage.root / name)
    reader = storage.reader(name)
    header, data_start = read_header(reader, where)
    if not isinstance(header, dict):
        raise HfError(f"{where}: safetensors header is not a JSON object")
    return header_tensors(header, data_start, reader.size, where, HfError)


def _row_pieces(shape: tuple[int, ...], head_dim: int) -> list[Piece]:
    """Pieces of an HF q/k projection read as unickpt's interleaved-rotary rows: one row each."""
    rest = tuple(shape[1:])
    return [
        Piece(Box((r,) + (0,) * len(rest), (1,) + rest), (hf_row_of(r, head_dim),) + (0,) * len(rest), tuple(shape))
        for r in range(shape[0])
    ]


def read_hf(path: str, names: HfMapping | None = None, prefix: str = "") -> Manifest:
    """The HF safetensors folder at ``path`` as an in-memory manifest (see the module
    docstring); ``config.json``, when present, is kept as ``metadata["hf_config"]``.

    With ``names`` (e.g. ``unickpt.rules.hf.HF_LLAMA``) tensors get unickpt names (HF
    names the mapping does not know are kept), each prefixed by ``prefix`` (``"model."``
    for the example trainer's state); rotary q/k rows are reordered through the pieces,
    still without a copy (head counts from ``config.json``). A tied ``lm_head`` (no
    ``lm_head.weight``) is given as the embedding's fragment under the output's name.
    """
    storage = open_storage(path)
    try:
        files, wmap = _shard_files(storage)
        config = _read_json(storage, CONFIG_NAME) if storage.exists(CONFIG_NAME) else None
        m = Manifest(world_size=1, provenance={"format": "hf"})
        if isinstance(config, dict):
            m.metadata["hf_config"] = encode_value(config)
        heads = heads_from_config(config) if names is not None and isinstance(config, dict) else None
        found: dict[str, tuple[str, str, tuple[int, ...], int]] = {}
        unmapped: list[tuple[str, str]] = []
        for f in files:
            m.files[f] = storage.size(f)
            for key, (dtype, shape, offset) in _file_tensors(storage, f).items():
                if wmap is not None and wmap.get(key) != f:
                    unmapped.append((key, f))
                    continue
                if key in found:
                    raise HfError(f"{path}: tensor {key!r} is in both {found[key][0]} and {f}")
                found[key] = (f, dtype, shape, offset)
        skipped: dict[str, str] = {}
        for key, f in unmapped:  # transformers loads by the index: it does not see these
            skipped[key if key not in found else f"{key} (copy in {f})"] = f"{INDEX_NAME} does not map it to {f}"
        if wmap is not None:
            for f in storage.names():
                if f.endswith(".safetensors") and f not in files:
                    skipped[f] = f"{INDEX_NAME} maps no tensor to this file"
        missing = sorted(set(wmap or ()) - set(found))
        if missing:
            raise HfError(f"{path}: {len(missing)} tensors of the index are not in their files, e.g. {missing[0]!r}")
        for key, (f, dtype, shape, offset) in found.items():
            pieces = [whole_piece(shape)]
            name = key
            if names is not None:
                mapped = names.our_name(key)
                if mapped is not None:
                    name, rotary = mapped
                    if rotary is not None:
                        if heads is None:
                            raise HfError(f"{path}: no config.json with num_attention_heads: cannot reorder {key!r} rows")
                        n = heads[rotary]
                        if len(shape) < 1 or shape[0] % n or (shape[0] // n) % 2:
                            raise HfError(f"{path}: {key!r} has {shape[0] if shape else 0} rows, not {n} heads of an even size")
                        pieces = _row_pieces(shape, shape[0] // n)
            frag = Fragment(file=f, offset=offset, shape=shape, pieces=pieces, crc32c=[], block_bytes=itemsize(dtype))
            m.tensors[prefix + name] = TensorEntry(prefix + name, shape, dtype, [frag], "hf")
        if names is not None and "lm_head.weight" not in found:
            embed = names.our_name("model.embed_tokens.weight")
            out = names.our_name("lm_head.weight")
            tied = isinstance(config, dict) and config.get("tie_word_embeddings") is True
            if embed and out and prefix + embed[0] in m.tensors and tied:
                e = m.tensors[prefix + embed[0]]
                m.tensors[prefix + out[0]] = TensorEntry(prefix + out[0], e.shape, e.dtype, list(e.fragments), "hf (tied)")
        if names is not None:
            m.provenance["names"] = names.name
        if skipped:
            m.provenance["skipped"] = skipped
        return m
    finally:
        storage.close()
