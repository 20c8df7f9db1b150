"""Ready-made rules for common model families.

* :func:`megatron_gpt` — Megatron-Core GPT / Llama names (``embedding.word_embeddings``,
  ``decoder.layers.N.self_attention.linear_qkv``, ``...mlp.linear_fc1`` ...), or the legacy
  Megatron-LM names (``language_model.encoder.layers.N.self_attention.query_key_value``,
  ``...mlp.dense_h_to_4h`` ...): vocabulary-parallel padded embedding and output layer,
  fused QKV (grouped-query attention, kv heads replicated when kv_heads < tp), fused
  SwiGLU gate/up, row-parallel projections, replicated norms, pipeline stage renumbering,
  MoE experts (per-expert names renumbered over ep, router replicated).
  ``store="llama"`` stores the tensors under the example Llama model's names, one tensor
  per sub-parameter (``wq``/``wk``/``wv``, ``w1``/``w3``), so a Megatron-style job and a
  torch-native job share one checkpoint.
* :func:`llama` — the project's example Llama-style model, Megatron-style tensor
  parallel (torchtitan's plan): ``tok_embeddings.weight``,
  ``layers.N.attention.{wq,wk,wv,wo}.weight``, ``layers.N.feed_forward.{w1,w2,w3}.weight``,
  ``layers.N.attention_norm.weight``, ``layers.N.ffn_norm.weight``, ``norm.weight``, ``output.weight``.
"""

from __future__ import annotations

from ..errors import LayoutError
from .language import Renumber, Rule, Rules
from .schemes import Scheme, column, fused, replicated, row, vocab

_LLAMA_LAYER = r"layers\.\d+\."


def llama(
    vocab_size: int,
    num_layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn_hidden: int | None = None,
    *,
    layers_per_stage: list[int] | None = None,
    tied: bool = False,
) -> Rules:
    """Rules of the example Llama-style model under Megatron-style tensor parallelism:
    wq/wk/wv/w1/w3 and the output column-parallel (wq/wk/wv cut in whole heads; kv
    heads replicated when kv_heads < tp), wo/w2 row-parallel, the embedding cut on the
    vocabulary (``torch.chunk`` widths), norms replicated; ``layers.N`` renumbered over
    pipeline stages (balanced, or ``layers_per_stage``). ``ffn_hidden`` fixes the
    feed-forward width (needed when it does not divide by tp). ``tied``: the last stage holds
    a replica of ``tok_embeddings.weight`` and no ``output.weight``."""
    L = _LLAMA_LAYER
    rules = [
        Rule(r"tok_embeddings\.weight", column(size=vocab_size), stages="first+last" if tied else "first"),
        Rule(L + r"attention\.wq\.weight", column(unit=head_dim, size=heads * head_dim)),
        Rule(L + r"attention\.w[kv]\.weight", column(unit=head_dim, size=kv_heads * head_dim)),
        Rule(L + r"attention\.wo\.weight", row(unit=head_dim, size=heads * head_dim)),
        Rule(L + r"feed_forward\.w[13]\.weight", column(size=ffn_hidden)),
        Rule(L + r"feed_forward\.w2\.weight", row(size=ffn_hidden)),
        Rule(L + r"(attention|ffn)_norm\.weight", replicated()),
        Rule(r"norm\.weight", replicated(), stages="last"),
    ]
    if not tied:
        rules.append(Rule(r"output\.weight", column(size=vocab_size), stages="last"))
    split = tuple(layers_per_stage) if layers_per_stage else "balanced"
    return Rules(rules, [Renumber(r"^layers\.(\d+)\.", "pp", num_layers, split)], name="llama")


