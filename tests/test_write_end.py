"""A checkpoint write ends once (``storage/write_end.py``): an abort after the commit (live
recovery abandoning a save whose commit got through) leaves the committed checkpoint
alone, and a commit after an abort is refused. On a local directory (``DirectoryWrite``)
and an object-store prefix (``PrefixWrite``, fsspec's in-memory store), in this process."""

from __future__ import annotations

import pytest

from unickpt import SaveError
from unickpt.storage.open import open_storage
from unickpt.engine.targets import claim


@pytest.fixture(params=["local", "prefix"])
def location(request, tmp_path) -> str:
    return str(tmp_path / "ck") if request.param == "local" else f"memory://{tmp_path.name}/ck"


def test_an_abort_after_the_commit_leaves_the_checkpoint(location):
    write, storage = claim(location, overwrite=False)
    storage.write_atomic("rank_00000.safetensors", b"data")
    write.commit({"manifest.json": b"{}"})
    write.abort()
    committed = open_storage(location)
    assert sorted(committed.names()) == ["manifest.json", "rank_00000.safetensors"]
    assert committed.read_small("rank_00000.safetensors") == b"data"
    with pytest.raises(SaveError, match="the save was abandoned"):
        write.commit({"manifest.json": b"{}"})


def test_a_commit_after_an_abort_is_refused_and_writes_nothing(location):
    write, storage = claim(location, overwrite=False)
    storage.write_atomic("rank_00000.safetensors", b"data")
    write.abort()
    with pytest.raises(SaveError, match="the save was abandoned"):
        write.commit({"manifest.json": b"{}"})
    assert "manifest.json" not in open_storage(location).names()
