"""DCP variants from the real torch writers on 2 gloo ranks: a save without collectives
(per-rank ``__{rank}.metadata``) and DCP's Hugging Face safetensors storage are read in
place, bitwise as torch's own readers; an HF storage save whose ranks overwrote each other
is refused, never read as a smaller tensor."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import unickpt
from unickpt.adapters.dcp import is_dcp, read_dcp
from unickpt.adapters.detect import checkpoint_format
from unickpt.errors import LayoutError
from unickpt.testing import run_ranks
from dcp_variant_cases import PRELOAD, full, save_variants
from test_cli import invoke

pytestmark = pytest.mark.multiprocess  # every test here starts processes


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp_variants")
    run_ranks(save_variants, 2, str(root), preload=PRELOAD)
    return root


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_save_without_collectives(root: Path) -> None:
    path = root / "no_collectives"
    assert not (path / ".metadata").exists() and (path / "__1.metadata").exists()
    assert is_dcp(str(path)) and checkpoint_format(str(path)) == "dcp"
    m = read_dcp(str(path))
    assert m.world_size == 2 and m.provenance["rank_local_metadata"]
    assert [f.pieces[0].global_box.lengths for f in m.tensors["model.w"].fragments] == [(4, 4), (3, 4)]
    assert len(m.tensors["model.norm"].fragments) == 1  # every rank wrote it; read once
    assert list(m.provenance["replicas"]) == ["model.norm (copies of ranks 1)"] and "skipped" not in m.provenance
    assert m.values["lr"] == 0.5 and m.rank_values["seed"] == [100, 101]  # it differs per rank
    assert unickpt.load_rank_values(str(path), "seed") == [100, 101]
    for name, t in full().items():  # onto one process: DCP itself cannot, its ranks read their own metadata
        assert torch.equal(_bits(unickpt.load_tensor(str(path), f"model.{name}")), _bits(t)), name
    r = invoke("verify", str(path))
    assert r.exit_code == 0, r.output


def test_hugging_face_storage_distributed(root: Path) -> None:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = root / "hf_distributed"
    assert checkpoint_format(str(path)) == "dcp-hf"
    m = unickpt.read_manifest(str(path))
    assert len(m.tensors["model.w"].fragments) == 2 and m.tensors["model.w"].shape == (7, 4)
    ref = {f"model.{k}": torch.full_like(v, 7) for k, v in full().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(ref, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    for name, t in full().items():
        got = unickpt.load_tensor(str(path), f"model.{name}")
        assert torch.equal(_bits(got), _bits(ref[f"model.{name}"])) and torch.equal(_bits(got), _bits(t)), name
    out = root / "hf_converted"
    r = invoke("convert", str(path), str(out))
    assert r.exit_code == 0, r.output
    assert torch.equal(_bits(unickpt.load_tensor(str(out), "model.w")), _bits(full()["w"]))


def test_hugging_face_storage_overwritten_is_refused(root: Path) -> None:
    """Without save_distributed every rank wrote model-00001-of-00001.safetensors: one rank's
    chunks survive. torch's reader would give a tensor partly never written."""
    path = root / "hf_overwritten"
    assert checkpoint_format(str(path)) == "dcp-hf"
    with pytest.raises(LayoutError, match="save_distributed=True"):
        unickpt.read_manifest(str(path))
    r = invoke("inspect", str(path))
    assert r.exit_code == 2 and "save_distributed=True" in r.output

