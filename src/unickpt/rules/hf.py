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
    its rotary permutation uses (``"heads"``, ``"kv_heads"``, or None for none)."""

    ours: str
    hf: str
    rotary: str | None = None


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
        """``(HF name, rotary head kind)`` of a unickpt tensor name, or None."""
        found = self._find(name, True)
        return None if found is None else (found[0], found[1].rotary)

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
MAPPINGS = {"llama": HF_LLAMA, "mixtral": HF_MIXTRAL}


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