_MEGATRON_NAMES = {
    "mcore": {
        "embed": r"embedding\.word_embeddings\.weight",
        "pos": r"embedding\.position_embeddings\.weight",
        "layer": r"decoder\.layers\.(\d+)\.",
        "qkv": r"self_attention\.linear_qkv",
        "proj": r"self_attention\.linear_proj",
        "fc1": r"mlp\.linear_fc1",
        "fc2": r"mlp\.linear_fc2",
        "norms": r"(input_layernorm|pre_mlp_layernorm|self_attention\.linear_qkv\.layer_norm_(weight|bias)"
                 r"|mlp\.linear_fc1\.layer_norm_(weight|bias))",
        "final": r"decoder\.final_layernorm\.(weight|bias)",
        "output": r"output_layer\.weight",
        "router": r"mlp\.router\.(weight|bias|expert_bias)",
        "expert": r"mlp\.experts\.local_experts\.(\d+)\.",
        "expert_fc1": r"linear_fc1",
        "expert_fc2": r"linear_fc2",
    },
    "legacy": {
        "embed": r"language_model\.embedding\.word_embeddings\.weight",
        "pos": r"language_model\.embedding\.position_embeddings\.weight",
        "layer": r"language_model\.encoder\.layers\.(\d+)\.",
        "qkv": r"self_attention\.query_key_value",
        "proj": r"self_attention\.dense",
        "fc1": r"mlp\.dense_h_to_4h",
        "fc2": r"mlp\.dense_4h_to_h",
        "norms": r"(input_layernorm|post_attention_layernorm)",
        "final": r"language_model\.encoder\.final_layernorm\.(weight|bias)",
        "output": r"language_model\.output_layer\.weight",
        "router": r"mlp\.router\.(weight|bias)",
        "expert": r"mlp\.experts\.local_experts\.(\d+)\.",
        "expert_fc1": r"dense_h_to_4h",
        "expert_fc2": r"dense_4h_to_h",
    },
}


