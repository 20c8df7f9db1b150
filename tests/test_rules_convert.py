"""``unickpt.convert(src, dst, consolidate=True)`` and ``unickpt convert SRC DST --consolidate``:
one fragment per tensor, any state passing through, streaming with bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import unickpt
from unickpt.cli import app
from unickpt.plan.box import Box
from unickpt.plan.piece import box_piece, flat_pieces

from rules_cases import save_ranks

MiB = 1 << 20


def _two_rank_state(rank: int, tensors: dict[str, torch.Tensor]) -> dict:
    """Rank ``rank`` of 2 holding half of every tensor: 2-d ones cut on dim 0 (reads land
    in place) or dim 1 (reads go through scratch), 1-d ones as flat ZeRO-style ranges."""
    out = {}
    for i, (name, t) in enumerate(tensors.items()):
        if t.ndim == 2:
            d = i % 2
            n = t.shape[d] // 2
            lo, length = rank * n, n if rank == 0 else t.shape[d] - n
            local = t.narrow(d, lo, length).contiguous()
            offs = tuple(lo if k == d else 0 for k in range(2))
            out[name] = unickpt.Sharded(local, tuple(t.shape), [box_piece(tuple(local.shape), Box.whole(tuple(local.shape)), Box(offs, tuple(local.shape)))])
        else:
            flat = t.reshape(-1)
            half = flat.numel() // 2
            lo, hi = (0, half) if rank == 0 else (half, flat.numel())
            buf = torch.cat([flat[lo:hi], torch.zeros(3)])  # alignment padding after the range
            out[name] = unickpt.Sharded(buf, tuple(t.shape), flat_pieces(Box.whole(tuple(t.shape)), lo, hi, 0))
    return out


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.w": torch.randn(12, 10, generator=g),
        "model.v": torch.randn(9, 14, generator=g).to(torch.bfloat16),
        "model.b": torch.randn(7, generator=g),
        "optim.state.w.exp_avg": torch.randn(12, 10, generator=g),
        "optim.state.w.exp_avg_sq": torch.rand(12, 10, generator=g),
        "optim.state.w.momentum_buffer": torch.randn(12, 10, generator=g),  # Muon
        "optim.state.v.momentum_buffer": torch.randn(9, 14, generator=g).to(torch.bfloat16),
        "optim.state.b.my_custom_state": torch.randint(-5, 5, (7,), generator=g),
    }


def test_convert_consolidates_every_kind_of_state(tmp_path: Path) -> None:
    ts = _tensors()
    states = []
    for r in range(2):
        st = _two_rank_state(r, ts)
        st["step"] = 7
        st["rng"] = unickpt.PerRank(torch.tensor([r, 10 + r]))
        st["loader"] = unickpt.PerRank({"pos": 100 + r})
        states.append(st)
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    save_ranks(states, src, {"layout": {"note": "two ranks"}})
    seen = []
    report = unickpt.convert(src, dst, consolidate=True, threads=2, progress=seen.append)
    assert sum(seen) == report.bytes_written == unickpt.read_manifest(src).tensor_bytes()
    m = unickpt.read_manifest(dst)
    assert set(m.tensors) == set(ts)
    for name, t in ts.items():
        e = m.tensors[name]
        assert len(e.fragments) == 1 and len(e.fragments[0].pieces) == 1 and e.dtype == m.tensors[name].dtype
        assert torch.equal(unickpt.load_tensor(dst, name), t), name
    assert unickpt.verify(dst).ok
    assert m.metadata == unickpt.read_manifest(src).metadata
    assert unickpt.load_rank_values(dst, "loader") == [{"pos": 100}, {"pos": 101}]
    assert [t.tolist() for t in unickpt.load_rank_values(dst, "rng")] == [[0, 10], [1, 11]]
    back = {"step": 0}
    unickpt.load(back, dst)
    assert back["step"] == 7
    with pytest.raises(unickpt.SaveError, match="already holds"):
        unickpt.convert(src, dst)
    with pytest.raises(unickpt.SaveError, match="must differ"):
        unickpt.convert(src, src)
    with pytest.raises(unickpt.UnickptError, match="consolidate"):
        unickpt.convert(src, str(tmp_path / "x"), consolidate=False)


def test_convert_refuses_corrupt_or_incomplete_sources(tmp_path: Path) -> None:
    ts = {"model.w": torch.randn(6, 4)}
    save_ranks([_two_rank_state(0, ts), _two_rank_state(1, ts)], str(tmp_path / "src"))
    f = tmp_path / "src" / "rank_00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40  # one flipped bit in the last fragment
    f.write_bytes(bytes(data))
    with pytest.raises(unickpt.CorruptionError, match="checksum mismatch in rank_00001.safetensors"):
        unickpt.convert(str(tmp_path / "src"), str(tmp_path / "dst"))
    f.write_bytes(b"")  # truncated
    with pytest.raises(unickpt.UnickptError):
        unickpt.convert(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert not (tmp_path / "dst" / "manifest.json").exists()


def test_cli_convert(tmp_path: Path) -> None:
    ts = _tensors(1)
    save_ranks([_two_rank_state(r, ts) for r in range(2)], str(tmp_path / "src"))
    runner = CliRunner()
    r = runner.invoke(app, ["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--consolidate"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "OK: 8 tensors consolidated" in r.stdout
    assert all(len(e.fragments) == 1 for e in unickpt.read_manifest(str(tmp_path / "dst")).tensors.values())
    r = runner.invoke(app, ["convert", str(tmp_path / "src"), str(tmp_path / "dst2")])
    assert r.exit_code == 2 and "--consolidate" in r.output
    r = runner.invoke(app, ["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--consolidate"])
    assert r.exit_code == 2 and "already holds" in r.output


# ---------------------------------------------------------------- bounded memory

_RSS_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch, unickpt

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    torch.empty(1 << 20).fill_(1.0)  # warm the allocator up
    base = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    report = unickpt.convert(sys.argv[1], sys.argv[2], threads=2, buffer_bytes=int(sys.argv[3]))
    print(json.dumps({"base": base, "peak": status("VmHWM:"), "written": report.bytes_written}))
    """
)


