"""unickpt's DCP plugin where it stands in for ``FileSystemWriter``/``FileSystemReader``
(what PyTorch's own ``test_overwrite`` expects of a storage):

* the same sequence with ``FileSystemWriter`` and with ``StorageWriter``: a save over a
  committed checkpoint replaces it by default (the load gives the second tensors), and with
  ``overwrite=False`` it is refused with "Checkpoint already exists", the checkpoint left
  as it was;
* ``validate_checkpoint_id``: True for what each can open (a writable directory to write;
  a checkpoint unickpt reads), False for a missing or foreign location, so DCP's own
  storage detection (``checkpoint_id=`` without a storage) is not shadowed;
* ``dcp.async_save`` in process mode writes a whole unickpt checkpoint of the state as it
  was at the call.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import unickpt
from unickpt.dcp import StorageReader, StorageWriter

KINDS = {"torch": (FileSystemWriter, FileSystemReader), "unickpt": (StorageWriter, StorageReader)}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_overwrite_as_filesystem_writer_does(kind, tmp_path):
    writer, reader = KINDS[kind]
    path = str(tmp_path / "ckpt")
    t1, t2 = torch.randn(10), torch.randn(10)
    dcp.save({"random": t1}, storage_writer=writer(path), no_dist=True)
    dcp.save({"random": t2}, storage_writer=writer(path), no_dist=True)  # the default overwrites
    got = {"random": torch.zeros(10)}
    dcp.load(got, storage_reader=reader(path), no_dist=True)
    assert torch.equal(got["random"], t2)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save({"random": t1}, storage_writer=writer(path, overwrite=False), no_dist=True)
    got = {"random": torch.zeros(10)}
    dcp.load(got, storage_reader=reader(path), no_dist=True)
    assert torch.equal(got["random"], t2)
    if kind == "unickpt":
        assert unickpt.verify(path).ok
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left by the swap


def test_validate_checkpoint_id_says_no_where_unickpt_cannot_open(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(ckpt), no_dist=True)
    assert StorageReader.validate_checkpoint_id(ckpt)
    assert not StorageReader.validate_checkpoint_id(str(tmp_path / "missing"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not a checkpoint")
    assert not StorageReader.validate_checkpoint_id(str(tmp_path / "notes"))
    assert not StorageReader.validate_checkpoint_id("nosuchscheme://bucket/run")
    assert StorageWriter.validate_checkpoint_id(str(tmp_path / "new" / "deeper"))
    assert not StorageWriter.validate_checkpoint_id("nosuchscheme://bucket/run")
    assert not StorageWriter.validate_checkpoint_id(123)


@pytest.mark.multiprocess
def test_async_save_in_process_mode(tmp_path):
    from dcp_dropin_cases import async_save_process_mode
    from unickpt.testing import run_ranks

    run_ranks(async_save_process_mode, 1, str(tmp_path / "ckpt"))