def megatron_gpt(
    vocab_size: int,
    num_layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn_hidden: int,
    *,
    swiglu: bool = True,
    qkv: str = "fused",
    tied: bool = False,
    naming: str = "mcore",
    store: str = "megatron",
    layers_per_stage: list[int] | None = None,
    num_experts: int | None = None,
    expert_ffn_hidden: int | None = None,
) -> Rules:
    """Rules for Megatron GPT / Llama-family models (see the module docstring).

    ``qkv="fused"``: each rank's QKV weight is ``[q_r; k_r; v_r]`` (heads cut per
    sub-parameter; kv heads replicated when kv_heads < tp); ``qkv="interleaved"``:
    Megatron-Core's per-query-group layout, cut in whole groups (plain column-parallel).
    ``swiglu``: fc1 is ``[gate_r; up_r]``. ``tied``: the output layer reuses the
    embedding (a replica on the first and last stage). ``naming``: ``"mcore"`` or
    ``"legacy"``. ``store``: ``"megatron"`` (fused global tensors, Megatron names) or
    ``"llama"`` (the example model's names, one tensor per sub-parameter; needs
    ``qkv="fused"`` and ``swiglu``). ``num_experts``: MoE layers with per-expert names
    ``...mlp.experts.local_experts.M`` renumbered over the ep axis.
    """
    if naming not in _MEGATRON_NAMES:
        raise LayoutError(f"megatron_gpt: naming must be 'mcore' or 'legacy', not {naming!r}")
    if store not in ("megatron", "llama"):
        raise LayoutError(f"megatron_gpt: store must be 'megatron' or 'llama', not {store!r}")
    if qkv not in ("fused", "interleaved"):
        raise LayoutError(f"megatron_gpt: qkv must be 'fused' or 'interleaved', not {qkv!r}")
    if store == "llama" and (qkv != "fused" or not swiglu):
        raise LayoutError("megatron_gpt: store='llama' needs qkv='fused' and swiglu=True")
    n = _MEGATRON_NAMES[naming]
    L = n["layer"]
    llama_names = store == "llama"

    def qkv_scheme(names: list[str] | None) -> Scheme:
        """The QKV weight's (or bias's) scheme."""
        if qkv == "interleaved":
            group_rows = (heads // kv_heads + 2) * head_dim
            return column(unit=group_rows)
        return fused([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], units=head_dim, names=names)

    def fc1_scheme(hidden: int, names: list[str] | None) -> Scheme:
        """The first feed-forward layer's scheme (fused gate/up with SwiGLU)."""
        return fused([hidden, hidden], names=names) if swiglu else column(size=hidden)

    rules: list[Rule] = []
    embed_stages = "first+last" if tied else "first"
    rules.append(Rule(n["embed"], vocab(vocab_size), rename="tok_embeddings.weight" if llama_names else None, stages=embed_stages))
    rules.append(Rule(n["pos"], replicated(), stages="any"))
    qkv_names = [r"layers.\1.attention.wq.weight", r"layers.\1.attention.wk.weight", r"layers.\1.attention.wv.weight"]
    rules.append(Rule(L + n["qkv"] + r"\.weight", qkv_scheme(qkv_names if llama_names else None)))
    rules.append(Rule(L + n["qkv"] + r"\.bias", qkv_scheme(
        [r"layers.\1.attention.wq.bias", r"layers.\1.attention.wk.bias", r"layers.\1.attention.wv.bias"] if llama_names else None
    ), stages="any"))
    rules.append(Rule(L + n["proj"] + r"\.weight", row(unit=head_dim, size=heads * head_dim), rename=r"layers.\1.attention.wo.weight" if llama_names else None))
    rules.append(Rule(L + n["proj"] + r"\.bias", replicated(), stages="any"))
    w13 = [r"layers.\1.feed_forward.w1.weight", r"layers.\1.feed_forward.w3.weight"] if llama_names else None
    b13 = [r"layers.\1.feed_forward.w1.bias", r"layers.\1.feed_forward.w3.bias"] if llama_names else None
    rules.append(Rule(L + n["fc1"] + r"\.weight", fc1_scheme(ffn_hidden, w13)))
    rules.append(Rule(L + n["fc1"] + r"\.bias", fc1_scheme(ffn_hidden, b13), stages="any"))
    rules.append(Rule(L + n["fc2"] + r"\.weight", row(size=ffn_hidden), rename=r"layers.\1.feed_forward.w2.weight" if llama_names else None))
    rules.append(Rule(L + n["fc2"] + r"\.bias", replicated(), stages="any"))
    if llama_names:
        rules.append(Rule(L + r"(input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)", replicated(),
                          rename=r"layers.\1.attention_norm.weight"))
        rules.append(Rule(L + r"(pre_mlp_layernorm\.weight|post_attention_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)",
                          replicated(), rename=r"layers.\1.ffn_norm.weight"))
        rules.append(Rule(L + n["norms"] + r"\.bias", replicated(), stages="any"))
        rules.append(Rule(n["final"], replicated(), rename=r"norm.\1", stages="last"))
    else:
        rules.append(Rule(L + n["norms"] + r"(\.(weight|bias))?", replicated()))
        rules.append(Rule(n["final"], replicated(), stages="last"))
    renumber = [Renumber("^" + n["layer"], "pp", num_layers, tuple(layers_per_stage) if layers_per_stage else "balanced")]
    if num_experts:
        e_hidden = expert_ffn_hidden or ffn_hidden
        E = L + n["expert"]
        rules.append(Rule(L + n["router"], replicated(), stages="any"))
        rules.append(Rule(E + n["expert_fc1"] + r"\.weight", fc1_scheme(e_hidden, None), stages="any"))
        rules.append(Rule(E + n["expert_fc2"] + r"\.weight", row(size=e_hidden), stages="any"))
        rules.append(Rule(E + r"(" + n["expert_fc1"] + "|" + n["expert_fc2"] + r")\.bias", replicated(), stages="any"))
        renumber.append(Renumber(n["expert"], "ep", num_experts, "chunk"))
    if not tied:
        rules.append(Rule(n["output"], vocab(vocab_size), rename="output.weight" if llama_names else None, stages="last"))
    return Rules(rules, renumber, name=f"megatron-gpt ({naming}, store={store})")


def deepspeed_moe(num_experts: int) -> Rules:
    """Rules for a model with DeepSpeed MoE layers (``deepspeed.moe.layer.MoE``) under expert
    parallelism, any other parallelism being data parallel: each rank's local experts
    ``...deepspeed_moe.experts.deepspeed_experts.<local>.`` are global experts
    ``ep_rank * num_experts / ep + local`` (DeepSpeed's numbering, a ``"chunk"`` split over
    the ``ep`` axis); every tensor is whole on the ranks holding it (experts, gates and dense
    parameters alike). ``num_experts``: experts per MoE layer, over all ranks."""
    return Rules([Rule(r".+", replicated(), stages="any")],
                 [Renumber(r"\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.", "ep", num_experts, "chunk")],
                 name="deepspeed-moe")
