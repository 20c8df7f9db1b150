"""``ruff check src tests bench`` passes (pyproject's [tool.ruff]: pyflakes and pycodestyle
errors): an undefined name, or an import shadowed by a local, fails the suite — as one
did after a merge, where every ``CheckpointManager.restore`` raised a TypeError."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    assert ruff, "ruff is in the test extra (pip install -e '.[test]')"
    p = subprocess.run([ruff, "check", "--output-format", "concise", "src", "tests", "bench"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
