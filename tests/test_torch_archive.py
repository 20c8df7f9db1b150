"""The allow-listing reader of foreign pickles and torch.save archives (no processes)."""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from unickpt.adapters.detect import check_foreign, check_relative_path
from unickpt.adapters.torch_archive import StoredTensor, loads_restricted, materialize, read_archive, stored_tensors
from unickpt.errors import CorruptionError, ManifestError, UnsafePickleError
from unickpt.format.manifest import Fragment, Manifest, TensorEntry
from unickpt.plan.piece import whole_piece
from unickpt.storage.local import LocalStorage


class _Evil:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _archive(obj, prefix: bytes = b"", suffix: bytes = b"") -> tuple[bytes, int, int]:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    return prefix + data + suffix, len(prefix), len(data)


STATE = {
    "slice": torch.arange(10, dtype=torch.float32)[2:7],
    "param": torch.nn.Parameter(torch.randn(3, 4, dtype=torch.bfloat16), requires_grad=False),
    "transposed": torch.arange(12.0, dtype=torch.float64).view(3, 4).t(),
    "scalar": torch.tensor(7, dtype=torch.int64),
    "half": torch.randn(5, dtype=torch.float16),
    "flags": torch.tensor([True, False, True]),
    "empty": torch.empty(0, 3),
    "meta": {"size": torch.Size([2, 3]), "dtype": torch.float16, "nested": [1, 2.5, "x", None, (1, 2)], "set": {1, 2}},
}


def test_archive_in_a_byte_range_gives_in_place_tensors(tmp_path: Path) -> None:
    blob, start, length = _archive(STATE, b"x" * 100, b"y" * 9)
    (tmp_path / "f.bin").write_bytes(blob)
    storage = LocalStorage(tmp_path)
    obj = read_archive(storage, "f.bin", start, length)
    assert obj["meta"] == STATE["meta"]
    assert len(stored_tensors(obj)) == 7
    for key in ("slice", "param", "transposed", "scalar", "half", "flags", "empty"):
        st = obj[key]
        assert isinstance(st, StoredTensor) and st.shape == tuple(STATE[key].shape)
        got = materialize(storage, st)
        assert got.dtype == STATE[key].dtype and torch.equal(got, STATE[key].detach()), key
    assert obj["slice"].is_contiguous() and not obj["transposed"].is_contiguous()
    # a contiguous tensor's bytes are exactly [offset, offset + nbytes) of the file
    st = obj["half"]
    assert blob[st.offset : st.offset + st.nbytes] == STATE["half"].numpy().tobytes()
    storage.close()


def test_refuses_foreign_code_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafePickleError, match="posix.system|os.system"):
        loads_restricted(pickle.dumps({"a": _Evil(str(marker))}), ".metadata")
    blob, start, length = _archive({"w": torch.ones(2), "x": _Evil(str(marker))})
    (tmp_path / "a.pt").write_bytes(blob)
    with pytest.raises(UnsafePickleError, match="refused to unpickle"):
        read_archive(LocalStorage(tmp_path), "a.pt")
    assert not marker.exists()


Point = collections.namedtuple("Point", "x y")


def test_allow_list_admits_only_what_the_caller_names() -> None:
    data = pickle.dumps(Point(1, 2))
    with pytest.raises(UnsafePickleError):
        loads_restricted(data, "p")
    assert loads_restricted(data, "p", {(Point.__module__, "Point"): Point}) == Point(1, 2)


