"""Save on one layout and world size, load on others: bitwise equal, across real gloo ranks."""

from __future__ import annotations

import json

import pytest
import torch

import unickpt
from unickpt.testing import run_ranks

from forked import run_forked
from dist_cases import VALUES, build_state, check_state, start_manager, world2, world3, world4

pytestmark = pytest.mark.multiprocess  # every test here starts processes


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Checkpoints saved once by 1, 3 and 4 ranks, then loaded by the other world sizes."""
    root = tmp_path_factory.mktemp("reshard")
    unickpt.save(build_state("a4", fill=True), str(root / "single"))
    run_forked(world3, 3, str(root))
    run_forked(world4, 4, str(root))
    run_forked(world2, 2, str(root))
    return root


def test_every_layout_pair_loads_bitwise(root):
    # Pairs covered (save -> load), each over 11 tensors of mixed dtypes and layouts:
    # a4->b4, a4->a4, a4->d2, a4->1, c3->a4, c3->b4, c3->d2, c3->1, 1->b4, 1->d2, d2->d2
    for src in ("a4", "c3", "single", "d2"):
        sd = build_state("a4", fill=False)  # no process group here: plain tensors
        unickpt.load(sd, str(root / src))
        check_state(sd, f"single process from {src}")


def test_replicated_tensors_are_written_once_and_spread(root):
    m = unickpt.read_manifest(str(root / "a4"))
    assert m.world_size == 4
    for name, entry in m.tensors.items():
        boxes = [(p.global_box.offsets, p.global_box.lengths) for f in entry.fragments for p in f.pieces]
        assert len(boxes) == len(set(boxes)), f"{name} stored more than once"
    writers = {f.rank for e in m.tensors.values() for f in e.fragments if e.layout != "replicated" and "Replicate" in e.layout}
    assert len(writers) > 1, "replicas should be written by several ranks, not all by one"
    # w.empty: 2 columns over 4 ranks -> 2 non-empty fragments only
    assert len(m.tensors["model.w.empty"].fragments) == 2


def test_subgroup_save(root):
    sd = {"x": torch.zeros(6), "k": 0}
    unickpt.load(sd, str(root / "sub"))
    assert torch.equal(sd["x"], torch.arange(6.0)) and sd["k"] == 7
    assert unickpt.read_manifest(str(root / "sub")).world_size == 2


def test_files_are_safetensors(root):
    from safetensors import safe_open

    m = unickpt.read_manifest(str(root / "a4"))
    for name, entry in m.tensors.items():
        for f in entry.fragments:
            with safe_open(str(root / "a4" / f.file), "pt") as st:
                assert tuple(st.get_tensor(name).shape) == f.shape


def test_manifest_is_plain_json(root):
    doc = json.loads((root / "a4" / "manifest.json").read_text())
    assert doc["format"] == "unickpt" and doc["version"].startswith("1.")
    assert doc["values"]["meta.step"] == VALUES["step"]


def test_run_ranks_leaves_no_process_behind(tmp_path):
    """A rank that leaves a library's helper process running (a Manager server) does not
    leave it behind when it exits."""
    run_ranks(start_manager, 2, str(tmp_path), preload=["torch", "torch.distributed", "unickpt.testing"])
    for r in range(2):
        pid = int((tmp_path / f"rank{r}.pid").read_text())
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        assert state == "Z", f"rank {r}'s Manager server (pid {pid}) outlived the rank"


def test_the_fork_server_imports_every_module_asked_for(tmp_path):
    """run_ranks(preload=...) with a module the running fork server did not import starts
    one that imports it (and keeps the earlier ones): a rank finds both loaded."""
    from dist_cases import loaded_before_fn

    out = str(tmp_path / "loaded.json")
    run_ranks(loaded_before_fn, 2, ["colorsys"], out, preload=["torch", "colorsys"])
    assert json.load(open(out)) == {"colorsys": True}
    run_ranks(loaded_before_fn, 2, ["colorsys", "wave"], out, preload=["torch", "wave"])
    assert json.load(open(out)) == {"colorsys": True, "wave": True}
