"""Object stores: every entry point on s3:// URLs against a real S3-compatible server
(moto's server, a subprocess on 127.0.0.1), and the two-tier CheckpointManager."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import warnings

import pytest
import torch

import unickpt
from unickpt import TierFallbackWarning
from unickpt.api.load import load_into
from unickpt.storage.fsspec_store import FsspecStorage
from unickpt.testing import run_ranks

from objstore_cases import BUCKET, PRELOAD, S3Server, load_d2_counting, save_a4, save_then_die, tiered_training

@pytest.fixture(scope="session")
def s3():
    """One server for the session; the standard environment points every client at it
    (this process and the ranks and commands it starts)."""
    server = S3Server()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.kill()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _keys(server: S3Server, prefix: str) -> list[str]:
    out = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


def _uploads(server: S3Server, prefix: str) -> list[str]:
    return [u["Key"] for u in server.client().list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])]


@pytest.mark.multiprocess
def test_save_load_and_every_entry_point_take_urls(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"s3://{BUCKET}/single/step_5"
    state = {"w": torch.randn(300, 7), "ids": torch.arange(11), "step": 5, "rng": unickpt.PerRank(torch.tensor([1, 2]))}
    unickpt.save(state, url)
    assert not os.path.exists("s3:"), "a URL must never become a local directory"
    assert _keys(s3, "single/step_5/") == ["single/step_5/manifest.json", "single/step_5/rank_00000.safetensors"]
    out = {"w": torch.zeros(300, 7), "ids": torch.zeros(11, dtype=torch.long), "step": 0, "rng": unickpt.PerRank(None)}
    unickpt.load(out, url)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["ids"], state["ids"]) and out["step"] == 5
    assert torch.equal(out["rng"].value, torch.tensor([1, 2]))
    assert torch.equal(unickpt.load_tensor(url, "w"), state["w"])
    with pytest.raises(unickpt.SaveError, match="already holds a committed checkpoint"):
        unickpt.save(state, url)
    unickpt.async_save({"w": state["w"] * 2, "step": 6}, url, overwrite=True).result()
    assert _keys(s3, "single/step_5/") == ["single/step_5/manifest.json", "single/step_5/rank_00000.safetensors"]
    assert torch.equal(unickpt.load_tensor(url, "w"), state["w"] * 2)
    assert unickpt.verify(url).ok
    report = unickpt.convert(url, f"s3://{BUCKET}/single/consolidated")
    assert report.tensors == 1 and unickpt.verify(f"s3://{BUCKET}/single/consolidated").ok

    from unickpt.adapters.hf_export import export_hf

    unickpt.save({"model.embed_tokens.weight": state["w"]}, f"s3://{BUCKET}/single/model")
    export_hf(f"s3://{BUCKET}/single/model", f"s3://{BUCKET}/single/hf", names="keep")
    assert "single/hf/model.safetensors.index.json" in _keys(s3, "single/hf/")

    unickpt.save(state, "memory://unickpt-test/step_5")  # any fsspec file system: one PUT per file
    unickpt.load(out, "memory://unickpt-test/step_5")
    assert torch.equal(out["w"], state["w"])
    with pytest.raises(unickpt.StorageError, match="unsupported storage URL scheme 'nosuchscheme'"):
        unickpt.save(state, "nosuchscheme://bucket/x")
    assert os.listdir(".") == []
    with pytest.raises(unickpt.NotACheckpointError, match=f"s3://{BUCKET}/nothing"):
        unickpt.load(out, f"s3://{BUCKET}/nothing")


@pytest.mark.multiprocess
def test_four_rank_save_two_rank_resharded_load_fetches_only_its_bytes(s3, tmp_path):
    url = f"s3://{BUCKET}/reshard/a4"
    run_ranks(save_a4, 4, s3.env(), url, preload=PRELOAD)
    files = {k.rsplit("/", 1)[1]: s3.client().head_object(Bucket=BUCKET, Key=k)["ContentLength"] for k in _keys(s3, "reshard/a4/")}
    assert sorted(files) == ["manifest.json"] + [f"rank_{r:05d}.safetensors" for r in range(4)]
    run_ranks(load_d2_counting, 2, s3.env(), url, str(tmp_path / "counts"), preload=PRELOAD)
    for rank in range(2):
        got = json.loads((tmp_path / f"counts.{rank}.json").read_text())
        # one GET of the manifest, then ranged GETs of exactly the planned bytes: no file whole
        assert got["get_bytes"] == files["manifest.json"] + got["planned"], got
        data = [r for r in got["ranges"] if r[0] != "manifest.json"]
        assert all(stop - start < files[name] for name, start, stop in data), data
        assert sum(stop - start for _, start, stop in data) < sum(n for f, n in files.items() if f != "manifest.json") / 2


@pytest.mark.multiprocess
def test_killed_save_leaves_no_checkpoint_and_the_manager_cleans(s3, tmp_path):
    root = f"s3://{BUCKET}/killed"
    failure: list[BaseException] = []

    def ranks() -> None:
        try:
            run_ranks(save_then_die, 2, s3.env(), root, str(tmp_path), preload=PRELOAD, timeout=120)
        except BaseException as e:  # noqa: BLE001  (the ranks are killed: expected)
            failure.append(e)

    thread = threading.Thread(target=ranks)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        # mid-upload: rank 1's file is complete, rank 0's multipart upload is open
        while not (_uploads(s3, "killed/step_00000005/") and "killed/step_00000005/rank_00001.safetensors" in _keys(s3, "killed/")):
            assert time.monotonic() < deadline and thread.is_alive(), f"the save never started uploading: {failure}"
            time.sleep(0.02)
    finally:
        for rank in range(2):
            try:
                os.kill(int((tmp_path / f"{rank}.pid").read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        thread.join()
    assert failure, "the ranks were killed: run_ranks must report it"
    assert "killed/step_00000005/manifest.json" not in _keys(s3, "killed/")
    manager = unickpt.CheckpointManager(root)
    assert manager.steps() == [1]
    assert manager.latest() == f"{root}/step_00000001"
    with pytest.raises(unickpt.NotACheckpointError):
        unickpt.load({"w": torch.zeros(10)}, f"{root}/step_00000005")
    manager.save({"w": torch.ones(10)}, 6)
    assert not _uploads(s3, "killed/") and not _keys(s3, "killed/step_00000005/")
    assert manager.steps() == [1, 6]


class _ServerGoesAway:
    """The storage of a load whose server is killed when the first data file is opened."""

    def __init__(self, inner: FsspecStorage, server: S3Server) -> None:
        self.inner, self.server = inner, server

    def reader(self, name: str):
        self.server.kill()
        return self.inner.reader(name)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.multiprocess
def test_server_gone_mid_load_is_a_clear_error():
    server = S3Server()
    try:
        server.client().create_bucket(Bucket=BUCKET)
        opts = {"endpoint_url": server.url, "key": "testing", "secret": "testing"}
        url = f"s3://{BUCKET}/gone/step_1"
        state = {"w": torch.randn(64, 64), "v": torch.randn(10)}
        unickpt.save(state, url, storage_options=opts)
        t0 = time.monotonic()
        with pytest.raises(unickpt.StorageError, match=f"{url}/rank_00000.safetensors: .*(connect|Connect)"):
            load_into({"w": torch.zeros(64, 64), "v": torch.zeros(10)}, url, storage_options=opts,
                      storage=_ServerGoesAway(FsspecStorage(url, opts), server))
        assert time.monotonic() - t0 < 30, "retries and timeouts must be bounded"
    finally:
        server.kill()


@pytest.mark.multiprocess
def test_server_gone_mid_save_reports_the_upload_error_not_the_cleanup(caplog):
    """The server goes away while a data file is uploaded in parts (behind a throttled
    proxy, so that the upload is still open): the save's error is the upload's; the
    removal of the partial file, failing too, used to replace it ("remove failed") and is
    now a warning."""
    from objstore_cases import ThrottledProxy

    server = S3Server()
    proxy = ThrottledProxy(server.port, 16e6)
    try:
        server.client().create_bucket(Bucket=BUCKET)
        opts = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing",
                "config_kwargs": {"retries": {"max_attempts": 1}}}  # a refused connection fails at once
        url = f"s3://{BUCKET}/gone/step_2"
        failure: list[BaseException] = []

        def save() -> None:
            try:
                unickpt.save({"w": torch.randn(16 << 20)}, url, storage_options=opts)  # 64 MiB: 4 parts, ~4 s
            except BaseException as e:  # noqa: BLE001  (looked at below)
                failure.append(e)

        thread = threading.Thread(target=save)
        thread.start()
        deadline = time.monotonic() + 60
        while not _uploads(server, "gone/step_2/"):
            assert time.monotonic() < deadline and thread.is_alive(), f"the upload never started: {failure}"
            time.sleep(0.02)
        proxy.close()  # first: no connection is accepted that the dead server would leave hanging
        server.kill()
        thread.join(120)
        assert not thread.is_alive() and failure, "the save must fail"
        text = str(failure[0])
        assert isinstance(failure[0], unickpt.SaveError) and "upload" in text and "remove failed" not in text, text
        assert "could not remove its partial file" in caplog.text and "remove failed" in caplog.text, caplog.text
    finally:
        proxy.close()
        server.kill()


@pytest.mark.multiprocess
def test_cli_inspect_and_verify_on_s3(s3):
    from typer.testing import CliRunner

    from unickpt.cli import app

    url = f"s3://{BUCKET}/cli/step_1"
    unickpt.save({"w": torch.randn(20, 5), "step": 1}, url)
    r = CliRunner().invoke(app, ["inspect", url, "--json"])
    assert r.exit_code == 0, r.output
    assert [t["name"] for t in json.loads(r.output)["tensors"]] == ["w"]
    r = CliRunner().invoke(app, ["convert", url, f"s3://{BUCKET}/cli/universal", "--consolidate"])
    assert r.exit_code == 0 and unickpt.verify(f"s3://{BUCKET}/cli/universal").ok, r.output
    unickpt.save({"model.layers.0.w": torch.randn(4, 4)}, f"s3://{BUCKET}/cli/model")
    r = CliRunner().invoke(app, ["export", f"s3://{BUCKET}/cli/model", f"s3://{BUCKET}/cli/hf", "--names", "keep", "--no-config"])
    assert r.exit_code == 0 and "cli/hf/model-00001-of-00001.safetensors" in _keys(s3, "cli/hf/"), r.output
    r = CliRunner().invoke(app, ["verify", url])
    assert r.exit_code == 0 and "OK" in r.output, r.output
    r = CliRunner().invoke(app, ["verify", f"s3://{BUCKET}/cli/missing"])
    assert r.exit_code == 2 and "error:" in r.output and "not a committed unickpt checkpoint" in r.output, r.output


@pytest.mark.multiprocess
def test_convert_to_dcp_from_s3(s3, tmp_path):
    """``convert s3://... LOCAL --to dcp`` used to fail with an internal AttributeError (the
    same-location check resolved the URL source as a path): a URL source is written out;
    the destination is still refused when it is the (local) source itself."""
    from typer.testing import CliRunner

    from unickpt.adapters.dcp_writer import write_dcp
    from unickpt.cli import app

    url, dst = f"s3://{BUCKET}/todcp/step_1", tmp_path / "dcp"
    w = torch.randn(6, 4)
    unickpt.save({"w": w, "step": 1}, url)
    r = CliRunner().invoke(app, ["convert", url, str(dst), "--to", "dcp"])
    assert r.exit_code == 0, r.output
    assert (dst / ".metadata").is_file() and torch.equal(unickpt.load_tensor(str(dst), "w"), w)
    with pytest.raises(unickpt.SaveError, match="destination must differ from the source"):
        write_dcp(str(dst), str(tmp_path / "." / "dcp"), overwrite=True)


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(50, 8, generator=g), "step": step}


@pytest.mark.multiprocess
def test_two_tier_manager_falls_back_to_the_object_store(s3, tmp_path):
    local, durable = tmp_path / "fast", f"s3://{BUCKET}/tiers"
    manager = unickpt.CheckpointManager(local, keep=2, durable=durable, durable_every=2, durable_keep=1)
    for step in range(1, 5):
        manager.save(_state(step), step)
    manager.wait()
    assert manager.durable_errors == []
    assert manager.steps() == [3, 4] and manager.durable.steps() == [4]  # copies of steps 2 and 4; keep 1
    assert manager.latest() == str(local / "step_00000004")

    def load_step(expect_warning: str | None) -> str:
        out = {"w": torch.zeros(50, 8), "step": 0}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            where = manager.load(out)
        fallbacks = [str(w.message) for w in seen if issubclass(w.category, TierFallbackWarning)]
        if expect_warning is None:
            assert not fallbacks
        else:
            assert len(fallbacks) == 1 and expect_warning in fallbacks[0], fallbacks
        assert out["step"] == 4 and torch.equal(out["w"], _state(4)["w"])
        return where

    assert load_step(None) == str(local / "step_00000004")
    data = local / "step_00000004" / "rank_00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit on the local disk
    data.write_bytes(bytes(raw))
    assert load_step("failed its checks") == f"{durable}/step_00000004"
    import shutil

    shutil.rmtree(local)  # the local copies are gone
    assert manager.latest() == f"{durable}/step_00000004"
    assert load_step("missing") == f"{durable}/step_00000004"


@pytest.mark.multiprocess
def test_a_hung_durable_tier_never_stalls_the_loop(tmp_path):
    """The object store stops answering (SIGSTOP: connections open, no byte moves) while
    step 2 is copied: the saves of steps 3 and 4, each due for a copy too, return at once
    (the loop used to wait for the copy before, for as long as the store hung: minutes);
    step 3's copy, queued, gives way to step 4's; once the store answers again the copies
    of steps 2 and 4 complete, and the fast tier's retention lets step 2 go."""
    server = S3Server()
    try:
        server.client().create_bucket(Bucket=BUCKET)
        opts = {"endpoint_url": server.url, "key": "testing", "secret": "testing"}
        manager = unickpt.CheckpointManager(tmp_path / "fast", keep=2, durable=f"s3://{BUCKET}/hung", durable_every=1,
                                            durable_storage_options=opts)
        manager.save(_state(1), 1)
        manager.wait()
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            manager.save(_state(2), 2)  # its copy starts, and hangs
            t0 = time.monotonic()
            manager.save(_state(3), 3)
            manager.save(_state(4), 4)
            took = time.monotonic() - t0
            assert manager.steps() == [2, 3, 4]  # step 2 kept while it is copied
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert took < 5, f"the saves of steps 3 and 4 waited {took:.1f} s for the durable tier"
        assert manager.durable_skipped == [3]
        manager.wait()
        assert manager.durable_errors == [] and manager.durable.steps() == [1, 2, 4]
        assert manager.steps() == [3, 4]
    finally:
        server.kill()


