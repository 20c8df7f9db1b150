"""A Megatron-style tensor-parallel GPT in plain torch, its ZeRO optimizer partitions, and
the per-rank state of any (tp, pp, dp, zero) layout, for the rules tests.

Everything a rank holds is cut from a single-process reference *by code written here*
(torch.chunk, head arithmetic, flatten + pad + chunk), not by the rules, so the tests
check the rules against an independent description of the layouts:

* vocabulary-parallel embedding and output layer, padded to a multiple of 4 * tp rows
  (padding rows hold garbage on save, must be zero after a load);
* fused QKV ``[q_t; k_t; v_t]`` with grouped-query attention (4 query heads, 2 kv heads:
  kv heads are replicated when tp = 4), row-parallel projection;
* fused SwiGLU ``[gate_t; up_t]`` with an uneven hidden size (42 over 4 ranks: 11,11,11,9),
  row-parallel fc2; replicated RMSNorms;
* pipeline stages with stage-local layer numbering;
* ZeRO-1/2: two parameter groups flattened (ZeRO-2 with 4-element alignment and padding to
  a multiple of 2 * dp), cut over dp; ZeRO-3: each parameter cut alone, tail padded.

Module-level functions so spawned ranks (``unickpt.testing.run_ranks``) can import them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import unickpt
from unickpt.engine.assemble import manifest_document
from unickpt.engine.collect import collect
from unickpt.engine.commit import data_file_name, rank_report, write_data_file
from unickpt.dist import Group
from unickpt.format.manifest import DEFAULT_BLOCK_BYTES, MANIFEST_NAME
from unickpt.rules import Coords, ZeroPlan, apply_rules, optimizer_state, presets, reconcile_ranks
from unickpt.storage.local import LocalStorage


@dataclass(frozen=True)
class Cfg:
    """The test model's configuration."""

    vocab: int = 50
    hidden: int = 16
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 4
    ffn: int = 42
    layers: int = 4
    vocab_multiple: int = 4


CFG = Cfg()
STEP = 10
PAD_SAVE = 99.0  # what padding holds on the saving side (must never reach the checkpoint)
GARBAGE = -7.0  # what load targets hold before the load


@dataclass(frozen=True)
class Layout:
    """A job layout: parallel degrees and ZeRO stage (0: no ZeRO)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> Coords:
        return Coords.from_rank(rank, tp=self.tp, pp=self.pp, dp=self.dp)

    def __str__(self) -> str:
        return f"(tp={self.tp}, pp={self.pp}, dp={self.dp}, zero={self.zero})"


# ---------------------------------------------------------------- reference (one process)


def global_shapes(cfg: Cfg = CFG) -> dict[str, tuple[int, ...]]:
    """Global (Megatron) parameter names and shapes, in model order."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out = {"embedding.word_embeddings.weight": (cfg.vocab, cfg.hidden)}
    for i in range(cfg.layers):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = (cfg.hidden,)
        out[p + "self_attention.linear_qkv.weight"] = (q + 2 * kv, cfg.hidden)
        out[p + "self_attention.linear_proj.weight"] = (cfg.hidden, q)
        out[p + "pre_mlp_layernorm.weight"] = (cfg.hidden,)
        out[p + "mlp.linear_fc1.weight"] = (2 * cfg.ffn, cfg.hidden)
        out[p + "mlp.linear_fc2.weight"] = (cfg.hidden, cfg.ffn)
    out["decoder.final_layernorm.weight"] = (cfg.hidden,)
    out["output_layer.weight"] = (cfg.vocab, cfg.hidden)
    return out


def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The deterministic value of a checkpoint entry (seeded by its name)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g)
    if name.endswith("layernorm.weight"):
        t = 1.0 + 0.1 * t
    if ".exp_avg_sq" in name:
        t = t.abs() * 1e-3
    return t


