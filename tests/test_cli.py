"""The command line (``python -m unickpt`` / ``unickpt``) and ``unickpt.verify``.

Fast tests use typer's CliRunner in-process; the ones about process-level behaviour
(exit codes, no traceback, ``python -m``) run the CLI for real with ``subprocess``.
``test_demo_end_to_end_slow`` spawns 4 + 2 gloo ranks and is the slow one (~30-60 s).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import unickpt
from unickpt.api.verify import total_bytes
from unickpt.cli import app
from unickpt.testing import free_port

ENV = {"COLUMNS": "250", "NO_COLOR": "1"}
BLOCK = 64  # small checksum blocks, so a flipped byte is located to 64 bytes


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``python -m unickpt ARGS`` in a fresh process."""
    env = {**os.environ, **ENV}
    return subprocess.run(
        [sys.executable, "-m", "unickpt", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def invoke(*args: str):
    """Run the CLI in-process."""
    return CliRunner().invoke(app, list(args), env=ENV)


def make_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(16, 8, generator=g),
            "proj.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
            "proj.bias": torch.arange(8, dtype=torch.int64),
        },
        "step": 1234,
        "lr": 0.0003,
        "schedule": {"betas": (0.9, 0.95), "name": "cosine"},
        "dataloader": unickpt.PerRank({"position": 77}),
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "step_000100"
    unickpt.save(make_state(), str(path), block_bytes=BLOCK, metadata={"run": "unit-test", "seed": 7})
    return path


def data_file(path: Path, tensor: str) -> tuple[Path, int, int]:
    """(file, absolute offset, nbytes) of the single fragment of ``tensor``."""
    entry = unickpt.read_manifest(str(path)).tensors[tensor]
    (frag,) = entry.fragments
    return path / frag.file, frag.offset, frag.nbytes(entry.dtype)


def flip_byte(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x5A
    file.write_bytes(bytes(data))


# ------------------------------------------------------------------ help


@pytest.mark.multiprocess
def test_help_lists_commands_with_docs() -> None:
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    for cmd, doc in (
        ("inspect", "Show tensors, values"),
        ("verify", "Re-check every checksum"),
        ("demo", "Train on tp2 x dp2, lose the job, resume on 3"),
    ):
        assert re.search(rf"{cmd}\s+{re.escape(doc)}", r.stdout), r.stdout
    assert "Traceback" not in r.stderr


def test_subcommand_help() -> None:
    r = invoke("verify", "--help")
    assert r.exit_code == 0
    assert "--threads" in r.stdout and "PATH" in r.stdout


def test_help_summary_names_every_command_and_export_lists_every_dtype_it_takes() -> None:
    """The top-level summary named 5 of the 8 commands; ``export --help`` listed bf16, fp16
    and fp32 while fp64 is accepted too (and named by the error)."""
    import typer.main

    from unickpt.adapters.hf_export import parse_dtype

    r = invoke("--help")
    summary = " ".join(r.stdout.split("Options:")[0].split())
    commands = typer.main.get_command(app).commands
    assert [n for n, c in commands.items() if not c.hidden and not re.search(rf"\b{n}\b", summary)] == [], summary
    help_text = " ".join(invoke("export", "--help").stdout.split())
    listed = re.search(r"Cast floating tensors: (.*?) \(default", help_text).group(1).replace(" or ", ", ").split(", ")
    assert listed == ["bf16", "fp16", "fp32", "fp64"], help_text
    assert all(parse_dtype(d) for d in listed)
    with pytest.raises(unickpt.UnickptError) as e:
        parse_dtype("int8")
    assert re.search(r"known: (.*)\)", str(e.value)).group(1).split(", ") == listed


# ------------------------------------------------------------------ inspect


def test_inspect_shows_tensors_values_per_rank_and_totals(ckpt: Path) -> None:
    r = invoke("inspect", str(ckpt))
    assert r.exit_code == 0, r.output
    out = r.stdout
    # tensor rows: name, shape, dtype, human size, fragments, layout
    assert re.search(r"model\.embed\.weight\s*│\s*\[16, 8\]\s*│\s*F32\s*│\s*512 B\s*│\s*1\s*│\s*replicated", out), out
    assert re.search(r"model\.proj\.weight\s*│\s*\[8, 8\]\s*│\s*BF16\s*│\s*128 B", out), out
    assert re.search(r"model\.proj\.bias\s*│\s*\[8\]\s*│\s*I64", out), out
    # values: name, type, short repr (tuples survive the JSON encoding)
    assert re.search(r"step\s*│\s*int\s*│\s*1234", out), out
    assert re.search(r"schedule\.betas\s*│\s*tuple\s*│\s*\(0\.9, 0\.95\)", out), out
    assert re.search(r"dataloader\s*│\s*value\s*│\s*1\s*│\s*dict", out), out
    # totals and provenance
    assert "totals: 3 tensors, 704 B (704 bytes), 4 values, 1 per-rank entry, 3 fragments, 1 file" in out, out
    assert re.search(r"world size\s+1", out) and re.search(r"torch\s+" + re.escape(torch.__version__), out), out
    assert re.search(r"metadata\.run\s+unit-test", out), out


def test_inspect_json_is_machine_readable(ckpt: Path) -> None:
    r = invoke("inspect", str(ckpt), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert set(tensors) == {"model.embed.weight", "model.proj.weight", "model.proj.bias"}
    assert tensors["model.proj.weight"] == {
        "name": "model.proj.weight", "shape": [8, 8], "dtype": "BF16", "nbytes": 128,
        "stored_bytes": 128, "fragments": 1, "layout": "replicated",
    }
    values = {v["name"]: v for v in doc["values"]}
    assert values["step"]["value"] == 1234 and values["schedule.betas"]["type"] == "tuple"
    assert doc["per_rank"][0]["name"] == "dataloader" and doc["per_rank"][0]["values"] == [{"position": 77}]
    assert doc["totals"]["tensors"] == 3 and doc["totals"]["tensor_bytes"] == 16 * 8 * 4 + 64 * 2 + 8 * 8
    assert doc["totals"]["files"] == 1 and doc["totals"]["fragments"] == 3
    assert doc["world_size"] == 1 and doc["metadata"] == {"run": "unit-test", "seed": 7}
    assert doc["provenance"]["unickpt"] == unickpt.__version__


# ------------------------------------------------------------------ verify


@pytest.mark.multiprocess
def test_verify_clean_checkpoint_exits_0(ckpt: Path) -> None:
    r = run_cli("verify", str(ckpt))
    assert r.returncode == 0, r.stdout + r.stderr
    expected = total_bytes(unickpt.read_manifest(str(ckpt)))
    assert expected == 16 * 8 * 4 + 64 * 2 + 8 * 8
    assert f"OK: 3 tensors, {expected} bytes verified" in r.stdout, r.stdout
    assert r.stderr == ""  # no progress bar garbage when not on a terminal


def test_verify_flipped_byte_names_tensor_file_and_range(ckpt: Path) -> None:
    file, offset, nbytes = data_file(ckpt, "model.proj.weight")
    at = offset + 70  # inside the second 64-byte block of the tensor
    flip_byte(file, at)

    report = unickpt.verify(str(ckpt))
    assert not report.ok
    (p,) = report.problems
    assert (p.kind, p.file, p.tensor) == ("checksum", file.name, "model.proj.weight")
    assert (p.start, p.stop) == (offset + BLOCK, offset + 2 * BLOCK) and p.start <= at < p.stop

    r = invoke("verify", str(ckpt))
    assert r.exit_code == 1, r.output
    assert "CORRUPT: 1 problem(s)" in r.stdout
    line = next(ln for ln in r.stdout.splitlines() if "checksum mismatch" in ln)
    assert file.name in line and "'model.proj.weight'" in line and f"bytes {offset + BLOCK}-{offset + 2 * BLOCK}" in line
    # the other tensors are not blamed
    assert "model.embed.weight" not in r.stdout and "model.proj.bias" not in r.stdout


@pytest.mark.multiprocess
def test_verify_truncated_file_reports_size_and_lost_tensors(ckpt: Path) -> None:
    file, offset, nbytes = data_file(ckpt, "model.proj.bias")
    full = file.stat().st_size
    cut = offset + 10
    os.truncate(file, cut)

    r = run_cli("verify", str(ckpt))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"file is truncated: {cut} bytes on disk, manifest expects {full}" in r.stdout, r.stdout
    lost = [ln for ln in r.stdout.splitlines() if "past the end of the truncated file" in ln]
    assert lost and all(file.name in ln for ln in lost)
    assert any("'model.proj.bias'" in ln for ln in lost), r.stdout
    assert "Traceback" not in r.stderr


def test_verify_missing_data_file(ckpt: Path) -> None:
    file, _, _ = data_file(ckpt, "model.embed.weight")
    file.unlink()
    r = invoke("verify", str(ckpt))
    assert r.exit_code == 1, r.output
    assert f"file {file.name}: data file is missing" in r.stdout
    for name in ("model.embed.weight", "model.proj.weight", "model.proj.bias"):
        assert f"'{name}'" in r.stdout


def test_verify_header_disagreeing_with_manifest(ckpt: Path) -> None:
    file, _, _ = data_file(ckpt, "model.embed.weight")
    data = file.read_bytes()
    old = b'"model.embed.weight":{"dtype":"F32","shape":[16,8]'
    assert old in data
    file.write_bytes(data.replace(old, old.replace(b"[16,8]", b"[8,16]")))
    report = unickpt.verify(str(ckpt))
    assert [(p.kind, p.tensor) for p in report.problems] == [("header", "model.embed.weight")]
    assert "shape [8, 16] (manifest: [16, 8])" in report.problems[0].message
    r = invoke("verify", str(ckpt))
    assert r.exit_code == 1 and "safetensors header disagrees with the manifest" in r.stdout


def test_verify_progress_reports_every_byte(ckpt: Path) -> None:
    seen: list[int] = []
    report = unickpt.verify(str(ckpt), progress=seen.append, threads=2)
    assert report.ok and sum(seen) == report.bytes_total == report.bytes_checked == 704


# ------------------------------------------------------------------ errors


@pytest.mark.multiprocess
@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_directory_without_manifest_is_exit_2_one_line(tmp_path: Path, command: str) -> None:
    (tmp_path / "rank_00000.safetensors").write_bytes(b"\0" * 16)
    r = run_cli(command, str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {tmp_path}: not a committed checkpoint (no manifest.json)"]
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_invalid_manifest_is_exit_2(ckpt: Path) -> None:
    (ckpt / "manifest.json").write_text("{not json")
    r = invoke("inspect", str(ckpt))
    assert r.exit_code == 2
    assert r.stderr.startswith("error: manifest is not valid JSON"), r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit)


# ------------------------------------------------------------------ demo


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_demo_end_to_end_slow(tmp_path: Path) -> None:
    """SLOW: spawns 4 gloo ranks to save and 2 to load, through ``python -m unickpt demo --reshard``."""
    r = run_cli("demo", "--reshard", "--dir", str(tmp_path), timeout=230)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "tensors bitwise equal: 42/42; plain values equal: yes; verify: OK" in out, out
    assert out.count("✓") == 42 and "✗" not in out
    # 2-D sharding on save, a different 1-D layout on load
    assert re.search(r"optim\.exp_avg\.output\.weight\s*│\s*250x64\s*│\s*\(S\(0\), S\(0\)\) on mesh \(2, 2\)\s*│\s*4\s*│\s*\(S\(1\)\) on mesh \(2,\)", out), out
    assert re.search(r"model\.norm\.weight\s*│\s*64\s*│\s*\(R, R\) on mesh \(2, 2\)\s*│\s*1\s*│\s*\(R\) on mesh \(2,\)", out), out
    assert re.search(r"timings: save \d+\.\d+ s .* load \d+\.\d+ s", out), out
    from unickpt.demo import LEGEND

    assert LEGEND in out and "each writes an equal part" in LEGEND  # why (R, R) takes 1 or 2 fragments
    # --dir keeps the checkpoint, and it is a valid one
    ckpt = tmp_path / "step_000010"
    report = unickpt.verify(str(ckpt))
    assert report.ok and report.tensors == 42
    assert unickpt.read_manifest(str(ckpt)).world_size == 4


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_resume_demo_end_to_end_slow(tmp_path: Path) -> None:
    """SLOW: the README's main command: train on 4 ranks, resume on 3, table + PNG plot."""
    plot = tmp_path / "curves.png"
    r = run_cli("demo", "--dir", str(tmp_path / "d"), "--plot", str(plot), timeout=390)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert re.search(r"OK: max relative difference after the resume \d\.\de[-+]\d+ \(bound 1e-4\)", out), out
    for step in range(9, 17):
        assert re.search(rf"│\s+{step} │ \d\.\d{{6}} │ \d\.\d{{6}} │", out), out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    assert unickpt.CheckpointManager(tmp_path / "d" / "checkpoints").steps() == [8, 16]


# ------------------------------------------------------------------ the first hour (issue 12)


def _saved_with_rank_tensor(tmp_path: Path, name: str = "model.w") -> Path:
    """A checkpoint as the example trainer writes it: global tensors and a per-rank RNG tensor."""
    path = tmp_path / "step_7"
    state = {"model": {"a": torch.ones(3), name[len("model."):]: torch.arange(4.0)},
             "rng": unickpt.PerRank(torch.get_rng_state()), "step": 7}
    unickpt.save(state, str(path))
    return path


def test_convert_to_dcp_refuses_to_drop_per_rank_state_unless_allowed(ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dcp"
    r = invoke("convert", str(ckpt), str(dst), "--to", "dcp")
    assert r.exit_code == 1, r.output
    lines = r.stdout.splitlines()
    assert "warning: per-rank state has no DCP equivalent and was left out: dataloader" in lines, r.stdout
    assert "warning: the checkpoint's metadata= has no DCP equivalent and was left out" in lines, r.stdout
    assert "NOT CONVERTED" in r.stdout and "--allow-skip" in r.stdout and "OK" not in r.stdout
    assert lines[-1] == "source: 3 tensors, 704 B read", r.stdout  # the refusal also gives the source's ledger
    assert not (dst / ".metadata").exists()  # nothing written

    r = invoke("convert", str(ckpt), str(dst), "--to", "dcp", "--allow-skip")
    assert r.exit_code == 0, r.output
    assert "warning: per-rank state has no DCP equivalent and was left out: dataloader" in r.stdout
    assert re.search(r"^OK with 2 warnings: 3 tensors \(unickpt -> dcp\)", r.stdout, re.M), r.stdout
    assert (dst / ".metadata").exists()

    clean = tmp_path / "clean"
    unickpt.save({"w": torch.ones(2)}, str(clean))
    r = invoke("convert", str(clean), str(tmp_path / "dcp2"), "--to", "dcp")
    assert r.exit_code == 0 and r.stdout.startswith("OK: 1 tensors (unickpt -> dcp)") and "warning" not in r.stdout, r.output


def test_cli_errors_name_cli_flags(ckpt: Path, tmp_path: Path) -> None:
    for extra in (["--consolidate"], ["--to", "dcp", "--allow-skip"]):
        dst = tmp_path / f"out{len(extra)}"
        assert invoke("convert", str(ckpt), str(dst), *extra).exit_code == 0
        r = invoke("convert", str(ckpt), str(dst), *extra)
        assert r.exit_code == 2, r.output
        assert "pass --overwrite to replace it" in r.stderr and "overwrite=True" not in r.stderr, r.stderr
        assert invoke("convert", str(ckpt), str(dst), *extra, "--overwrite").exit_code == 0


def test_inspect_missing_path_says_no_such_directory(tmp_path: Path) -> None:
    for command in ("inspect", "verify"):
        r = invoke(command, str(tmp_path / "nonexistent"))
        assert r.exit_code == 2 and r.stderr.strip() == f"error: {tmp_path / 'nonexistent'}: no such directory", r.output
    (tmp_path / "file").write_text("x")
    r = invoke("inspect", str(tmp_path / "file"))
    assert r.exit_code == 2 and r.stderr.strip() == f"error: {tmp_path / 'file'}: not a directory", r.output


def test_inspect_names_a_data_file_missing_or_cut_short(tmp_path: Path) -> None:
    """inspect reads no tensor byte, but stats each file the manifest lists: one cut short
    or gone is named and the exit is 1 (it said nothing and exited 0)."""
    for damage in ("cut", "missing"):
        path = tmp_path / damage
        unickpt.save({"w": torch.arange(64.0)}, str(path))
        data = path / "rank_00000.safetensors"
        size = data.stat().st_size
        if damage == "cut":
            data.write_bytes(data.read_bytes()[:-20])
        else:
            data.unlink()
        r = invoke("inspect", str(path))
        says = f"holds {size - 20} bytes, the manifest says {size}" if damage == "cut" else "missing"
        assert r.exit_code == 1 and f"file rank_00000.safetensors: {says}" in r.output, r.output
        r = invoke("inspect", "--json", str(path))
        assert r.exit_code == 1 and json.loads(r.stdout)["file_problems"] == {"rank_00000.safetensors": says}


def test_verify_counts_tensors_as_inspect_does(tmp_path: Path) -> None:
    path = _saved_with_rank_tensor(tmp_path)
    doc = json.loads(invoke("inspect", str(path), "--json").stdout)
    assert doc["totals"]["tensors"] == 2 and doc["totals"]["per_rank"] == 1
    out = invoke("inspect", str(path)).stdout
    assert "totals: 2 tensors," in out and "1 per-rank entry" in out
    assert re.search(r"^source: 2 tensors \+ 1 per-rank tensor, [\d.]+ KiB read$", out, re.M), out  # not "3 tensors"
    r = invoke("verify", str(path))
    assert r.exit_code == 0 and r.stdout.startswith("OK: 2 tensors + 1 per-rank tensor, "), r.stdout


@pytest.mark.multiprocess
def test_output_to_a_pipe_is_never_wrapped(tmp_path: Path) -> None:
    name = "model." + "layers.0." * 16 + "w"
    assert len(name) >= 150
    path = _saved_with_rank_tensor(tmp_path, name)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # a pipe: rich would assume 80 columns
    r = subprocess.run([sys.executable, "-m", "unickpt", "inspect", str(path)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    (row,) = [ln for ln in r.stdout.splitlines() if name in ln]  # the whole name, on one line
    assert "[4]" in row and "F32" in row, r.stdout
    assert any(ln.startswith("totals: 2 tensors, ") and ln.endswith(")") for ln in r.stdout.splitlines()), r.stdout


def test_piped_output_lists_every_item_left_out(tmp_path: Path) -> None:
    """Issue 29: to a pipe or a file nothing is cut: export's ledger names each of its
    left-out tensors, convert --to deepspeed each value; one grammar for what has no equivalent."""
    path = tmp_path / "c"
    optim = {f"w{i}": {"exp_avg": torch.zeros(2)} for i in range(12)}
    values = {f"v{i:02d}": i for i in range(14)}
    unickpt.save({"model": {"w": torch.ones(2)}, "optim": {"state": optim}, "run": values,
                  "rng": unickpt.PerRank(torch.zeros(3, dtype=torch.uint8))}, str(path))
    r = invoke("export", str(path), str(tmp_path / "hf"), "--no-config")
    assert r.exit_code == 0, r.output
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("source: ")]
    assert " more" not in line and all(f"optim.state.w{i}.exp_avg" in line for i in range(12)), line
    assert line.startswith("source: 1 tensor, 8 B read; 13 left out: "), line  # rng: left out, not a tensor read
    r = invoke("convert", str(path), str(tmp_path / "ds"), "--to", "deepspeed")
    assert r.exit_code == 1, r.output
    warnings = [ln for ln in r.stdout.splitlines() if ln.startswith("warning: ")]
    assert warnings[1] == "warning: values have no DeepSpeed universal equivalent and were left out: " + \
        ", ".join(f"run.v{i:02d}" for i in range(14)), warnings
    assert warnings[2] == "warning: per-rank state has no DeepSpeed universal equivalent and was left out: rng", warnings
    assert r.stdout.splitlines()[-1] == "source: 13 tensors + 1 per-rank tensor, 107 B read", r.stdout
    # a terminal gets a few names per kind
    from unickpt.adapters.regions import source_ledger
    from unickpt.adapters.hf_export import export_ledger, plan_hf_export

    manifest = unickpt.read_manifest(str(path))
    ledger = export_ledger(str(path), manifest, plan_hf_export(manifest))
    assert ledger.line().endswith(" and 7 more because export writes the model only: the tensors named 'model.'"
                                  "... (--prefix); rng because export writes the model only, not per-rank state"), ledger.line()
    assert source_ledger(str(path)).to_json()["per_rank"] == 1


@pytest.mark.multiprocess
def test_demo_dirs_are_removed_on_failure_and_ctrl_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    import unickpt.testing
    from unickpt import demo_resume
    from unickpt.demo import demo_dir, run_demo

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        with demo_dir(None) as d:
            assert d.name.startswith("unickpt-demo-") and d.parent == tmp_path
            (d / "checkpoints").mkdir()
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with demo_dir(tmp_path / "kept") as d:
        (d / "x").write_text("1")
    assert (tmp_path / "kept" / "x").exists()  # --dir: the user's directory is kept

    def interrupted(*args, **kwargs):
        assert [p.name[:13] for p in tmp_path.iterdir() if p.name != "kept"] in (["unickpt-demo-"], ["unickpt-demo-"] * 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_resume, "run_ranks", interrupted)
    monkeypatch.setattr(unickpt.testing, "run_ranks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo_resume.run_resume_demo(None, str(tmp_path / "plot.png"))
    with pytest.raises(KeyboardInterrupt):
        run_demo(None)
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]


def test_demo_plot_labels_the_resume_and_shows_the_relative_difference() -> None:
    from unickpt.demo_resume import RESUME_STEP, plot_figure

    reference = {s: 5.0 - 0.1 * s for s in range(1, 17)}
    resumed = {s: reference[s] * (1 + (1e-3 if s == 12 else 1e-7)) for s in range(RESUME_STEP + 1, 17)}
    resumed[10] = reference[10]  # bitwise equal: drawn, not lost on the log scale
    fig = plot_figure(reference, resumed)
    loss, diff = fig.axes
    assert any(f"job lost after step {RESUME_STEP}" in t.get_text() for t in loss.get_legend().get_texts())
    assert diff.get_yscale() == "log"
    curve = diff.get_lines()[0]
    points = dict(zip(curve.get_xdata(), curve.get_ydata()))
    assert points[12] == pytest.approx(1e-3, rel=1e-6) and points[13] == pytest.approx(1e-7, rel=1e-3)
    lo, hi = diff.get_ylim()
    assert lo < points[10] < 1e-7 and hi > 1e-3
    assert "0: bitwise equal" in [t.get_text() for t in diff.get_legend().get_texts()]


def test_trainer_says_what_it_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from unickpt.examples.train import run

    small = ["--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--seq", "8", "--global-batch", "2",
             "--ckpt-dir", str(tmp_path), "--resume", "latest", "--steps", "6", "--save-every", "3", "--print-every", "2"]
    run(small + ["--stop-after", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"no checkpoint in {tmp_path}: starting fresh", lines
    assert [ln.split("  ")[0] for ln in lines[1:]] == ["step 2/6", "step 3/6"], lines
    assert all(re.fullmatch(r"step \d/6  loss \d+\.\d{4}  \d+\.\d{3} s/step", ln) for ln in lines[1:]), lines
    run(small)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"resumed from {tmp_path / 'step_00000003'} at step 3"] + lines[1:] and len(lines) == 3, lines
    with pytest.raises(SystemExit, match="--resume latest needs --ckpt-dir"):
        run(["--resume", "latest", "--steps", "1"])


def _readme_blocks() -> list[str]:
    """The README's indented shell commands, continuation lines joined."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    return [ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.startswith("    ") and ln.strip()]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_readme_trainer_output_is_what_the_commands_print_slow(tmp_path: Path) -> None:
    """SLOW (4 + 3 gloo ranks): the README's trainer commands, run as written (torchrun of
    this interpreter), print the lines the README shows, times per step aside; the job
    stopped after step 10 on tp2 x dp2 resumes with ``--resume latest`` on dp3, its loss log
    goes on from step 11 and it saved steps 10 and 20 (the real launcher's stop and resume
    on another layout: each step's loss against the unbroken run is tests/test_resume.py's)."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    shown = text.split("The two commands print")[1].split("\n\n")[1]
    want = [ln.strip() for ln in shown.splitlines()]
    assert len(want) == 3 and want[0].startswith("step 10/20  loss "), want
    out = []
    commands = [c for c in _readme_blocks() if "unickpt.examples.train" in c and "--ckpt-dir ckpt " in c]
    assert len(commands) == 2, commands  # "lose" the job after step 10, resume on 3 ranks
    for c in commands:
        args = c.split()[1:]  # the torchrun arguments, as the README gives them
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port()), *args],
                           cwd=tmp_path, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        out += r.stdout.splitlines()
    mask = re.compile(r"\d+\.\d{3} s/step")
    assert [mask.sub("T s/step", ln) for ln in out] == [mask.sub("T s/step", ln) for ln in want], out
    logged = [json.loads(line)["step"] for line in open(tmp_path / "run.jsonl")]
    assert logged == list(range(1, 21)), logged
    assert unickpt.CheckpointManager(tmp_path / "ckpt").steps() == [10, 20]


def test_doc_links_stay_inside_the_repository() -> None:
    """Every relative link of the README and docs/ names a file of this repository (a link
    to ../shared/ or beyond is dead in any clone), and its #anchor a heading there."""
    root = Path(__file__).parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    checked = 0
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve()
            assert dest.is_relative_to(root) and dest.exists(), f"{page.name}: dead link {target}"
            if anchor:
                heads = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                         for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                assert anchor in heads, f"{page.name}: no heading #{anchor} in {path}"
            checked += 1
    assert checked > 10


@pytest.mark.multiprocess
def test_readme_commands_run_from_the_venv_and_save_what_they_use() -> None:
    commands = _readme_blocks()
    for c in commands:  # nothing relies on an activated venv
        assert not re.match(r"(torchrun|unickpt|python) ", c), c
    saved: set[int] = set()
    trainer = [c for c in commands if "unickpt.examples.train" in c]
    assert trainer and all(c.startswith(".venv/bin/torchrun ") for c in trainer), trainer
    for c in trainer:  # what the trainer's README commands save, run in order
        flags = dict(re.findall(r"(--[a-z-]+) ([^-\s]\S*)", c))
        start = max(saved, default=0) if flags.get("--resume") == "latest" else 0
        last = min(int(flags["--steps"]), int(flags.get("--stop-after", flags["--steps"])))
        every = int(flags.get("--save-every", 0))
        saved |= {s for s in range(start + 1, last + 1) if every and s % every == 0}
    used = {int(s) for c in commands for s in re.findall(r"ckpt/step_(\d{8})", c)}
    assert used and used <= saved, (used, saved)


def test_snapshots_of_a_root_that_is_gone_holds_nothing(tmp_path: Path) -> None:
    """A job that closed cleanly removes the shm root it made: `unickpt snapshots` there
    says nothing is held and exits 0, as on the default root (it was a usage error)."""
    r = invoke("snapshots", str(tmp_path / "gone"))
    assert r.exit_code == 0 and "no such directory, so no keeper and no snapshots" in r.output, r.output
    r = invoke("snapshots", "--json", str(tmp_path / "gone"))
    assert r.exit_code == 0 and json.loads(r.stdout)["jobs"] == []
    (tmp_path / "file").write_text("x")
    r = invoke("snapshots", str(tmp_path / "file"))
    assert r.exit_code == 2 and "not a directory" in r.stderr, r.output
    (tmp_path / "empty").mkdir()  # a root of the user's making, after a clean end: nothing held
    r = invoke("snapshots", str(tmp_path / "empty"))
    assert r.exit_code == 0 and "no keeper running; 0 B of snapshots" in r.output, r.output


def test_snapshots_of_a_checkpoint_directory_points_at_the_shm_root(tmp_path: Path) -> None:
    """A checkpoint directory given for the shm root (the usual slip) is named as such: it
    used to be answered "no keeper running; 0 B of snapshots" while a keeper held some."""
    manager = unickpt.CheckpointManager(str(tmp_path / "ck"), save_every=1)
    manager.restore(state := {"w": torch.ones(2)})
    manager.maybe_save(state, 1)
    manager.close()
    for where in ("ck", "ck/step_00000001"):
        r = invoke("snapshots", str(tmp_path / where))
        assert r.exit_code == 2 and re.search(r"is a checkpoint directory, not a shm root: snapshots live in the node's "
                                              r"shm root, \S+ here", r.stderr), r.output


def test_a_manager_root_given_for_a_checkpoint_names_its_newest(tmp_path: Path) -> None:
    manager = unickpt.CheckpointManager(str(tmp_path / "ck"), save_every=1)
    state = {"w": torch.ones(2)}
    manager.restore(state)
    for step in (1, 2):
        manager.maybe_save(state, step)
    manager.close()
    for command in ("verify", "export"):
        r = invoke(command, str(tmp_path / "ck"), *([str(tmp_path / "out")] if command == "export" else []))
        assert r.exit_code == 2 and "not a checkpoint but a CheckpointManager's root" in r.stderr, r.output
        assert f"the newest committed, {tmp_path / 'ck' / 'step_00000002'}" in r.stderr, r.stderr


FULL_DISK_SCRIPT = """
import resource, signal, sys
from typer.testing import CliRunner
from unickpt.cli import app
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as one on a full disk fails
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
src, out = sys.argv[1:3]
for args in (["convert", src, out + "/u", "--consolidate"], ["convert", src, out + "/dcp", "--to", "dcp"],
             ["convert", src, out + "/ds", "--to", "deepspeed", "--allow-skip"],
             ["export", src, out + "/hf", "--names", "keep", "--no-config"]):
    r = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    print(repr((r.exit_code, r.output.strip().splitlines()[-1])))
"""


@pytest.mark.multiprocess
def test_a_full_disk_fails_each_writer_naming_its_file_and_leaves_nothing(tmp_path):
    """A write that fails (a full disk; here a file-size limit: EFBIG) ends every writer with
    one line naming the file and the error, exit 2 and no destination left: ``--to dcp``
    used to end in torch's zip writer's "unexpected pos", the DeepSpeed writer and export
    in an errno without a file."""
    import ast
    import subprocess
    import sys

    unickpt.save({"model.w": torch.randn(1 << 19), "model.v": torch.randn(1 << 18)}, tmp_path / "src")
    r = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(tmp_path / "src"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = [ast.literal_eval(line) for line in r.stdout.splitlines()]
    files = [r"\.u\.unickpt-[0-9a-f]+/rank_00000\.safetensors", r"dcp/\.unickpt-[0-9a-f]+/__0_0\.distcp",
             r"ds/\.unickpt-[0-9a-f]+/zero/w/fp32\.pt", r"hf/\.unickpt-[0-9a-f]+/model-00001-of-00001\.safetensors"]
    assert len(got) == len(files), r.stdout
    for (code, line), name in zip(got, files):
        assert code == 2 and "File too large (EFBIG)" in line and re.search(f"{tmp_path}/out/{name}", line), line
        assert "Traceback" not in line and "unexpected" not in line, line
    assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == [], os.listdir(tmp_path / "out")
