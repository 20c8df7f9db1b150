"""The ledger of a checkpoint on disk: which byte ranges of its data files are what.

:func:`source_ledger` builds the :class:`~unickpt.format.ledger.Ledger` of the checkpoint
at a path (any format ``open_manifest`` reads), declaring the regions of each data file
whose format it knows:

* safetensors files (unickpt's ``rank_*.safetensors``, Hugging Face shards): the header is
  structure, each header entry's data range is owned by that entry's name. The format
  packs tensors back to back, so any other byte is unaccounted;
* PyTorch DCP ``.distcp`` files: each item of ``.metadata``'s storage index is an archive
  owned by the item's name (its zip records and pickle are the item's structure, its
  tensor bytes the fragments). Bytes outside every item are unaccounted; a ``.distcp``
  file no item points into is a leftover of an earlier save into the same directory
  (DCP overwrites files, it never removes them) and is listed as ignored.

* DeepSpeed's ``*.pt`` files (``torch.save`` zip archives): the DeepSpeed reader declares
  each file's zip structure (record headers, ``data.pkl`` and the small records, the
  central directory) and, within the tensor storage records, the alignment padding of flat
  partitions as structure, and the storages of the tensors it skips or reads once from
  another copy as owned by their reported names. A storage record nothing claims (a tensor
  the reader does not know) is unaccounted. Legacy Megatron-LM's ``model_optim_rng.pt``
  files are declared the same way by their reader.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import UnickptError
from ..format.ledger import Ledger, Region, build_ledger
from ..format.manifest import Manifest
from ..format.refs import ref_key
from ..format.safetensors_header import parse_entry, read_header
from ..storage.base import Storage
from .checkpoint import OpenCheckpoint, open_checkpoint


def safetensors_regions(storage: Storage, name: str) -> list[Region]:
    """The header of a safetensors file (structure) and each entry's bytes (owned by its key)."""
    header, start = read_header(storage.reader(name))
    if not isinstance(header, dict):
        raise UnickptError(f"{name}: safetensors header is not a JSON object")
    out = [Region(name, 0, start)]
    for key, d in header.items():
        if key == "__metadata__" or not isinstance(d, dict):
            continue
        try:
            _, _, lo, hi = parse_entry(d)
        except ValueError:  # a malformed entry owns no bytes (the header's own check names it)
            continue
        out.append(Region(name, start + lo, start + hi, key))
    return out


def _dcp_regions(path: str, manifest: Manifest) -> tuple[dict[str, list[Region]], dict[str, str]]:
    from .dcp import METADATA_NAME, rank_metadata_files, read_metadata

    # a save without collectives has one __{rank}.metadata per rank, each indexing that rank's files
    names = [METADATA_NAME] if os.path.isfile(os.path.join(path, METADATA_NAME)) else sorted(rank_metadata_files(path).values())
    regions: dict[str, list[Region]] = {}
    for md in (read_metadata(path, name) for name in names):
        for k, info in md.storage_data.items():
            regions.setdefault(info.relative_path, []).append(
                Region(info.relative_path, info.offset, info.offset + info.length, k.fqn))
    ignored = {f: "no item of the DCP metadata is stored in it (left by an earlier save into this directory)"
               for f in manifest.files if f not in regions}
    return regions, ignored


def source_ledger(checkpoint: OpenCheckpoint | str, storage_options: dict[str, Any] | None = None) -> Ledger:
    """The ledger of an open checkpoint (or of the one at a path or URL, opened with
    ``storage_options``). Files whose header
    cannot be read are left unchecked here: ``verify`` reports them."""
    if not isinstance(checkpoint, OpenCheckpoint):
        with open_checkpoint(checkpoint, storage_options) as opened:
            return source_ledger(opened)
    manifest, storage = checkpoint.manifest, checkpoint.storage
    fmt = checkpoint.format
    declared: dict[str, list[Region]] = {}
    ignored: dict[str, str] = {}
    referenced = {ref_key(b.path, n) for b in manifest.bases.values() for n in b.files}
    try:
        if fmt in ("unickpt", "hf"):
            for name in manifest.files:
                # a base's file (incremental checkpoints) is that checkpoint's to account for
                if name.endswith(".safetensors") and not (fmt == "unickpt" and name in referenced):
                    try:
                        declared[name] = safetensors_regions(storage, name)
                    except (UnickptError, OSError):
                        pass
        elif fmt in ("deepspeed", "megatron-legacy") and checkpoint.regions is not None:  # declared while reading
            declared = dict(checkpoint.regions)
        elif fmt == "megatron-legacy":
            from .megatron_legacy import read_megatron_legacy

            read_megatron_legacy(str(storage.root), declared)
        elif fmt == "deepspeed":
            from .deepspeed import read_deepspeed

            read_deepspeed(str(storage.root), declared)
        elif fmt in ("dcp", "megatron"):  # Megatron-Core's torch_dist is DCP's layout
            declared, ignored = _dcp_regions(str(storage.root), manifest)
    finally:
        storage.close()  # its open readers: the storage stays usable
    return build_ledger(manifest, declared, ignored)
