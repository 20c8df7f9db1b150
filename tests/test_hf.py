"""Hugging Face export and import (issue 4): ``unickpt export --format hf`` and ``read_hf``.

The example model (interleaved-pair rotary) is trained a few steps, exported, and loaded
by ``transformers.LlamaForCausalLM`` (half-split rotary): its logits on a fixed batch equal
the example model's, which holds only if the q/k rows were reordered right. Also: shard
splitting and the index, bf16 casts, CLI errors, export from a checkpoint sharded over 2
ranks (tp2), and import (read_hf) bitwise and by logits. Offline throughout.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import unickpt  # noqa: E402
from unickpt.adapters.hf import INDEX_NAME, is_hf, read_hf  # noqa: E402
from unickpt.adapters.hf_export import export_hf, parse_size, split_shards  # noqa: E402
from unickpt.engine.tensor_reads import read_entry  # noqa: E402
from unickpt.cli import app  # noqa: E402
from unickpt.examples.model import ModelArgs, Transformer  # noqa: E402
from unickpt.rules.hf import HF_LLAMA, hf_row_of, rotary_from_hf, rotary_to_hf  # noqa: E402
from unickpt.storage.local import LocalStorage  # noqa: E402

from forked import run_forked  # noqa: E402
from train_cases import train  # noqa: E402

transformers = pytest.importorskip("transformers")
ENV = {"COLUMNS": "250", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
FLAGS = ["--steps", "3", "--seed", "3", "--layers", "2", "--save-every", "3"]


def invoke(*args: str):
    """Run the CLI in-process."""
    return CliRunner().invoke(app, list(args), env=ENV)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A checkpoint of the example model after 3 training steps (one process)."""
    from unickpt.examples.train import run

    root = tmp_path_factory.mktemp("hf")
    run(FLAGS + ["--ckpt-dir", str(root / "ck")])
    return str(root / "ck" / "step_00000003")


def example_model(path: str) -> Transformer:
    """The example model with the checkpoint's weights (its size from model_args)."""
    m = unickpt.read_manifest(path)
    args = {k.split(".", 1)[1]: v for k, v in m.values.items() if k.startswith("model_args.")}
    model = Transformer(ModelArgs(**args))
    state = {"model": model.state_dict()}
    unickpt.load(state, path, strict=False)
    model.load_state_dict(state["model"])
    return model.eval()


def batch(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 32), generator=torch.Generator().manual_seed(11))


def hf_logits(path: str, dtype=torch.float32) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(batch()).logits.float()


def expected_hf(ckpt: str, hf_name: str, our_name: str) -> torch.Tensor:
    """The checkpoint tensor as the export must hold it (rotary rows reordered for q/k)."""
    t = unickpt.load_tensor(ckpt, "model." + our_name)
    rotary = HF_LLAMA.hf_name(our_name)[1]
    return rotary_to_hf(t, {"heads": 8, "kv_heads": 4}[rotary]) if rotary else t


def test_export_logits_equal_transformers(ckpt, tmp_path):
    r = invoke("export", ckpt, str(tmp_path / "hf"), "--format", "hf")
    assert r.exit_code == 0, r.output
    assert "21 tensors exported (names: llama)" in r.stdout and "config.json" in r.stdout
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 4
    assert cfg["intermediate_size"] == 256 and cfg["num_hidden_layers"] == 2
    assert is_hf(str(tmp_path / "hf")) and not is_hf(ckpt)
    with torch.no_grad():
        ours = example_model(ckpt)(batch())
    theirs = hf_logits(str(tmp_path / "hf"))
    assert ours.abs().max() > 1
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_rotary_permutation_is_a_row_reordering():
    w = torch.arange(2 * 8 * 3).reshape(16, 3)
    hf = rotary_to_hf(w, heads=2)
    assert torch.equal(rotary_from_hf(hf, heads=2), w)
    for r in range(16):
        assert torch.equal(hf[hf_row_of(r, 8)], w[r])
    assert torch.equal(hf[:4, 0], torch.tensor([0, 6, 12, 18]))  # head 0: even rows, then odd rows