def reference(cfg: Cfg = CFG, keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> dict[str, torch.Tensor]:
    """Every checkpoint entry of the single-process model: ``model.X`` and ``optim.state.X.key``."""
    out = {}
    for n, s in global_shapes(cfg).items():
        out["model." + n] = value("model." + n, s)
        for k in keys:
            out[f"optim.state.{n}.{k}"] = value(f"optim.state.{n}.{k}", s)
    return out


def llama_reference(cfg: Cfg = CFG, keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> dict[str, torch.Tensor]:
    """The same state under the example Llama model's names (fused tensors split)."""
    ref = reference(cfg, keys)
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out = {}
    for prefix, suffix in [("model.", "")] + [("optim.state.", "." + k) for k in keys]:
        def get(n: str) -> torch.Tensor:
            return ref[prefix + n + suffix]

        def put(n: str, t: torch.Tensor) -> None:
            out[prefix + n + suffix] = t.clone()

        put("tok_embeddings.weight", get("embedding.word_embeddings.weight"))
        for i in range(cfg.layers):
            m, L = f"decoder.layers.{i}.", f"layers.{i}."
            qkv = get(m + "self_attention.linear_qkv.weight")
            put(L + "attention.wq.weight", qkv[:q])
            put(L + "attention.wk.weight", qkv[q : q + kv])
            put(L + "attention.wv.weight", qkv[q + kv :])
            put(L + "attention.wo.weight", get(m + "self_attention.linear_proj.weight"))
            fc1 = get(m + "mlp.linear_fc1.weight")
            put(L + "feed_forward.w1.weight", fc1[: cfg.ffn])
            put(L + "feed_forward.w3.weight", fc1[cfg.ffn :])
            put(L + "feed_forward.w2.weight", get(m + "mlp.linear_fc2.weight"))
            put(L + "attention_norm.weight", get(m + "input_layernorm.weight"))
            put(L + "ffn_norm.weight", get(m + "pre_mlp_layernorm.weight"))
        put("norm.weight", get("decoder.final_layernorm.weight"))
        put("output.weight", get("output_layer.weight"))
    return out


# ---------------------------------------------------------------- the tensor-parallel model


def padded_vocab(cfg: Cfg, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of ``vocab_multiple * tp``."""
    m = cfg.vocab_multiple * tp
    return -(-cfg.vocab // m) * m


def stage_layers(cfg: Cfg, pp: int, stage: int) -> range:
    """Global indices of the layers of a pipeline stage (balanced split)."""
    q, r = divmod(cfg.layers, pp)
    start = stage * q + min(stage, r)
    return range(start, start + q + (1 if stage < r else 0))


def kv_slice(cfg: Cfg, tp: int, t: int) -> tuple[int, int]:
    """(first kv head, kv head count) on tp rank t: split, or replicated when kv_heads < tp."""
    if cfg.kv_heads >= tp:
        n = cfg.kv_heads // tp
        return t * n, n
    return t // (tp // cfg.kv_heads), 1


class RMSNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Linear(nn.Module):
    """A bias-free linear layer holding this rank's slice (column or row parallel)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols))


class Attention(nn.Module):
    def __init__(self, cfg: Cfg, tp: int, t: int) -> None:
        super().__init__()
        hq = cfg.heads // tp
        _, hkv = kv_slice(cfg, tp, t)
        self.linear_qkv = Linear((hq + 2 * hkv) * cfg.head_dim, cfg.hidden)  # column: [q_t; k_t; v_t]
        self.linear_proj = Linear(cfg.hidden, hq * cfg.head_dim)  # row

    def forward_partial(self, cfg: Cfg, x: torch.Tensor, tp: int) -> torch.Tensor:
        """This rank's contribution to the attention output (summed over tp ranks)."""
        hq = cfg.heads // tp
        hkv = (self.linear_qkv.weight.shape[0] // cfg.head_dim - hq) // 2
        qkv = x @ self.linear_qkv.weight.T
        q, k, v = qkv.split([hq * cfg.head_dim, hkv * cfg.head_dim, hkv * cfg.head_dim], dim=-1)
        T = x.shape[0]
        q = q.view(T, hq, cfg.head_dim).transpose(0, 1)
        k = k.view(T, hkv, cfg.head_dim).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        v = v.view(T, hkv, cfg.head_dim).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.transpose(0, 1).reshape(T, hq * cfg.head_dim) @ self.linear_proj.weight.T


class MLP(nn.Module):
    def __init__(self, cfg: Cfg, tp: int, t: int) -> None:
        super().__init__()
        f = torch.arange(cfg.ffn).chunk(tp)[t].numel() if t < len(torch.arange(cfg.ffn).chunk(tp)) else 0
        self.linear_fc1 = Linear(2 * f, cfg.hidden)  # column: [gate_t; up_t]
        self.linear_fc2 = Linear(cfg.hidden, f)  # row

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.linear_fc1.weight.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.linear_fc2.weight.T


class Layer(nn.Module):
    def __init__(self, cfg: Cfg, tp: int, t: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden)
        self.self_attention = Attention(cfg, tp, t)
        self.pre_mlp_layernorm = RMSNorm(cfg.hidden)
        self.mlp = MLP(cfg, tp, t)


class Embedding(nn.Module):
    def __init__(self, cfg: Cfg, tp: int) -> None:
        super().__init__()
        self.word_embeddings = Linear(padded_vocab(cfg, tp) // tp, cfg.hidden)


class Decoder(nn.Module):
    def __init__(self, cfg: Cfg, tp: int, t: int, layers: range, last: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(cfg, tp, t) for _ in layers)
        if last:
            self.final_layernorm = RMSNorm(cfg.hidden)


class GPTStage(nn.Module):
    """One (tp rank, pipeline stage) of the Megatron-style GPT, with stage-local names."""

    def __init__(self, cfg: Cfg, coords: Coords) -> None:
        super().__init__()
        self.cfg, self.coords = cfg, coords
        tp, t = coords.tp, coords.tp_rank
        self.first, self.last = coords.pp_rank == 0, coords.pp_rank == coords.pp - 1
        self.global_layers = stage_layers(cfg, coords.pp, coords.pp_rank)
        if self.first:
            self.embedding = Embedding(cfg, tp)
        self.decoder = Decoder(cfg, tp, t, self.global_layers, self.last)
        if self.last:
            self.output_layer = Linear(padded_vocab(cfg, tp) // tp, cfg.hidden)

    def global_name(self, local: str) -> str:
        """The Megatron global name of a stage-local parameter name (test-side renumbering)."""
        if local.startswith("decoder.layers."):
            i, rest = local[len("decoder.layers.") :].split(".", 1)
            return f"decoder.layers.{self.global_layers[int(i)]}.{rest}"
        return local

    def local_of(self, name: str, g: torch.Tensor, pad: float) -> torch.Tensor:
        """This rank's local tensor of global parameter ``name`` whose global value is ``g``."""
        cfg, tp, t = self.cfg, self.coords.tp, self.coords.tp_rank
        if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
            rows = padded_vocab(cfg, tp)
            full = torch.cat([g, torch.full((rows - cfg.vocab, cfg.hidden), pad)])
            return full.chunk(tp)[t].clone()
        if name.endswith("linear_qkv.weight"):
            q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
            k0, nk = kv_slice(cfg, tp, t)
            hd = cfg.head_dim
            return torch.cat([
                g[:q].chunk(tp)[t],
                g[q : q + kv][k0 * hd : (k0 + nk) * hd],
                g[q + kv :][k0 * hd : (k0 + nk) * hd],
            ]).clone()
        if name.endswith("linear_fc1.weight"):
            gate, up = g.chunk(2)
            return torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]]).clone()
        if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
            return g.chunk(tp, dim=1)[t].clone()
        return g.clone()

    def fill(self, ref: dict[str, torch.Tensor], prefix: str = "model.", suffix: str = "", pad: float = 0.0) -> dict[str, torch.Tensor]:
        """Local tensors (stage-local names) cut from the reference entries ``prefix + global + suffix``."""
        return {n: self.local_of(self.global_name(n), ref[prefix + self.global_name(n) + suffix], pad)
                for n, _ in self.named_parameters()}

    def load_local(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy local tensors into the parameters."""
        with torch.no_grad():
            for n, p in self.named_parameters():
                p.copy_(tensors[n])


def forward_tp(ranks: list[GPTStage], tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a one-stage model whose tp ranks are ``ranks``, computed the Megatron way:
    vocab-parallel embedding (masked lookups, summed), partial outputs of row-parallel
    layers summed over ranks (the all-reduce), output logits gathered and cut to the vocabulary."""
    cfg, tp = ranks[0].cfg, len(ranks)
    x = 0
    for r in ranks:
        w = r.embedding.word_embeddings.weight
        lo = r.coords.tp_rank * w.shape[0]
        mask = (tokens >= lo) & (tokens < lo + w.shape[0])
        x = x + w[(tokens - lo).clamp(0, w.shape[0] - 1)] * mask[:, None]
    for i in range(len(ranks[0].decoder.layers)):
        layers = [r.decoder.layers[i] for r in ranks]
        h = layers[0].input_layernorm(x)
        x = x + sum(L.self_attention.forward_partial(cfg, h, tp) for L in layers)
        h = layers[0].pre_mlp_layernorm(x)
        x = x + sum(L.mlp.forward_partial(h) for L in layers)
    x = ranks[0].decoder.final_layernorm(x)
    return torch.cat([x @ r.output_layer.weight.T for r in ranks], dim=-1)[:, : cfg.vocab]


# ---------------------------------------------------------------- ZeRO flat partitions (independent)


def zero_groups(names: list[str]) -> list[list[str]]:
    """Two optimizer groups: weights (with weight decay), then norms (without)."""
    return [[n for n in names if "layernorm" not in n], [n for n in names if "layernorm" in n]]


def zero_params(zero: int) -> tuple[int, int]:
    """(align, pad_to) of a stage: ZeRO-2 here aligns each parameter to 4 elements."""
    return (4, 2) if zero == 2 else (1, 1)


def flatten_partitions(tensors: dict[str, torch.Tensor], groups: list[list[str]], zero: int, dp: int, r: int, pad: float) -> list[torch.Tensor]:
    """Rank r's flat partitions: ZeRO-1/2 group buffers (aligned, padded, cut in dp equal
    parts) or ZeRO-3 per-parameter partitions (ceil(numel/dp) each, tail padded)."""
    if zero == 3:
        out = []
        for g in groups:
            for n in g:
                flat = tensors[n].reshape(-1)
                c = -(-flat.numel() // dp)
                flat = torch.cat([flat, torch.full((c * dp - flat.numel(),), pad)])
                out.append(flat[r * c : (r + 1) * c].clone())
        return out
    align, pad_to = zero_params(zero)
    out = []
    for g in groups:
        parts = []
        at = 0
        for n in g:
            gap = -at % align
            parts.append(torch.full((gap,), pad))
            parts.append(tensors[n].reshape(-1))
            at += gap + tensors[n].numel()
        parts.append(torch.full((-at % (dp * pad_to),), pad))
        flat = torch.cat(parts)
        out.append(flat.chunk(dp)[r].clone())
    return out


# ---------------------------------------------------------------- one rank's state


def megatron_rules(cfg: Cfg = CFG, store: str = "megatron"):
    """The preset under test."""
    return presets.megatron_gpt(cfg.vocab, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn, store=store)


class RankJob:
    """What one rank of a layout holds: the model stage, optimizer state (per-parameter
    moments, or ZeRO flat partitions) and how it enters save/load via the rules."""

    def __init__(self, lay: Layout, rank: int, ref: dict[str, torch.Tensor] | None, keys: tuple[str, ...],
                 pad: float = 0.0, cfg: Cfg = CFG, store: str = "megatron") -> None:
        self.lay, self.rank, self.keys, self.cfg = lay, rank, keys, cfg
        self.coords = lay.coords(rank)
        self.rules = megatron_rules(cfg, store)
        self.model = GPTStage(cfg, self.coords)
        names = [n for n, _ in self.model.named_parameters()]
        if ref is None:  # a load target: garbage everywhere
            params = {n: torch.full_like(p, GARBAGE) for n, p in self.model.named_parameters()}
            moments = {k: {n: t.clone() for n, t in params.items()} for k in keys}
        else:
            params = self.model.fill(ref, pad=pad)
            moments = {k: self.model.fill(ref, "optim.state.", "." + k, pad) for k in keys}
        self.model.load_local(params)
        self.groups = zero_groups(names)
        if lay.zero:
            self.plan = ZeroPlan(self.rules, self.coords, dict(self.model.named_parameters()), lay.zero,
                                 groups=self.groups, align=zero_params(lay.zero)[0], pad_to=zero_params(lay.zero)[1])
            fill = pad if ref is not None else GARBAGE
            self.flat = {k: flatten_partitions(moments[k], self.groups, lay.zero, lay.dp, self.coords.dp_rank, fill) for k in keys}
            self.master = flatten_partitions(params, self.groups, lay.zero, lay.dp, self.coords.dp_rank, fill)
            assert self.plan.numels == [t.numel() for t in self.master], (self.plan.numels, [t.numel() for t in self.master])
        else:
            self.moments = moments

    def states(self, mode: str) -> list[dict]:
        """The state dicts to save (one) or load (one or two) through the rules."""
        model_sd = self.model.state_dict()
        if not self.lay.zero:
            optim = optimizer_state({n: {k: self.moments[k][n] for k in self.keys} for n in model_sd}, self.rules, self.coords, mode)
            return [{"model": apply_rules(model_sd, self.rules, self.coords, mode), "optim": {"state": optim}, "step": STEP}]
        optim = self.plan.state(self.flat, mode)
        masters = {n: d["fp32"] for n, d in self.plan.state({"fp32": self.master}, mode).items()}
        if self.lay.zero == 3:  # the model itself is partitioned
            return [{"model": masters, "optim": {"state": optim}, "step": STEP}]
        model = apply_rules(model_sd, self.rules, self.coords, mode)
        first = {"model": model, "optim": {"state": optim}, "step": STEP}
        return [first] if mode == "save" else [first, {"model": masters}]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every local tensor of this rank, for bitwise comparison."""
        out = {}
        if self.lay.zero != 3:
            out.update({"param " + n: p.detach() for n, p in self.model.named_parameters()})
        if self.lay.zero:
            for k, bufs in self.flat.items():
                out.update({f"flat {k} {i}": b for i, b in enumerate(bufs)})
            out.update({f"flat fp32 {i}": b for i, b in enumerate(self.master)})
        else:
            for k, d in self.moments.items():
                out.update({f"{k} {n}": t for n, t in d.items()})
        return out


def metadata(lay: Layout, rules) -> dict:
    """What a rule-described save stores to explain its layout."""
    return {"layout": rules.metadata(Coords(tp=lay.tp, pp=lay.pp, dp=lay.dp), zero=lay.zero)}


def save_ranks(states: list[dict], path: str, meta: dict | None = None, block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
    """Save the per-rank states of a job from one process, exactly as the job's ranks
    would (each rank's file, then the manifest assembled from every rank's report)."""
    storage = LocalStorage(path)
    storage.prepare()
    storage.remove(MANIFEST_NAME)
    world = len(states)
    payloads = []
    for r, sd in enumerate(states):
        group = Group(None, r, world)
        local = collect(sd, group)
        to_write = local.to_write + local.rank_tensors
        written, files = [], {}
        if to_write:
            size, frags = write_data_file(storage, data_file_name(r), r, to_write, block_bytes, 1)
            files = {data_file_name(r): size}
            written = list(zip(to_write, frags))
        payloads.append(rank_report(r, local, written, files).message())
    for name, doc in manifest_document(payloads, world, meta or {}).items():  # the manifest last
        storage.write_atomic(name, doc)


def save_layout(lay: Layout, path: str, keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq"), store: str = "megatron") -> None:
    """Every rank of ``lay`` saves (simulated in this process), replicas reconciled first."""
    ref = reference(CFG, keys)
    jobs = [RankJob(lay, r, ref, keys, pad=PAD_SAVE, store=store) for r in range(lay.world)]
    states = [j.states("save")[0] for j in jobs]
    reconcile_ranks(states)
    save_ranks(states, path, metadata(lay, jobs[0].rules))


def load_layout(lay: Layout, path: str, keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq"), store: str = "megatron") -> list[str]:
    """Every rank of ``lay`` loads ``path`` into garbage-filled tensors; returns the names
    of local tensors that differ bitwise from the independently cut expectation."""
    ref = reference(CFG, keys)
    bad = []
    for r in range(lay.world):
        job = RankJob(lay, r, None, keys, store=store)
        for st in job.states("load"):
            unickpt.load(st, path)
        want = RankJob(lay, r, ref, keys, pad=0.0, store=store).tensors()
        for name, got in job.tensors().items():
            if not torch.equal(got, want[name]):
                bad.append(f"rank {r} {name}")
    return bad


def consolidated_mismatches(path: str, keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq"), ref: dict | None = None) -> list[str]:
    """Names whose consolidated tensor differs from the single-process reference, is
    missing, or is stored in more than one fragment."""
    ref = reference(CFG, keys) if ref is None else ref
    m = unickpt.read_manifest(path)
    bad = [n for n in ref if n not in m.tensors]
    bad += [n for n, e in m.tensors.items() if len(e.fragments) != 1]
    target = {n: torch.full(t.shape, GARBAGE, dtype=t.dtype) for n, t in ref.items() if n in m.tensors}
    unickpt.load(target, path)
    return bad + [n for n, t in target.items() if not torch.equal(t, ref[n])]


# ---------------------------------------------------------------- real ranks (spawned)

REAL_LAYOUTS = [Layout(4, 1, 1, 0), Layout(2, 2, 1, 1), Layout(2, 1, 2, 3), Layout(1, 2, 2, 2)]


def _dtensor_specs(name: str):
    from torch.distributed.tensor import Replicate, Shard

    if "norm" in name:
        return [Replicate(), Replicate()], [Shard(0), Replicate()]
    if name.endswith(("wo.weight", "w2.weight")):
        return [Replicate(), Shard(1)], [Shard(0), Shard(1)]
    return [Replicate(), Shard(0)], [Shard(0), Shard(0)]


def native_state(mesh, fill: dict[str, torch.Tensor] | None, keys: tuple[str, ...]) -> dict:
    """The torch-native job's state: DTensors on a (dp, tp) mesh under the example model's
    names (parameters tp-sharded, optimizer moments also sharded over dp)."""
    from torch.distributed.tensor import distribute_tensor

    llama = llama_reference(CFG, keys)
    model, optim = {}, {}
    for n, t in llama.items():
        if not n.startswith("model."):
            continue
        name = n[len("model.") :]
        p_pl, m_pl = _dtensor_specs(name)
        src = fill[n] if fill is not None else torch.full_like(t, GARBAGE)
        model[name] = distribute_tensor(src, mesh, p_pl)
        optim[name] = {}
        for k in keys:
            src = fill[f"optim.state.{name}.{k}"] if fill is not None else torch.full_like(t, GARBAGE)
            optim[name][k] = distribute_tensor(src, mesh, m_pl)
    return {"model": model, "optim": {"state": optim}, "step": STEP}


def world4(rank: int, world: int, root: str) -> None:
    """Spawned: real 4-rank saves of REAL_LAYOUTS, replica check and averaging over a real
    process group, and the torch-native DTensor job loading a Megatron-style checkpoint
    and saving its own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from unickpt.rules import Rule, Rules, averaged

    keys = ("exp_avg", "exp_avg_sq")
    ref = reference(CFG, keys)
    for lay in REAL_LAYOUTS:
        job = RankJob(lay, rank, ref, keys, pad=PAD_SAVE)
        unickpt.save(job.states("save")[0], f"{root}/real_{lay.tp}{lay.pp}{lay.dp}{lay.zero}", metadata=metadata(lay, job.rules))

    # a replica that drifted is reported on every rank, naming the tensor
    lay = Layout(2, 1, 2, 0)
    job = RankJob(lay, rank, ref, keys)
    if rank == 3:
        with torch.no_grad():
            job.model.decoder.layers[1].input_layernorm.weight[5] += 1e-3
    try:
        apply_rules(job.model.state_dict(), job.rules, job.coords, "save")
        msg = "no error"
    except unickpt.InconsistentStateError as e:
        msg = str(e)
    assert "decoder.layers.1.input_layernorm.weight" in msg and "rank 3" in msg, msg

    # averaged norms: each tp rank's copy drifts; the checkpoint stores the mean
    base = job.rules
    avg = Rules([Rule(r".*layernorm\.weight", averaged(), stages="any")] + base.rules, base.renumber)
    job = RankJob(lay, rank, ref, keys)
    with torch.no_grad():
        for p in job.model.parameters():
            if p.ndim == 1:
                p += 0.125 * job.coords.tp_rank
    sd = job.model.state_dict()
    before = {n: t.clone() for n, t in sd.items()}
    unickpt.save({"model": apply_rules(sd, avg, job.coords, "save", strict=False)}, f"{root}/averaged")
    assert all(torch.equal(before[n], t) for n, t in sd.items()), "averaging must not change the live tensors"

    # torch-native DTensor job (mesh dp=2 x tp=2, example model names): resume from the
    # Megatron-style checkpoint, then save its own state for the Megatron-style job
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    target = native_state(mesh, None, keys)
    unickpt.load(target, f"{root}/megatron_llama")
    want = native_state(mesh, llama_reference(CFG, keys), keys)
    bad = [n for n, t in target["model"].items() if not torch.equal(t.to_local(), want["model"][n].to_local())]
    bad += [f"{n}.{k}" for n, d in target["optim"]["state"].items() for k, t in d.items()
            if not torch.equal(t.to_local(), want["optim"]["state"][n][k].to_local())]
    assert not bad, f"torch-native job resumed wrong tensors: {bad}"
    unickpt.save(want, f"{root}/native")
    dist.barrier()
