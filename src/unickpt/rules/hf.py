"""Name mappings between unickpt checkpoints and Hugging Face ``transformers`` models.

A mapping is a table of name templates, ``{N}`` standing for a layer index and ``{E}`` for
an expert index, read in both directions (export: unickpt -> HF, import: HF -> unickpt). A template may carry a
*rotary permutation*: the example model (``unickpt.examples.model``) rotates interleaved
channel pairs ``(0, 1), (2, 3), ...`` of each head, as Meta's original Llama code does,
while ``transformers`` rotates halves (``rotate_half``: channel ``i`` with ``i + d/2``).
The two are the same model once the rows of ``wq`` and ``wk`` are reordered within each
head: HF row ``j * d/2 + i`` is unickpt row ``2i + j`` (``j`` in {0, 1}, ``i < d/2``).
Attention scores are unchanged because q and k get the same reordering.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LayoutError


@dataclass(frozen=True)
class NamePair:
    """One tensor: its unickpt name template, its HF name template, and which head count
    its rotary permutation uses (``"heads"``, ``"kv_heads"``, or None for none).
    ``split``: the tensor is several HF tensors fused (export only): ``"qkv"`` (Megatron's
    per-query-group QKV) or ``"halves"`` (SwiGLU's ``[gate; up]``); ``{P}`` in ``hf`` then
    stands for each part's name (``SPLIT_PARTS``)."""

    ours: str
    hf: str
    rotary: str | None = None
    split: str | None = None


def _compile(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(r"\{N\}", r"(?P<N>\d+)").replace(r"\{E\}", r"(?P<E>\d+)"))


def _fill(template: str, m: re.Match[str]) -> str:
    """``template`` with the indices ``m`` matched (``{N}``, ``{E}``) put in."""
    for key, value in m.groupdict().items():
        template = template.replace("{" + key + "}", value)
    return template


@dataclass(frozen=True)
class HfMapping:
    """A declarative name mapping (see the module docstring) and the HF architecture it
    targets; ``hf_name`` / ``our_name`` return None for a name the mapping does not know."""

    name: str
    architecture: str
    pairs: tuple[NamePair, ...]

    def _find(self, name: str, to_hf: bool) -> tuple[str, NamePair] | None:
        for p in self.pairs:
            m = _compile(p.ours if to_hf else p.hf).fullmatch(name)
            if m:
                out = p.hf if to_hf else p.ours
                return _fill(out, m), p
        return None

    def hf_name(self, name: str) -> tuple[str, str | None] | None:
        """``(HF name, rotary head kind)`` of a unickpt tensor name, or None (the first
        part's name for a fused tensor: see :meth:`hf_parts`)."""
        parts = self.hf_parts(name)
        return None if parts is None else (parts[0][0], parts[0][1])

    def hf_parts(self, name: str) -> list[tuple[str, str | None, str | None, int]] | None:
        """``[(HF name, rotary head kind, split kind, part index)]`` of a unickpt tensor
        name (one entry unless the tensor is several HF tensors fused), or None."""
        found = self._find(name, True)
        if found is None:
            return None
        hf, pair = found
        if pair.split is None:
            return [(hf, pair.rotary, None, 0)]
        return [(hf.replace("{P}", p), pair.rotary, pair.split, i) for i, p in enumerate(SPLIT_PARTS[pair.split])]

    def our_name(self, hf_name: str) -> tuple[str, str | None] | None:
        """``(unickpt name, rotary head kind)`` of an HF tensor name, or None."""
        found = self._find(hf_name, False)
        return None if found is None else (found[0], found[1].rotary)


HF_LLAMA = HfMapping(
    name="llama",
    architecture="LlamaForCausalLM",
    pairs=(
        NamePair("tok_embeddings.weight", "model.embed_tokens.weight"),
        NamePair("layers.{N}.attention.wq.weight", "model.layers.{N}.self_attn.q_proj.weight", "heads"),
        NamePair("layers.{N}.attention.wk.weight", "model.layers.{N}.self_attn.k_proj.weight", "kv_heads"),
        NamePair("layers.{N}.attention.wv.weight", "model.layers.{N}.self_attn.v_proj.weight"),
        NamePair("layers.{N}.attention.wo.weight", "model.layers.{N}.self_attn.o_proj.weight"),
        NamePair("layers.{N}.feed_forward.w1.weight", "model.layers.{N}.mlp.gate_proj.weight"),
        NamePair("layers.{N}.feed_forward.w3.weight", "model.layers.{N}.mlp.up_proj.weight"),
        NamePair("layers.{N}.feed_forward.w2.weight", "model.layers.{N}.mlp.down_proj.weight"),
        NamePair("layers.{N}.attention_norm.weight", "model.layers.{N}.input_layernorm.weight"),
        NamePair("layers.{N}.ffn_norm.weight", "model.layers.{N}.post_attention_layernorm.weight"),
        NamePair("norm.weight", "model.norm.weight"),
        NamePair("output.weight", "lm_head.weight"),
    ),
)
_DS_EXPERT = "layers.{N}.feed_forward.deepspeed_moe.experts.deepspeed_experts.{E}."
HF_MIXTRAL = HfMapping(
    name="mixtral",
    architecture="MixtralForCausalLM",
    pairs=tuple(p for p in HF_LLAMA.pairs if ".feed_forward." not in p.ours) + (
        NamePair("layers.{N}.feed_forward.deepspeed_moe.gate.wg.weight", "model.layers.{N}.block_sparse_moe.gate.weight"),
        *(NamePair(_DS_EXPERT + f"{w}.weight", "model.layers.{N}.block_sparse_moe.experts.{E}." + f"{w}.weight")
          for w in ("w1", "w2", "w3")),
    ),
)
"""The example model with DeepSpeed MoE feed-forward blocks (``deepspeed.moe.layer.MoE`` of
SwiGLU experts ``w1``/``w2``/``w3``, global expert ids as unickpt's DeepSpeed reader names
them) as Mixtral, in the per-expert layout of Mixtral's published checkpoints
(``block_sparse_moe.experts.E.w1``), which ``transformers`` loads."""


SPLIT_PARTS = {"qkv": ("q", "k", "v"), "halves": ("gate", "up")}


def _megatron_llama(embed: str, layer: str, qkv: str, proj: str, fc1: str, fc2: str, norms1: tuple[str, ...],
                    norms2: tuple[str, ...], final: str, output: str) -> tuple[NamePair, ...]:
    """The pairs of a Megatron GPT with Llama's shape (``layer`` ends with ``{N}.``)."""
    L, H = layer, "model.layers.{N}."
    return (
        NamePair(embed, "model.embed_tokens.weight"),
        NamePair(L + qkv, H + "self_attn.{P}_proj.weight", split="qkv"),
        NamePair(L + proj, H + "self_attn.o_proj.weight"),
        NamePair(L + fc1, H + "mlp.{P}_proj.weight", split="halves"),
        NamePair(L + fc2, H + "mlp.down_proj.weight"),
        *(NamePair(L + n, H + "input_layernorm.weight") for n in norms1),
        *(NamePair(L + n, H + "post_attention_layernorm.weight") for n in norms2),
        NamePair(final, "model.norm.weight"),
        NamePair(output, "lm_head.weight"),
    )


# Megatron-LM / Megatron-Core GPT models with Llama's shape (SwiGLU, RMSNorm, rotary
# embeddings: Megatron rotates halves, as HF does, so q and k keep their row order); export only
HF_MEGATRON_LLAMA = HfMapping(
    name="megatron-llama",
    architecture="LlamaForCausalLM",
    pairs=_megatron_llama(
        "language_model.embedding.word_embeddings.weight", "language_model.encoder.layers.{N}.",
        "self_attention.query_key_value.weight", "self_attention.dense.weight", "mlp.dense_h_to_4h.weight",
        "mlp.dense_4h_to_h.weight", ("input_layernorm.weight",), ("post_attention_layernorm.weight",),
        "language_model.encoder.final_layernorm.weight", "language_model.output_layer.weight",
    ) + _megatron_llama(
        "embedding.word_embeddings.weight", "decoder.layers.{N}.", "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
        ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"), "decoder.final_layernorm.weight",
        "output_layer.weight",
    ),
)
MAPPINGS = {"llama": HF_LLAMA, "mixtral": HF_MIXTRAL, "megatron-llama": HF_MEGATRON_LLAMA}


def split_fused(w: torch.Tensor, kind: str, heads: dict[str, int] | None) -> list[torch.Tensor]:
    """The HF tensors of a fused tensor (``kind`` of :data:`SPLIT_PARTS`): Megatron's QKV
    ``[q heads of group g; k_g; v_g]`` per query group (``heads``: ``{"heads", "kv_heads"}``),
    or the halves ``[gate; up]``."""
    if kind == "halves":
        if w.ndim < 1 or w.shape[0] % 2:
            raise LayoutError(f"a fused [gate; up] tensor of {w.shape[0] if w.ndim else 0} rows: not even")
        return [t.contiguous() for t in w.chunk(2, 0)]
    if kind != "qkv" or heads is None:
        raise LayoutError(f"splitting a fused {kind} tensor needs the head counts (pass --config)")
    q, g = int(heads["heads"]), int(heads["kv_heads"])
    rows = w.shape[0] if w.ndim else 0
    if g <= 0 or q % g or rows % (q + 2 * g):
        raise LayoutError(f"a fused QKV of {rows} rows does not hold {q} query and {g} key/value heads")
    d, per = rows // (q + 2 * g), q // g
    grouped = w.reshape(g, per + 2, d, *w.shape[1:])
    return [grouped[:, :per].reshape(q * d, *w.shape[1:]).contiguous(),
            grouped[:, per].reshape(g * d, *w.shape[1:]).contiguous(),
            grouped[:, per + 1].reshape(g * d, *w.shape[1:]).contiguous()]


def split_shape(shape: tuple[int, ...], kind: str, part: int, heads: dict[str, int] | None) -> tuple[int, ...]:
    """The shape of part ``part`` of a fused tensor of ``shape`` (see :func:`split_fused`)."""
    if kind == "halves":
        return (shape[0] // 2, *shape[1:])
    if heads is None:
        raise LayoutError("splitting a fused QKV tensor needs the head counts (pass --config)")
    q, g = int(heads["heads"]), int(heads["kv_heads"])
    d = shape[0] // (q + 2 * g)
    return ((q if part == 0 else g) * d, *shape[1:])


def _head_rows(w: torch.Tensor, heads: int) -> tuple[int, int]:
    rows = w.shape[0] if w.ndim else 0
    if w.ndim < 1 or heads <= 0 or rows % heads or (rows // heads) % 2:
        raise LayoutError(
            f"rotary permutation: {rows} rows do not split into {heads} heads of an even size "
            "(check the head counts in model_args or --config)"
        )
    return rows // heads, rows


def rotary_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder the rows of a q or k projection from interleaved-pair rotary (unickpt's
    example model) to HF's half-split rotary: per head, even rows first, then odd rows."""
    d, rows = _head_rows(w, heads)
    return w.reshape(heads, d // 2, 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def rotary_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`rotary_to_hf`."""
    d, rows = _head_rows(w, heads)
    return w.reshape(heads, 2, d // 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def hf_row_of(our_row: int, head_dim: int) -> int:
    """The HF row holding row ``our_row`` of a unickpt q/k projection (see the module docstring)."""
    h, r = divmod(our_row, head_dim)
    i, j = divmod(r, 2)
    return h * head_dim + j * (head_dim // 2) + i


def heads_from_config(config: dict[str, Any]) -> dict[str, int]:
    """``{"heads", "kv_heads"}`` from an HF config dict (``num_attention_heads``,
    ``num_key_value_heads``, which defaults to the former)."""
    try:
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
    except (KeyError, TypeError, ValueError):
        raise LayoutError("the HF config gives no valid num_attention_heads") from None
    return {"heads": heads, "kv_heads": kv}


def llama_config(args: dict[str, Any], shapes: dict[str, tuple[int, ...]], dtype: str) -> dict[str, Any]:
    """An HF ``config.json`` (``LlamaForCausalLM``) for the example model, from its
    ``ModelArgs`` (as the trainer saves them under ``model_args``) and the exported
    tensors' shapes (HF names; the feed-forward width comes from ``gate_proj``)."""
    try:
        dim, heads = int(args["dim"]), int(args["heads"])
        hidden = shapes["model.layers.0.mlp.gate_proj.weight"][0] if "model.layers.0.mlp.gate_proj.weight" in shapes else 4 * dim
        theta = float(args.get("rope_theta", 10000.0))
        return {
            "architectures": [HF_LLAMA.architecture],
            "model_type": "llama",
            "hidden_size": dim,
            "intermediate_size": int(hidden),
            "num_hidden_layers": int(args["layers"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(args.get("kv_heads") or heads),
            "head_dim": dim // heads,
            "vocab_size": int(args["vocab"]),
            "max_position_embeddings": int(args["seq"]),
            "rms_norm_eps": float(args.get("norm_eps", 1e-5)),
            "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": "lm_head.weight" not in shapes,
            "torch_dtype": dtype,
        }
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise LayoutError(f"model_args cannot describe a Llama config: {type(e).__name__}: {e}") from None
