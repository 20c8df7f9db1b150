"""PyTorch DCP checkpoints: unickpt reads real ``dcp.save`` output (FSDP2, TP) onto other
layouts exactly as ``dcp.load`` does, writes checkpoints ``dcp.load`` reads, and never runs
a pickle it was handed."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

import unickpt
from unickpt.adapters.dcp import is_dcp, read_dcp
from unickpt.adapters.dcp_writer import write_dcp
from unickpt.errors import CorruptionError, LayoutError, ManifestError, SaveError, UnickptError, UnsafePickleError
from dcp_cases import EXTRA, load_jobs, run_ranks_preloaded as run_ranks, save_all


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """One 4-rank run: ``dcp.save`` of FSDP2 and TP states, ``unickpt.save`` of the TP
    state; then ``write_dcp`` of that unickpt checkpoint (the reverse direction)."""
    root = tmp_path_factory.mktemp("dcp")
    run_ranks(save_all, 4, str(root))
    report = write_dcp(str(root / "tp_unickpt"), str(root / "tp_unickpt_as_dcp"))
    assert report.tensors >= 50 and report.files == 1 and not report.warnings, report
    return root


@pytest.mark.multiprocess
def test_manifest_of_a_real_dcp_checkpoint(root):
    path = str(root / "fsdp_dcp")
    assert is_dcp(path) and not is_dcp(str(root / "tp_unickpt"))
    m = read_dcp(path)
    assert m.world_size == 4 and m.provenance["format"] == "dcp" and m.provenance["version"]
    assert sorted(m.files) == [f"__{r}_0.distcp" for r in range(4)]
    e = m.tensors["optim.state.blocks.0.up.weight.exp_avg"]  # get_state_dict's flattened optimizer names
    assert e.shape == (20, 12) and e.dtype == "F32" and e.layout == "dcp"
    assert [f.pieces[0].global_box.offsets for f in e.fragments] == [(0, 0), (5, 0), (10, 0), (15, 0)]
    assert all(f.crc32c == [] and f.rank == r for r, f in enumerate(e.fragments))
    assert m.tensors["optim.state.head.weight.step"].shape == ()
    assert unickpt.read_manifest(path).tensors.keys() == m.tensors.keys()
    assert m.values["step"] == 2 and m.values["extra.tag"] == "run-1"
    groups = m.values["optim.param_groups"]  # DCP's optim.param_groups.0.lr ... put back together
    assert len(groups) == 1 and groups[0]["lr"] == 0.01 and len(groups[0]["params"]) == 13
    assert "skipped" not in m.provenance
    # the fragments point at the very bytes dcp.save wrote
    whole = unickpt.load_tensor(path, "model.blocks.1.down.weight")
    ref = {"model": {"blocks.1.down.weight": torch.zeros(12, 20)}}
    import torch.distributed.checkpoint as dcp

    dcp.load(ref, checkpoint_id=path, no_dist=True)
    assert torch.equal(whole, ref["model"]["blocks.1.down.weight"])


@pytest.mark.multiprocess
def test_dcp_to_one_process(root):
    load_jobs(0, 1, str(root), [("fsdp_dcp", "fsdp_dcp", "plain"), ("tp_dcp", "tp_dcp", "plain")])


@pytest.mark.multiprocess
def test_dcp_to_two_ranks_and_back(root):
    """FSDP2 (4) -> TP (2), TP (4) -> FSDP2 (2); reverse: unickpt TP (4) -> write_dcp ->
    dcp.load on FSDP2 (2) equals unickpt.load of the source."""
    jobs = [("fsdp_dcp", "fsdp_dcp", "tp"), ("tp_dcp", "tp_dcp", "fsdp"), ("tp_unickpt_as_dcp", "tp_unickpt", "fsdp")]
    run_ranks(load_jobs, 2, str(root), jobs)


@pytest.mark.multiprocess
def test_dcp_to_three_ranks(root):
    """Uneven shards: FSDP2 (4) -> FSDP2 (3), TP (4) -> TP (3)."""
    run_ranks(load_jobs, 3, str(root), [("fsdp_dcp", "fsdp_dcp", "fsdp"), ("tp_dcp", "tp_dcp", "tp")])


@pytest.mark.multiprocess
def test_written_dcp_loads_in_one_process_without_a_group(root):
    load_jobs(0, 1, str(root), [("tp_unickpt_as_dcp", "tp_unickpt", "plain")])
    # and reads back through unickpt's own DCP reader
    m = read_dcp(str(root / "tp_unickpt_as_dcp"))
    src = unickpt.read_manifest(str(root / "tp_unickpt"))
    assert m.tensors.keys() == src.tensors.keys() and m.values == src.values
    assert all(len(e.fragments) == 1 for e in m.tensors.values())


def test_every_dtype_both_ways(tmp_path):
    """Every dtype unickpt stores, including those torch.save writes with
    ``_rebuild_tensor_v3`` (float8, uint16/32), through dcp.save -> unickpt and unickpt ->
    write_dcp -> dcp.load, in one process (``no_dist``)."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    state = {
        "f32": x, "f64": x.double(), "f16": x.half(), "bf16": x.bfloat16(), "f8": x.to(torch.float8_e4m3fn),
        "f8b": x.to(torch.float8_e5m2), "i64": torch.arange(7), "i8": torch.arange(-3, 4, dtype=torch.int8),
        "u8": torch.arange(7, dtype=torch.uint8), "u16": torch.arange(7, dtype=torch.int32).to(torch.uint16),
        "b": x > 0, "scalar": torch.tensor(3, dtype=torch.int32), "empty": torch.empty(0, 4),
    }

    def bits(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    def fresh():
        return {k: torch.zeros_like(v) for k, v in state.items()}

    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    got = fresh()
    unickpt.load(got, str(tmp_path / "dcp"))
    assert all(got[k].dtype == v.dtype and torch.equal(bits(got[k]), bits(v)) for k, v in state.items())

    unickpt.save(state, str(tmp_path / "u"))
    write_dcp(str(tmp_path / "u"), str(tmp_path / "u_dcp"), buffer_bytes=64)  # one tensor per batch
    got = fresh()
    dcp.load(got, checkpoint_id=str(tmp_path / "u_dcp"), no_dist=True)
    assert all(got[k].dtype == v.dtype and torch.equal(bits(got[k]), bits(v)) for k, v in state.items())


def test_write_dcp_warns_about_per_rank_state_and_refuses_to_clobber(tmp_path):
    state = {"w": torch.arange(6.0).view(2, 3), "rng": unickpt.PerRank(7), "step": 3}
    unickpt.save(state, str(tmp_path / "src"), metadata={"run": "x"})
    progress = []
    report = write_dcp(str(tmp_path / "src"), str(tmp_path / "out"), progress=progress.append)
    assert report.tensors == 1 and report.values == 1 and sum(progress) == 24
    assert any("rng" in w for w in report.warnings) and any("metadata" in w for w in report.warnings)
    assert sorted(os.listdir(tmp_path / "out")) == [".metadata", "__0_0.distcp"]
    with pytest.raises(SaveError, match="overwrite"):
        write_dcp(str(tmp_path / "src"), str(tmp_path / "out"))
    write_dcp(str(tmp_path / "src"), str(tmp_path / "out"), overwrite=True)
    with pytest.raises(SaveError):
        write_dcp(str(tmp_path / "src"), str(tmp_path / "src"))
    got = {"w": torch.zeros(2, 3), "step": 0}
    unickpt.load(got, str(tmp_path / "out"))
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3


# --- security -------------------------------------------------------------------------


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy(root, tmp_path, name="fsdp_dcp"):
    dst = tmp_path / name
    shutil.copytree(root / name, dst)
    return dst


def _metadata(path):
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own trusted file


def _append_item(path, md, fqn, payload: bytes, offset=None):
    """Append ``payload`` to __0_0.distcp and point ``fqn``'s (first) item at it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    f = path / "__0_0.distcp"
    start = f.stat().st_size
    with open(f, "ab") as out:
        out.write(payload)
    key = next(k for k in md.storage_data if k.fqn == fqn and (offset is None or tuple(k.offset) == offset))
    md.storage_data[key] = _StorageInfo("__0_0.distcp", start, len(payload))
    with open(path / ".metadata", "wb") as out:
        pickle.dump(md, out)


@pytest.mark.multiprocess
def test_metadata_calling_os_system_is_refused(root, tmp_path):
    ck = _copy(root, tmp_path)
    marker = tmp_path / "pwned"
    (ck / ".metadata").write_bytes(pickle.dumps({"x": _Evil(str(marker))}))
    for attempt in (lambda: read_dcp(str(ck)), lambda: unickpt.load({"step": 0}, str(ck))):
        with pytest.raises(UnsafePickleError, match="posix.system|os.system"):
            attempt()
    assert not marker.exists()
    # a module the metadata classes live in is no door to what that module imports
    data = b"\x80\x02ctorch.distributed.checkpoint.metadata\nos\n."
    (ck / ".metadata").write_bytes(data)
    with pytest.raises(UnsafePickleError, match="metadata.os"):
        read_dcp(str(ck))


@pytest.mark.multiprocess
def test_malicious_items_inside_distcp_never_run(root, tmp_path):
    import io

    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Evil(str(marker)), buf)
    evil = buf.getvalue()
    # in place of a tensor chunk: the checkpoint is refused
    ck = _copy(root, tmp_path)
    _append_item(ck, _metadata(ck), "model.head.weight", evil, (0, 0))
    with pytest.raises(UnsafePickleError, match="system"):
        read_dcp(str(ck))
    # in place of a value: that value is left out (and named); the rest still loads
    shutil.rmtree(ck)
    ck = _copy(root, tmp_path)
    _append_item(ck, _metadata(ck), "step", evil)
    m = read_dcp(str(ck))
    assert "step" not in m.values and "refused" in m.provenance["skipped"]["step"]
    assert m.values["extra.tag"] == "run-1"
    with pytest.raises(UnickptError, match="step"):
        unickpt.load({"step": 0}, str(ck))
    got = {"extra": {"tag": None}}
    unickpt.load(got, str(ck))
    assert got["extra"]["tag"] == EXTRA["tag"]
    assert not marker.exists()


# --- damaged checkpoints ---------------------------------------------------------------


@pytest.mark.multiprocess
def test_truncated_and_missing_data_files_are_clear_errors(root, tmp_path):
    ck = _copy(root, tmp_path)
    f = ck / "__2_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    target = {"model": {"head.weight": torch.zeros(5, 12)}}
    with pytest.raises(CorruptionError, match="__2_0.distcp.*truncated"):
        unickpt.load(target, str(ck))
    (ck / "__1_0.distcp").unlink()
    with pytest.raises(CorruptionError, match="__1_0.distcp.*missing"):
        unickpt.load(target, str(ck))


@pytest.mark.multiprocess
def test_malformed_metadata_is_a_clear_error(root, tmp_path):
    ck = _copy(root, tmp_path)
    (ck / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(ManifestError, match="not DCP metadata"):
        read_dcp(str(ck))
    (ck / ".metadata").write_bytes(b"garbage")
    with pytest.raises(UnickptError):
        read_dcp(str(ck))
    md = _metadata(root / "fsdp_dcp")
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "model.head.weight"}
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ManifestError, match="model.head.weight.*no storage entry"):
        read_dcp(str(ck))
    md = _metadata(root / "fsdp_dcp")  # items written through DCP stream transforms (compression)
    for k, v in md.storage_data.items():
        if k.fqn == "model.head.weight":
            v.transform_descriptors = ["zstd"]
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(LayoutError, match="model.head.weight.*transforms"):
        read_dcp(str(ck))