def test_damaged_archives_are_clear_errors(tmp_path: Path) -> None:
    blob, _, _ = _archive({"w": torch.arange(1000.0)})
    (tmp_path / "cut.pt").write_bytes(blob[: len(blob) // 2])
    storage = LocalStorage(tmp_path)
    with pytest.raises(CorruptionError, match="not a torch.save archive"):
        read_archive(storage, "cut.pt")
    with pytest.raises(CorruptionError, match="past its end"):
        read_archive(storage, "cut.pt", 0, len(blob))
    (tmp_path / "junk.pt").write_bytes(b"\x80\x02}q\x00.")  # a plain pickle, not an archive
    with pytest.raises(CorruptionError):
        read_archive(storage, "junk.pt")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({}))
        z.writestr("archive/data/0", b"\0" * 64)
    (tmp_path / "deflated.pt").write_bytes(buf.getvalue())
    with pytest.raises(CorruptionError, match="compressed"):
        read_archive(storage, "deflated.pt")
    with pytest.raises(CorruptionError):
        loads_restricted(b"not a pickle", "x")


def test_every_flipped_byte_of_an_archive_is_a_clear_error_or_a_good_read(tmp_path: Path) -> None:
    """One byte flipped anywhere in an archive's records (each in turn): zipfile fails in
    many ways (UnicodeDecodeError, struct.error, EOFError, NotImplementedError, 'encrypted'),
    each a CorruptionError naming the file, never one of those."""
    blob, _, _ = _archive({"w": torch.arange(4.0), "step": 3})
    storage = LocalStorage(tmp_path)
    kinds = set()
    for i in range(len(blob)):
        (tmp_path / "f.pt").write_bytes(blob[:i] + bytes([blob[i] ^ 0x80]) + blob[i + 1:])
        try:
            read_archive(storage, "f.pt")
        except CorruptionError as e:
            assert str(e).startswith("f.pt"), e
            kinds.add(str(e).split("(", 1)[-1].split(":", 1)[0])
    assert {"UnicodeDecodeError", "error", "EOFError"} & kinds, kinds  # zipfile's own failures were among them


def test_a_pickle_that_refers_to_its_parts_over_and_over_is_refused_at_once(tmp_path: Path) -> None:
    """A list holding the one before it twice, 40 deep: 1.5 KB of pickle, 2**40 nodes for
    any walk of it as a tree. Refused when read (it used to hang every reader), while the
    ordinary sharing of a structure (a tensor or a dict named twice) still reads."""
    x: list = [1]
    for _ in range(40):
        x = [x, x]
    blob, _, _ = _archive(x)
    (tmp_path / "bomb.pt").write_bytes(blob)
    with pytest.raises(CorruptionError, match="refers to its own parts over and over"):
        read_archive(LocalStorage(tmp_path), "bomb.pt")
    with pytest.raises(CorruptionError, match="refers to its own parts over and over"):
        loads_restricted(pickle.dumps(x), "p")
    t, d = torch.arange(3.0), {"lr": 0.1}
    blob, _, _ = _archive({"a": t, "b": t, "groups": [d, d], "loop": None})
    (tmp_path / "shared.pt").write_bytes(blob)
    got = read_archive(LocalStorage(tmp_path), "shared.pt")
    assert got["groups"] == [{"lr": 0.1}] * 2 and len(stored_tensors(got)) == 2


def test_foreign_manifests_stay_inside_the_checkpoint() -> None:
    for bad in ("../etc/passwd", "/etc/passwd", "zero/../../x", "", "a\\b"):
        with pytest.raises(ManifestError):
            check_relative_path(bad)
    assert check_relative_path("zero/layers.0.weight/fp32.pt")
    frag = Fragment("__0_0.distcp", 96, (4,), [whole_piece((4,))], [], 4)
    m = Manifest(tensors={"w": TensorEntry("w", (4,), "F32", [frag])}, files={"__0_0.distcp": 100})
    with pytest.raises(ManifestError, match="past the end"):
        check_foreign(m)
    m.files["__0_0.distcp"] = 112
    check_foreign(m)
    m.files = {"other": 112}
    with pytest.raises(ManifestError, match="not listed"):
        check_foreign(m)


def _megatron_main_param(data: torch.Tensor) -> tuple[torch.Tensor, torch.nn.Parameter]:
    """An fp32 main param as Megatron's Float16OptimizerWithFloat16Params makes it (its
    bf16 parameter's tensor-parallel attributes copied by megatron-core's own function),
    and that bf16 parameter."""
    layers = pytest.importorskip("megatron.core.tensor_parallel.layers")
    param = torch.nn.Parameter(data.bfloat16())
    layers.set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
    main = param.detach().clone().float()
    layers.copy_tensor_model_parallel_attributes(main, param)
    return main, param


def test_tensors_carrying_attributes_are_read(tmp_path: Path) -> None:
    """A tensor with Python attributes (torch.save: ``_rebuild_from_type_v2(func,
    torch.Tensor, args, state)``) and an ``nn.Parameter`` with attributes
    (``_rebuild_parameter_with_state``), written by the real ``torch.save``, read as
    stored tensors holding exactly their bytes; the attributes are dropped."""
    main, param = _megatron_main_param(torch.arange(12.0).reshape(3, 4) / 7)
    assert (main.tensor_model_parallel, main.partition_dim, main.partition_stride) == (True, 0, 1)
    plain = torch.arange(5, dtype=torch.float64)
    plain.shared, plain.meta = True, {"names": ("a", "b"), "n": [1, 2.5, None]}  # nested plain values
    torch.save({"main": main, "param": param, "plain": plain, "view": main[1:]}, tmp_path / "a.pt")
    assert b"_rebuild_from_type_v2" in (tmp_path / "a.pt").read_bytes()  # the form in question, really written
    storage = LocalStorage(tmp_path)
    obj = read_archive(storage, "a.pt")
    for key, want in (("main", main), ("param", param), ("plain", plain), ("view", main[1:])):
        assert isinstance(obj[key], StoredTensor), key
        got = materialize(storage, obj[key])
        assert got.dtype == want.dtype and torch.equal(got, want.detach()), key
    assert obj["view"].storage_at == obj["main"].storage_at and obj["view"].storage_offset == 4
    storage.close()


def test_tensor_attributes_that_are_not_plain_data_are_refused(tmp_path: Path) -> None:
    """A tensor's attributes holding a function, an object of a class, or a tensor are
    refused (UnsafePickleError naming it), also when unknown globals are read as records;
    torch's tensor class named anywhere but as a rebuilt tensor's type is refused."""
    marker = tmp_path / "ran"
    storage = LocalStorage(tmp_path)
    cases = {"function": (os.getcwd, "posix.getcwd|os.getcwd"), "object": (Point(1, 2), "Point"),
             "code": (_Evil(str(marker)), "posix.system|os.system")}
    for name, (value, match) in cases.items():
        t = torch.ones(2)
        t.hook = value
        torch.save({"t": t}, tmp_path / f"{name}.pt")
        with pytest.raises(UnsafePickleError, match=match):
            read_archive(storage, f"{name}.pt")
        with pytest.raises(UnsafePickleError, match=rf"refused to unpickle torch\.Tensor with an attribute holding .*({match})"):
            read_archive(storage, f"{name}.pt", unknown_as_records=True)
    t = torch.ones(2)
    t.main_grad = torch.zeros(2)  # a tensor among the attributes: not plain data
    torch.save({"t": t}, tmp_path / "tensor.pt")
    with pytest.raises(UnsafePickleError, match="torch.Tensor with an attribute holding a tensor"):
        read_archive(storage, "tensor.pt")
    p = torch.nn.Parameter(torch.ones(2))
    p.owner = Point(3, 4)
    torch.save({"p": p}, tmp_path / "param.pt")
    with pytest.raises(UnsafePickleError, match=r"refused to unpickle torch\.nn\.Parameter with an attribute holding .*Point"):
        read_archive(storage, "param.pt", unknown_as_records=True)
    assert not marker.exists()

    class _Call:  # torch.Tensor called as a function: never run
        def __reduce__(self):
            return (torch.Tensor, ([1.0, 2.0],))

    class _Rebuild:  # _rebuild_from_type_v2 with a rebuild function other than a tensor record's
        def __reduce__(self):
            return (torch._tensor._rebuild_from_type_v2, (set, torch.Tensor, ([1, 2],), {}))

    with pytest.raises(UnsafePickleError, match="refused to call torch.Tensor"):
        loads_restricted(pickle.dumps(_Call(), protocol=2), "call")
    with pytest.raises(UnsafePickleError, match="refused to rebuild torch.Tensor with builtins.set"):
        loads_restricted(pickle.dumps(_Rebuild(), protocol=2), "rebuild")
    storage.close()
