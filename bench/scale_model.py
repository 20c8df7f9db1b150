"""The simulated job of ``bench.scale``: a Llama-shaped model under Megatron-style TP x PP
and ZeRO-1 over DP, one rank's state as the rules layer builds it, on meta tensors.

Nothing is allocated: the tensors are ``device="meta"``, so the real rules, ZeRO,
save-collection, file-layout, manifest and read-planning code runs on shapes alone.
:func:`simulated_message` is exactly what a rank of a real job sends to rank 0 at commit,
except the CRC-32C values (made up here: the same count and width as real ones).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from math import prod
from typing import Any

import torch

from unickpt.engine import collect as collect_api, commit as save_api
from unickpt.engine.writer import data_file_layout
from unickpt.dist import Group
from unickpt.format.manifest import Fragment
from unickpt.rules.coords import Coords
from unickpt.rules.language import Rules, apply_rules
from unickpt.rules.presets import llama
from unickpt.rules.zero import ZeroPlan

OPTIM_KEYS = ("fp32", "exp_avg", "exp_avg_sq")  # fp32 master + Adam moments: 12 bytes a parameter


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder: sizes only."""

    layers: int = 126
    hidden: int = 16384
    heads: int = 128
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 128256
    ffn: int = 53248

    def rules(self) -> Rules:
        """The rules (``unickpt.rules.presets.llama``) that describe its layout."""
        return _memo_resolve(llama(self.vocab, self.layers, self.heads, self.kv_heads, self.head_dim, self.ffn))

    @property
    def parameters(self) -> int:
        """Number of parameters."""
        h, f = self.hidden, self.ffn
        attn = 2 * h * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim
        return self.layers * (attn + 3 * h * f + 2 * h) + 2 * self.vocab * h + h


LLAMA_405B = ModelSpec()


def _memo_resolve(rules: Rules) -> Rules:
    """``rules`` resolving each (name, shape, coordinates but the dp rank) once: a rule's
    layout depends on the tp/pp/ep coordinates, not on the dp rank (replication is
    computed apart, from the coordinates), and resolving dominates building 16K states."""
    cache: dict[tuple, Any] = {}
    resolve = rules.resolve

    def memo(local_name, local_shape, coords, shapes=None):
        key = (local_name, tuple(local_shape), replace(coords, dp_rank=0), None if shapes is None else id(shapes))
        if key not in cache:
            cache[key] = resolve(local_name, local_shape, coords, shapes)
        return cache[key]

    rules.resolve = memo  # type: ignore[method-assign]
    return rules


def local_shapes(spec: ModelSpec, rules: Rules, c: Coords) -> dict[str, tuple[int, ...]]:
    """The stage-local, tp-local parameter shapes of the rank at ``c`` (Megatron order)."""
    tp, h = c.tp, spec.hidden
    n = rules.renumber[0].counts(c.pp)[c.pp_rank]
    vocab_rows = -(-spec.vocab // tp)
    out: dict[str, tuple[int, ...]] = {}
    if c.pp_rank == 0:
        out["tok_embeddings.weight"] = (vocab_rows, h)
    for i in range(n):
        p = f"layers.{i}."
        out[p + "attention.wq.weight"] = (spec.heads * spec.head_dim // tp, h)
        out[p + "attention.wk.weight"] = (max(1, spec.kv_heads // tp) * spec.head_dim, h)
        out[p + "attention.wv.weight"] = (max(1, spec.kv_heads // tp) * spec.head_dim, h)
        out[p + "attention.wo.weight"] = (h, spec.heads * spec.head_dim // tp)
        out[p + "feed_forward.w1.weight"] = (spec.ffn // tp, h)
        out[p + "feed_forward.w2.weight"] = (h, spec.ffn // tp)
        out[p + "feed_forward.w3.weight"] = (spec.ffn // tp, h)
        out[p + "attention_norm.weight"] = (h,)
        out[p + "ffn_norm.weight"] = (h,)
    if c.pp_rank == c.pp - 1:
        out["norm.weight"] = (h,)
        out["output.weight"] = (vocab_rows, h)
    return out


def rank_state(
    spec: ModelSpec, rules: Rules, c: Coords, mode: str, device: str = "meta",
    fill: Any = None,
) -> dict[str, Any]:
    """The state a rank hands to ``unickpt.save``/``load``: ``{"model": bf16 weights,
    "optim": {"state": fp32 master + Adam moments as ZeRO-1 flat partitions}}``, built
    by the real rules and ZeroPlan. ``fill(name, shape, dtype)`` makes real tensors
    (default: meta tensors, nothing allocated)."""
    shapes = local_shapes(spec, rules, c)
    make = fill or (lambda name, shape, dtype: torch.empty(shape, dtype=dtype, device=device))
    model = {k: make(k, s, torch.bfloat16) for k, s in shapes.items()}
    zero = ZeroPlan(rules, c, shapes, 1)
    bufs = {k: [make(f"{k}.{i}", (n,), torch.float32) for i, n in enumerate(zero.numels)] for k in OPTIM_KEYS}
    return {
        "model": apply_rules(model, rules, c, mode, check_replicas=False),
        "optim": {"state": zero.state(bufs, mode, check_replicas=False)},
    }


def simulated_message(spec: ModelSpec, rules: Rules, c: Coords, rank: int, world: int, block_bytes: int) -> tuple[bytes, int]:
    """What rank ``rank`` sends to rank 0 at commit (the real ``collect``, file layout and
    ``rank_report``; made-up checksums), and the bytes it writes."""
    state = rank_state(spec, rules, c, "save")
    local = collect_api.collect(state, Group(None, rank, world), defer=True)
    items = local.to_write + local.rank_tensors
    files: dict[str, int] = {}
    written = []
    if items:
        name = save_api.data_file_name(rank)
        _, offsets, size = data_file_layout(rank, items)
        files[name] = size
        rng = random.Random(rank)
        for item, off in zip(items, offsets):
            nbytes = item.local.numel() * item.local.element_size()
            crcs = [rng.getrandbits(32) for _ in range(max(1, -(-nbytes // block_bytes)))]
            xxh3 = f"{rng.getrandbits(128):032x}"  # the identity every save records (incremental saves)
            written.append((item, Fragment(name, off, tuple(item.local.shape), item.pieces, crcs, block_bytes, rank, xxh3)))
    data = sum(prod(i.local.shape) * i.local.element_size() for i in items)
    return save_api.rank_report(rank, local, written, files).message(), data