EXIT_SCRIPT = """
import faulthandler, os, signal, sys, threading, torch, unickpt
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that finds it hung shows where
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal (a background job inherits it ignored)
from unickpt.engine import exit_wait
exit_wait.NOTICE_S = 1.0  # the notice after 1 s, not 5
fast, durable, pid = sys.argv[1:4]
opts = {"endpoint_url": os.environ.get("S3_URL"), "key": "testing", "secret": "testing"} if durable.startswith("s3:") else None
manager = unickpt.CheckpointManager(fast, durable=durable, durable_every=1, durable_storage_options=opts)
if int(pid):
    os.kill(int(pid), signal.SIGSTOP)  # the store stops answering: the copy started next hangs
manager.save({"w": torch.arange(float(1 << 24)), "step": 1}, 1)
copying = [t.name for t in threading.enumerate() if t.name.startswith("unickpt-durable-copy")]
print("returning; copying:", copying, flush=True)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # a Ctrl-C goes to another thread, as the kernel may do
if sys.argv[4:] == ["close"]:
    manager.close()
"""


def _line(stream, proc: subprocess.Popen, timeout: float = 60) -> str:
    """The next line of ``stream`` (the script's stdout or stderr); a failure, not a hung
    test, when none comes within ``timeout``."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got:
        proc.send_signal(signal.SIGUSR1)  # its threads' stacks, on stderr
        time.sleep(1)
        proc.kill()
        raise AssertionError(f"no line within {timeout} s")
    return got[0]


def _exit_script(*args: str, env: dict | None = None):
    import sys

    return subprocess.Popen([sys.executable, "-c", EXIT_SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


@pytest.mark.multiprocess
def test_a_script_that_ends_after_its_save_still_has_it_copied_to_the_durable_tier(tmp_path):
    """The copy to the durable tier runs in a daemon thread: a script that returned right
    after its last save (no ``close()``) lost it at exit, the durable tier holding an
    empty step directory. Exit now waits for it, as for an async save."""
    proc = _exit_script(str(tmp_path / "fast"), str(tmp_path / "durable"), "0")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "copying: ['unickpt-durable-copy-1']" in out, out  # the copy was still running when the script ended
    copy = str(tmp_path / "durable" / "step_00000001")
    assert unickpt.verify(copy).ok and torch.equal(unickpt.load_tensor(copy, "w"), torch.arange(float(1 << 24)))
    assert "waiting for" not in err, err


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["exit", "close"])
def test_exit_names_the_copy_it_waits_for_on_a_hung_store_and_ctrl_c_gives_it_up(s3, tmp_path, where):
    """The store hangs: exit (or ``close()``) waits for the copy, says so on stderr after
    ``NOTICE_S`` (the script sets 1 s), and Ctrl-C ends the wait at once, saying the copy
    was given up: at exit, never a traceback; in ``close()``, the ``KeyboardInterrupt``
    goes on (the script's own traceback) and exit does not wait for the copy again."""
    proc = _exit_script(str(tmp_path / "fast"), f"s3://{BUCKET}/{where}", str(s3.proc.pid), where,
                        env={"S3_URL": s3.url})
    try:
        assert "returning" in _line(proc.stdout, proc)
        t0 = time.monotonic()
        notice = _line(proc.stderr, proc)
        waited = time.monotonic() - t0
        until = " before exiting" if where == "exit" else ""
        assert notice.startswith(f"unickpt: waiting for the copy of step 1 to the durable tier s3://{BUCKET}/{where} to "
                                 f"finish{until} (Ctrl-C gives it up"), notice
        assert 0.5 < waited < 6, waited
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # its threads' stacks, on stderr
            time.sleep(1)
            proc.kill()
            raise AssertionError(f"still running 30 s after Ctrl-C:\n{proc.communicate()[1]}") from None
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(s3.proc.pid, signal.SIGCONT)  # the session's server answers again
        proc.kill()
    if where == "exit":
        assert f"exiting without waiting for the copy of step 1 to the durable tier s3://{BUCKET}/exit: not committed" \
            in err and "Traceback" not in err, err
    else:
        assert f"gave up waiting for the copy of step 1 to the durable tier s3://{BUCKET}/close: not committed" in err, err
        assert err.rstrip().endswith("KeyboardInterrupt") and "to finish before exiting" not in err, err  # not waited again
        assert proc.returncode in (130, -signal.SIGINT), proc.returncode  # Python's exit on an unhandled Ctrl-C


@pytest.mark.multiprocess
def test_trainer_on_s3_and_resume_from_the_durable_tier(s3, tmp_path):
    out = tmp_path / "runs.json"
    run_ranks(tiered_training, 1, s3.env(), str(tmp_path / "local"), f"s3://{BUCKET}/trainer", str(out), preload=PRELOAD)
    runs = json.loads(out.read_text())
    full = {r["step"]: r["loss"] for r in runs["s3_full"]}
    assert sorted(full) == list(range(1, 9))
    assert [r["step"] for r in runs["tiers_first"]] == [1, 2, 3, 4]
    # the local copies were deleted: the run resumed from the object store's step 4
    assert [r["step"] for r in runs["tiers_resumed"]] == [5, 6, 7, 8]
    assert all(r["loss"] == full[r["step"]] for r in runs["tiers_resumed"]), runs["tiers_resumed"]
