import os
import sys
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
# Compiled modules are written and read: where PYTHONDONTWRITEBYTECODE is set (these machines
# set it), no __pycache__ of unickpt or of the tests was ever written, so each of the suite's
# hundreds of fresh interpreters (a launcher, a keeper, a CLI call, a spawned trainer) compiled
# every unickpt module it imported from source, and each pytest worker rewrote and compiled
# every test module at collection (5 s of each worker's collection here). Set here, before the
# workers start: they and every process the tests start inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def _compile_installed_packages() -> None:
    """The README's set-up installs with ``pip --no-compile``: pip compiles one file after the
    other (41 of its 87 s here), and compiled lazily instead, the many processes a story
    starts at once each compiled the same modules (a fresh clone's torchtitan and demo files
    30-50 s slower). So the controller compiles the installed packages here, once, on every
    core (22 s here), before the workers start; an environment pip compiled is left as it is."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None or os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return
    packages = os.path.dirname(os.path.dirname(spec.origin))  # the site-packages torch is in
    if os.access(packages, os.W_OK):
        # a file of a newer Python's syntax (torch ships one) fails, as under pip: not an
        # error. Left to compile when imported, if ever: transformers' model folders but the
        # two the tests import (3 of the 22 s), pip's and setuptools' own code
        import re

        skip = re.compile(r"/(transformers/models/(?!llama/|auto/|__init__)|pip/|setuptools/)")
        compileall.compile_dir(packages, quiet=2, workers=os.cpu_count() or 1, rx=skip)


_compile_installed_packages()


def _worker_ports() -> None:
    """Under pytest-xdist, each worker (gw0, gw1, ...) takes the free ports its tests hand
    to torchrun, rendezvous and servers from a slice of its own below the kernel's
    ephemeral range (unickpt.testing.free_port reads it): two workers never pick the same
    port, and the kernel never gives it to a client socket in between."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return
    try:
        ephemeral = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    width = 2000
    lo = 10000 + width * int(worker[2:])
    if lo + width <= ephemeral:
        os.environ["UNICKPT_TEST_PORTS"] = f"{lo}-{lo + width - 1}"


_worker_ports()


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_basetemp(tmp_path_factory: pytest.TempPathFactory):
    """The temporary files of every process the tests start go under this run's pytest
    basetemp (pytest keeps the newest three runs), not into /tmp for good: a torchrun agent
    makes a torchelastic_* log folder per run when given no --log-dir (about 150 a suite
    run), and a SIGKILLed agent or launcher cannot remove its own."""
    tmp = str(tmp_path_factory.mktemp("tmp"))
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = tmp, None  # tempfile reads $TMPDIR again
    yield
    if saved is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved
    tempfile.tempdir = None


@pytest.fixture
def shm_roots():
    """Shm roots a test registers; the snapshot keepers left under them are killed after it."""
    from snapshot_helpers import kill_keeper

    roots: list[str] = []
    yield roots
    for r in roots:
        kill_keeper(r)


# The test files that take the longest (seconds of one worker: the run summary's list below,
# 2 cores shared at load 4-8), longest first. Under `-n 2 --dist loadfile
# --no-loadscope-reorder` the workers take files in collection order, each the next one when
# it runs dry: started first, the long files end together and the short ones fill in after
# them, so both workers finish within about the shortest file's time of each other. A file
# not listed runs after these, in its usual order; a wrong place costs balance, never
# correctness.
LONGEST_FIRST: list[str] = [
    "test_live.py", "test_snapshot.py", "test_launch.py", "test_resume.py", "test_cli.py",
    "test_manager_loop.py", "test_demo_fault.py", "test_lightning.py", "test_torchtitan.py", "test_hf_trainer.py",
    "test_snapshot_fuzz.py", "test_deepspeed.py", "test_objstore.py", "test_clean_exit.py",
    "test_dist_torch_parallel.py", "test_bench_gpu.py", "test_dcp_plugin.py", "test_deltas.py", "test_megatron.py",
    "test_dist_reshard.py", "test_dcp.py", "test_deepspeed_layouts.py", "test_rules_megatron.py",
    "test_optimizer_restart.py", "test_async_save.py", "test_rules_convert.py", "test_megatron_moe.py",
    "test_scale.py", "test_deepspeed_moe.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the longest files first (LONGEST_FIRST), every file's tests still together and
    in their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::", 1)[0], i)

    def key(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(os.path.basename(path), len(rank)), first_seen[path]

    items.sort(key=key)  # stable: each file's tests keep their order


# seconds of tests (setup + call + teardown) per xdist worker and per file, for the summary
_SECONDS: dict[str, dict[str, float]] = {"worker": {}, "file": {}}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    node = getattr(report, "node", None)  # set by xdist on the reports its workers send
    worker = node.gateway.id if node is not None else os.environ.get("PYTEST_XDIST_WORKER", "main")
    for kind, key in (("worker", worker), ("file", report.nodeid.split("::", 1)[0])):
        _SECONDS[kind][key] = _SECONDS[kind].get(key, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """After --durations: each worker's total (the longest bounds the wall) and the 24
    longest files (what LONGEST_FIRST should list, longest first)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not _SECONDS["file"]:
        return
    workers = ", ".join(f"{w} {s:.0f} s" for w, s in sorted(_SECONDS["worker"].items()))
    terminalreporter.write_sep("=", "seconds of tests per worker and per file")
    terminalreporter.write_line(f"workers: {workers}")
    for path, s in sorted(_SECONDS["file"].items(), key=lambda kv: -kv[1])[:24]:
        terminalreporter.write_line(f"{s:8.1f} s  {path}")
