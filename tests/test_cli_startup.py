"""A command line that starts at once: ``import unickpt``, ``unickpt --help`` and
``unickpt inspect`` / ``verify`` of a native checkpoint never import torch (each checked
in a fresh interpreter). The 0.3 s figure of ``--help`` is measured by
``python -m bench.cli_startup``; here only a generous bound on its CPU time."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unickpt

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent

# runs the command line's main in this interpreter, then says whether torch was imported
WRAPPER = """
import sys
sys.argv = ["unickpt"] + sys.argv[1:]
from unickpt.cli import main
code = 0
try:
    main()
except SystemExit as e:
    code = e.code or 0
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), COLUMNS="200")
    return subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True, env=env, timeout=120)


def test_import_unickpt_imports_no_torch():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    code = "import sys, unickpt; unickpt.UnickptError, unickpt.__version__; print('torch' in sys.modules, 'load' in dir(unickpt))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"]  # the entry points come (with torch) on first use


def test_inspect_and_verify_of_a_native_checkpoint_import_no_torch(tmp_path):
    path = tmp_path / "c"
    unickpt.save({"w": torch.arange(600, dtype=torch.float32), "step": 7}, str(path), block_bytes=256)
    for cmd in ("inspect", "verify"):
        r = _run(cmd, str(path))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "torch imported: False" in r.stderr, r.stderr
    assert "OK: 1 tensor, 2400 bytes verified" in r.stdout
    frag = unickpt.read_manifest(str(path)).tensors["w"].fragments[0]
    with open(path / frag.file, "r+b") as f:  # corruption is still found without torch
        f.seek(frag.offset + 300)
        b = f.read(1)
        f.seek(frag.offset + 300)
        f.write(bytes([b[0] ^ 1]))
    r = _run("verify", str(path))
    assert r.returncode == 1 and "CORRUPT" in r.stdout and f"bytes {frag.offset + 256}-{frag.offset + 512}" in r.stdout, r.stdout
    assert "torch imported: False" in r.stderr


def test_help_imports_no_torch_and_starts_fast():
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = _run("--help")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0 and "inspect" in r.stdout and "torch imported: False" in r.stderr
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert cpu < 1.5, f"--help took {cpu:.2f} s of CPU (importing torch takes about 2 s)"
