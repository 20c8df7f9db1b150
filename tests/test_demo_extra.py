"""matplotlib is only in the ``demo`` extra (issue 33): without it the demos stop at once,
before any training, with an error that names the remedy."""

from __future__ import annotations

import sys

import pytest

from unickpt.errors import UnickptError



@pytest.mark.parametrize("demo", ["resume", "fault"])
def test_a_demo_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path, demo):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it raises: ImportError
    if demo == "resume":
        from unickpt.demo_resume import run_resume_demo as run
    else:
        from unickpt.demo_fault import run_fault_demo as run
    with pytest.raises(UnickptError, match=r"pip install 'unickpt\[demo\]'"):
        run(str(tmp_path), str(tmp_path / "plot.png"))
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written