def test_shards_index_and_bitwise(ckpt, tmp_path):
    dst = tmp_path / "hf"
    r = invoke("export", ckpt, str(dst), "--max-shard-size", "100KB")
    assert r.exit_code == 0, r.output
    index = json.loads((dst / INDEX_NAME).read_text())
    wmap = index["weight_map"]
    shards = sorted(set(wmap.values()))
    assert len(shards) >= 4 and shards == sorted(p.name for p in dst.glob("*.safetensors"))
    assert all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    manifest = unickpt.read_manifest(ckpt)
    ours = [n[len("model."):] for n in manifest.tensors if n.startswith("model.")]
    assert set(wmap) == {HF_LLAMA.hf_name(n)[0] for n in ours}
    total = 0
    for shard in shards:
        with safe_open(str(dst / shard), "pt") as f:
            keys = list(f.keys())
            assert keys and all(wmap[k] == shard for k in keys)
            size = sum(f.get_tensor(k).numel() * 4 for k in keys)
            assert size <= 100_000 or len(keys) == 1
            total += size
    assert total == index["metadata"]["total_size"]
    for name in ours:
        hf_name = HF_LLAMA.hf_name(name)[0]
        with safe_open(str(dst / wmap[hf_name]), "pt") as f:
            assert torch.equal(f.get_tensor(hf_name), expected_hf(ckpt, hf_name, name)), name
    assert split_shards([5, 5, 20, 1, 9], 10) == [[0, 1], [2], [3, 4]]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size(1234) == 1234


def test_bf16_export(ckpt, tmp_path):
    dst = tmp_path / "hf16"
    report = export_hf(ckpt, str(dst), dtype="bf16", max_shard_size="150KB")
    assert len(report.shards) > 1
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for hf_name, shard in report.weight_map.items():
        with safe_open(str(dst / shard), "pt") as f:
            t = f.get_tensor(hf_name)
        our = HF_LLAMA.our_name(hf_name)[0]
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, expected_hf(ckpt, hf_name, our).to(torch.bfloat16)), hf_name
    with torch.no_grad():
        ours = example_model(ckpt)(batch())
    torch.testing.assert_close(hf_logits(str(dst), torch.bfloat16), ours, rtol=0.1, atol=0.15)


def test_cli_errors_are_one_line(ckpt, tmp_path):
    cases = [
        (["--max-shard-size", "5XB"], "error: invalid size '5XB'"),
        (["--max-shard-size", "0"], "error: invalid size '0'"),
        (["--format", "gguf"], "error: unknown export format 'gguf' (known: hf)"),
        (["--dtype", "int3"], "error: unknown dtype 'int3'"),
        (["--names", "llama", "--prefix", ""], "error: "),
    ]
    for extra, start in cases:
        r = invoke("export", ckpt, str(tmp_path / "x"), *extra)
        assert r.exit_code == 2, (extra, r.output)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(start), (extra, r.stderr)
    assert not (tmp_path / "x" / INDEX_NAME).exists()
    assert invoke("export", ckpt, str(tmp_path / "y")).exit_code == 0
    r = invoke("export", ckpt, str(tmp_path / "y"))
    assert r.exit_code == 2 and "--overwrite" in r.stderr
    assert invoke("export", ckpt, str(tmp_path / "y"), "--overwrite", "--max-shard-size", "50KB").exit_code == 0
    assert len(list((tmp_path / "y").glob("*.safetensors"))) > 1


def test_config_flag_when_model_args_missing(ckpt, tmp_path):
    """A checkpoint without model_args (saved by other code): q/k cannot be reordered
    without head counts, a clear error says so; ``--config`` gives them, and is written."""
    bare = str(tmp_path / "bare")
    names = [n for n in unickpt.read_manifest(ckpt).tensors if n.startswith("model.")]
    unickpt.save({"model": {n[len("model."):]: unickpt.load_tensor(ckpt, n) for n in names}}, bare)
    r = invoke("export", bare, str(tmp_path / "a"))
    assert r.exit_code == 2 and "pass --config" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    cfg = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 8, "num_key_value_heads": 4}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    r = invoke("export", bare, str(tmp_path / "hf"), "--config", str(tmp_path / "c.json"))
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == cfg
    wmap = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())["weight_map"]
    for hf_name, our in (("model.layers.1.self_attn.q_proj.weight", "layers.1.attention.wq.weight"),
                         ("model.layers.0.self_attn.k_proj.weight", "layers.0.attention.wk.weight")):
        with safe_open(str(tmp_path / "hf" / wmap[hf_name]), "pt") as f:
            assert torch.equal(f.get_tensor(hf_name), expected_hf(ckpt, hf_name, our))
    r = invoke("export", bare, str(tmp_path / "k"), "--names", "keep")  # no reordering needed; no config known
    assert r.exit_code == 1 and "OK" not in r.output and "--no-config" in r.stderr and not (tmp_path / "k").exists(), r.output
    r = invoke("export", bare, str(tmp_path / "k"), "--names", "keep", "--no-config")  # the user adds it
    assert r.exit_code == 0 and "no config.json" in r.stdout, r.output


