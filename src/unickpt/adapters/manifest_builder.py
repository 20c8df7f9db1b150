"""The manifest a reader of pickle archives builds, and its ledger: one base under the
DeepSpeed (:mod:`unickpt.adapters.deepspeed`) and legacy Megatron-LM
(:mod:`unickpt.adapters.megatron_legacy`) readers.

Every reader accounts for every tensor of its source: read (an entry of the manifest),
skipped (``skip``: why, in the ledger), or a further copy of data read elsewhere
(``replica``). Every byte of every archive it opens is owned by one of them, or is the
archive's structure (``own``, ``archive``), so the ledger
(:func:`~unickpt.adapters.regions.source_ledger`) can check nothing is left unaccounted.

Plain values (a step, the trainer's arguments, a scheduler's state) are kept as manifest
values in their plain form (:meth:`ManifestBuilder.plain`). One rule for a value that has
none (an object of a class unickpt does not build, nesting too deep): it is recorded in
the ledger as skipped, with the reason, never dropped silently nor kept as its ``repr``.
"""

from __future__ import annotations

import argparse
from typing import Any, ClassVar

from ..errors import CorruptionError, UnickptError
from ..format.dtypes import itemsize
from ..format.manifest import Manifest, TensorEntry
from ..format.values import encode_value
from ..storage.open import open_storage
from ..format.ledger import Region
from .torch_archive import InertRecord, StoredTensor, archive_layout, read_archive, stored_tensors

__all__ = ["ManifestBuilder"]


class ManifestBuilder:
    """The manifest being built from the pickle archives under ``root`` (each named
    relative to ``root`` behind ``prefix``), with the ledger's regions of every file read,
    the tensors skipped and the replicas (name -> why)."""

    # pickled objects read as their attributes (a Namespace: Megatron's args)
    RECORDS: ClassVar[tuple[type, ...]] = (argparse.Namespace,)

    def __init__(self, root: str, prefix: str, allowed: dict[tuple[str, str], Any]) -> None:
        self.storage = open_storage(root)
        self.prefix = prefix
        self.allowed = allowed  # the unpickler's allow-list
        self.manifest = Manifest()
        self.skipped: dict[str, str] = {}
        self.replicas: dict[str, str] = {}
        self.regions: dict[str, list[Region]] = {}  # per file: its zip structure, padding and owned storages
        self.spans: dict[str, dict[int, tuple[int, int]]] = {}  # per file: each storage record's byte span

    def archive(self, name: str) -> Any:
        """The unpickled content of the archive ``prefix + name`` (allow-listed), its size and
        zip structure accounted."""
        rel = self.prefix + name
        self.manifest.files[rel] = self.storage.size(rel)
        obj = read_archive(self.storage, rel, allowed=self.allowed)
        layout = archive_layout(self.storage, rel)
        self.regions.setdefault(rel, []).extend(Region(rel, a, b) for a, b in layout.structure)
        self.spans[rel] = layout.storages
        return obj

    def own(self, owner: str | None, t: Any, at: int = 0, numel: int | None = None) -> None:
        """Declare the bytes of stored tensor ``t`` (its whole storage record, or elements
        ``[at, at + numel)`` of the tensor; every tensor's storage record inside a nested
        value) as owned by ``owner`` (None: structure, such as alignment padding)."""
        if not isinstance(t, StoredTensor):
            if numel is None:  # a nested value (a skipped RNG state...): every tensor inside it
                for inner in stored_tensors(t):
                    self.own(owner, inner)
            return
        if numel is None:
            start, stop = self.spans.get(t.file, {}).get(t.storage_at, (t.offset, t.offset + t.nbytes))
        else:
            size = itemsize(t.dtype)
            start = t.offset + at * size
            stop = start + numel * size
        if stop > start:
            self.regions.setdefault(t.file, []).append(Region(t.file, start, stop, owner))

    def skip(self, name: str, reason: str, t: Any = None, at: int = 0, numel: int | None = None) -> None:
        """Account for a tensor (or value) of the source that the manifest leaves out
        (``t``: its bytes, or elements ``[at, at + numel)`` of it)."""
        self.skipped[name] = reason
        self.own(name, t, at, numel)

    def replica(self, name: str, reason: str, t: Any = None, at: int = 0, numel: int | None = None) -> None:
        """Account for a further copy of data the manifest reads from another copy (``t``:
        its bytes, or elements ``[at, at + numel)`` of it)."""
        self.replicas[name] = reason
        self.own(name, t, at, numel)

    def value(self, key: str, value: Any) -> bool:
        """Keep ``value`` as the manifest value ``key`` in its plain form; a value with
        none is recorded in the ledger as skipped, with why. True when kept."""
        try:
            self.manifest.values[key] = encode_value(self.plain(value, key), key)
        except UnickptError as e:  # the one rule: reported, never dropped silently
            self.skipped[key] = f"a value with no plain form, not kept: {e}"
            return False
        return True

    def plain(self, obj: Any, key: str = "") -> Any:
        """A JSON-encodable copy of a pickled value: stored tensors become None (they are
        read as tensors of their own), records (:attr:`RECORDS`) dicts of their attributes,
        torch's dtypes, layouts and devices their text (``"torch.bfloat16"``), sets lists.
        Raises :class:`~unickpt.UnickptError` naming ``key`` for anything else (an object
        of a class unickpt does not build)."""
        if isinstance(obj, StoredTensor):
            return None
        if isinstance(obj, self.RECORDS):
            return {k: self.plain(v, f"{key}.{k}") for k, v in vars(obj).items()}
        if isinstance(obj, dict):
            return {k if isinstance(k, (int, str)) else str(k): self.plain(v, f"{key}.{k}") for k, v in obj.items()}
        if isinstance(obj, tuple):
            return tuple(self.plain(v, f"{key}[{i}]") for i, v in enumerate(obj))
        if isinstance(obj, (list, set, frozenset)):
            return [self.plain(v, f"{key}[{i}]") for i, v in enumerate(obj)]
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        if _torch_name(obj):
            return str(obj)
        what = obj.global_name if isinstance(obj, InertRecord) else type(obj).__name__
        raise UnickptError(f"{key!r} holds a {what}, an object unickpt does not build")

    def entry(self, name: str, shape: tuple[int, ...], dtype: str, layout: str, where: str = "") -> TensorEntry:
        """The manifest entry of tensor ``name`` (made on first sight); its fragments must
        agree on shape and dtype (``where``: the file of the one added, for the error)."""
        e = self.manifest.tensors.get(name)
        if e is None:
            e = self.manifest.tensors[name] = TensorEntry(name, tuple(shape), dtype, [], layout)
        elif e.shape != tuple(shape) or e.dtype != dtype:
            raise CorruptionError(f"{name!r}: fragments disagree on its shape or dtype ({list(e.shape)} {e.dtype} vs "
                                  f"{list(shape)} {dtype}{', in ' + where if where else ''})")
        return e

    def account(self, manifest: Manifest, regions: dict[str, list[Region]] | None) -> None:
        """Write the ledger's accounts into ``manifest`` (skipped, replicas) and give the
        regions of every file read to ``regions`` when given."""
        if self.skipped:
            manifest.provenance["skipped"] = dict(self.skipped)
        if self.replicas:
            manifest.provenance["replicas"] = dict(self.replicas)
        if regions is not None:
            regions.update(self.regions)


def _torch_name(obj: Any) -> bool:
    """A torch dtype, layout, memory format or device (the real object: torch is imported;
    without torch the unpickler gives their text already)."""
    module = type(obj).__module__
    return module == "torch" and type(obj).__name__ in ("dtype", "layout", "memory_format", "device")