def _model(n_layers: int) -> dict[str, torch.Tensor]:
    """A model of ``n_layers`` layers; the largest tensor (4 MiB) does not depend on it."""
    out = {}
    for i in range(n_layers):
        out[f"model.layers.{i}.big"] = torch.full((512, 2048), float(i))  # 4 MiB, cut on dim 0
        out[f"model.layers.{i}.cols"] = torch.full((256, 1024), float(i))  # 1 MiB, cut on dim 1
        out[f"model.layers.{i}.norm"] = torch.full((4096,), float(i))  # flat ranges
    return out


def _peak(tmp_path: Path, n_layers: int, buffer_bytes: int) -> dict[str, int]:
    ts = _model(n_layers)
    src, dst = tmp_path / f"src{n_layers}", tmp_path / f"dst{n_layers}"
    save_ranks([_two_rank_state(r, ts) for r in range(2)], str(src))
    del ts
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(src), str(dst), str(buffer_bytes)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.multiprocess
def test_convert_memory_does_not_grow_with_model_size(tmp_path: Path) -> None:
    """Peak RSS of a converting process, for models of 4 and 16 layers (21 MiB and 84 MiB),
    read from checkpoints with 4 MiB checksum blocks: the growth over the process's
    baseline stays within the documented bound, max(largest tensor, buffer) +
    threads * (buffer / threads + 2 * block), and does not grow with the model."""
    buffer_bytes, threads, block = 4 * MiB, 2, 4 * MiB
    small, large = _peak(tmp_path, 4, buffer_bytes), _peak(tmp_path, 16, buffer_bytes)
    assert large["written"] == 4 * small["written"] > 80 * MiB
    grow_small, grow_large = small["peak"] - small["base"], large["peak"] - large["base"]
    bound = max(4 * MiB, buffer_bytes) + threads * (buffer_bytes // threads + 2 * block)
    print(f"peak RSS growth: {grow_small / MiB:.1f} MiB (21 MiB model), {grow_large / MiB:.1f} MiB (84 MiB model); "
          f"bound {bound / MiB:.0f} MiB")
    assert grow_small <= bound and grow_large <= bound, (grow_small / MiB, grow_large / MiB)
    assert grow_large - grow_small <= 4 * MiB, (grow_small / MiB, grow_large / MiB)