def _assemble(path: str, entry) -> torch.Tensor:
    storage = LocalStorage(path)
    try:
        return read_entry(storage, entry, 2, False)
    finally:
        storage.close()


def test_read_hf_bitwise_and_logits(tmp_path):
    from safetensors.torch import load_file

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")
    assert (tmp_path / "hf" / INDEX_NAME).exists() and is_hf(str(tmp_path / "hf"))
    m = read_hf(str(tmp_path / "hf"))
    assert m.provenance["format"] == "hf" and m.world_size == 1
    seen = 0
    for shard in sorted((tmp_path / "hf").glob("*.safetensors")):
        for name, t in load_file(str(shard)).items():
            frag = m.tensors[name].fragments[0]
            assert frag.file == shard.name and frag.crc32c == []
            raw = shard.read_bytes()[frag.offset : frag.offset + t.numel() * t.element_size()]
            assert torch.equal(torch.frombuffer(bytearray(raw), dtype=t.dtype).reshape(t.shape), t), name
            assert torch.equal(_assemble(str(tmp_path / "hf"), m.tensors[name]), t), name
            seen += 1
    assert seen == len(m.tensors) == 21
    # with the llama names: the example model, loaded through the pieces, computes HF's logits
    mapped = read_hf(str(tmp_path / "hf"), names=HF_LLAMA, prefix="model.")
    model = Transformer(ModelArgs(dim=32, layers=2, heads=4, kv_heads=2, vocab=128, seq=32))
    for name, p in model.named_parameters():
        with torch.no_grad():
            p.copy_(_assemble(str(tmp_path / "hf"), mapped.tensors["model." + name]))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(batch()), hf(batch()).logits, rtol=1e-5, atol=1e-5)


def test_export_import_round_trip(ckpt, tmp_path):
    export_hf(ckpt, str(tmp_path / "hf"), max_shard_size="64KiB")
    m = read_hf(str(tmp_path / "hf"), names=HF_LLAMA, prefix="model.")
    source = unickpt.read_manifest(ckpt)
    model_names = {n for n in source.tensors if n.startswith("model.")}
    assert set(m.tensors) == model_names
    for name in model_names:
        assert torch.equal(_assemble(str(tmp_path / "hf"), m.tensors[name]), unickpt.load_tensor(ckpt, name)), name


@pytest.mark.multiprocess
def test_export_from_two_ranks_tp2(tmp_path):
    """A checkpoint saved by 2 tensor-parallel ranks (sharded wq/wk/...): the export gathers
    every tensor from its fragments, and transformers computes the example model's logits."""
    run_forked(train, 2, ["--tp", "2", "--stop-after", "2", "--save-every", "2", "--layers", "2",
                         "--ckpt-dir", str(tmp_path / "ck")], None)
    path = str(tmp_path / "ck" / "step_00000002")
    m = unickpt.read_manifest(path)
    assert m.world_size == 2 and len(m.tensors["model.layers.0.attention.wq.weight"].fragments) == 2
    report = export_hf(path, str(tmp_path / "hf"), max_shard_size="100KB")
    assert report.names == "llama" and report.config_written and len(report.shards) > 1
    with torch.no_grad():
        ours = example_model(path)(batch())
    torch.testing.assert_close(hf_logits(str(tmp_path / "hf")), ours, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
def test_export_streams_with_bounded_memory(tmp_path):
    """Exporting a 128 MiB model (16 tensors of 8 MiB) with a cast grows the peak RSS of
    the process by far less than the model: tensors are read and written one at a time."""
    import subprocess
    import sys

    unickpt.save({"model": {f"w{i}": torch.full((1024, 2048), float(i)) for i in range(16)}}, str(tmp_path / "ck"))
    child = (
        "import resource, sys, unickpt.adapters.hf_export as x\n"
        "peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "base = peak()\n"
        "x.export_hf(sys.argv[1], sys.argv[2], names='keep', dtype='bf16', max_shard_size='40MB')\n"
        "print(base, peak())\n"
    )
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path / "ck"), str(tmp_path / "hf")],
                         capture_output=True, text=True, check=True).stdout
    base, used = (int(v) for v in out.split())
    assert used - base < 64 << 20, f"export grew the peak RSS by {(used - base) >> 20} MiB for a 128 MiB model"
    assert len(json.loads((tmp_path / "hf" / INDEX_NAME).read_text())["weight_map"]) == 16
