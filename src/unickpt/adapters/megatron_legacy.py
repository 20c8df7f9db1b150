"""Reading Megatron-LM's legacy checkpoints (``--ckpt-format torch``) in place.

Megatron-LM's ``save_checkpoint`` (``megatron/training/checkpointing.py``:
``get_checkpoint_name``, ``generate_state_dict``; Megatron-DeepSpeed wrote the same) leaves::

    latest_checkpointed_iteration.txt      # "10", or "release"
    iter_0000010/                          # or release/
      mp_rank_TT/model_optim_rng.pt        # pipeline size 1
      mp_rank_TT_PPP/model_optim_rng.pt    # pipeline parallel: tensor rank TT, stage PPP
      mp_rank_TT_PPP/distrib_optim.pt      # the distributed optimizer's state (DP rank 0)

Each ``model_optim_rng.pt`` is one ``torch.save`` of ``{"args": argparse.Namespace,
"checkpoint_version": 3.0, "iteration", "model": state dict of the rank's model chunk,
"optimizer", "opt_param_scheduler", "rng_state", ...}``. It is read with the allow-listing
unpickler: ``argparse.Namespace``, the enums Megatron puts in its args (kept as their
names), torch dtypes (``params_dtype``...), tensors carrying Python attributes (a bf16 run's
fp32 main params hold ``tensor_model_parallel``, ``partition_dim``... : read, the attributes
dropped), NumPy's arrays of the RNG state and TransformerEngine's ``io.BytesIO`` extra state
(inert records, reported as skipped) and plain data are allowed; any other class is refused (:class:`~unickpt.UnsafePickleError`
naming it) and nothing of the file runs.

The model's tensors are tensor-parallel slices with stage-local layer numbers. The rules
layer (:func:`unickpt.rules.presets.megatron_gpt` with the sizes from ``args``) turns each
into pieces of its global tensor: fused QKV in Megatron's per-query-group order (GQA
included), SwiGLU's fused ``[gate; up]`` fc1, the padded vocabulary, column- and
row-parallel dims, replicated norms (one tensor-parallel copy read, the others listed as
replicas), layer numbers made global over pipeline stages. Both the legacy names
(``language_model.encoder.layers.N...``) and Megatron-Core's (``decoder.layers.N...``) are
read, and keep their names. Names in the manifest:

* ``model.<global name>``: the model's weights as the ``model`` entry holds them (a bf16
  run's bf16 weights, as Megatron loads them; an fp32 model loading them gets them widened);
* ``optim.state.<global name>.<key>``: the Adam state (``exp_avg``, ``exp_avg_sq``,
  ``step``) of Megatron's non-distributed optimizer, and ``fp32_param``: its fp32 master
  copy of a bf16/fp16 parameter (``fp32_from_fp16_params``); parameters are matched to the
  optimizer's indices the way Megatron's ``_get_param_groups`` builds its groups
  (weight-decayed parameters and the others - biases and 1-d tensors - each in model order);
* values: ``train.step`` (the iteration), ``megatron.args``, ``megatron.checkpoint_version``,
  ``megatron.opt_param_scheduler``, ``optim.param_groups``; ``megatron.grad_scaler.<key>``
  (the fp16 loss scaler: ``scale`` and ``growth_tracker`` tensors, its settings values).

Reported as skipped, with the reason (ledger): per-rank RNG states, TransformerEngine
``_extra_state``, the distributed optimizer's ``distrib_optim.pt`` (its flat buffers
follow a parameter-to-bucket map that the checkpoint does not store). Refused with a
LayoutError: checkpoint versions before 3.0 (another QKV order), virtual pipeline chunks
(``model0``, ``model1``), expert-parallel rank directories, uneven pipeline stages.
Refused with a CorruptionError naming the file and the field: args or an optimizer state
that contradict the rank files (parallel sizes that are not positive integers or do not
match the rank directories, a stage not holding the layers ``num_layers`` gives it, a
last stage's copy of tied embeddings that is not the first stage's embedding, optimizer
groups or states of the wrong type).
"""

from __future__ import annotations

import argparse
import os
import re
from itertools import islice
from typing import TYPE_CHECKING, Any

from ..errors import CorruptionError, LayoutError, NotACheckpointError
from ..format.dtypes import itemsize
from ..format.ledger import Region
from ..format.manifest import Fragment, Manifest
from ..format.values import encode_value
from ..plan.piece import box_piece, whole_piece
from .manifest_builder import ManifestBuilder
from .megatron_pickles import MEGATRON_ALLOWED
from .torch_archive import StoredTensor, records_in, stored_tensors

if TYPE_CHECKING:  # the rules import torch: loaded when a legacy checkpoint is read, not when formats are probed
    from ..rules.coords import Coords
    from ..rules.language import Rules

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
DIST_OPTIM_FILE = "distrib_optim.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
FORMAT = "megatron-legacy"


# the data classes Megatron pickles (args, its enums, the RNG state): one list with the DeepSpeed reader
ALLOWED = MEGATRON_ALLOWED


# ----------------------------------------------------------------------------- detection

def _rank_dirs(root: str) -> dict[tuple[int, int], str]:
    """``{(tp rank, pp rank): directory}`` of the ``mp_rank_*`` directories holding a
    ``model_optim_rng.pt`` (an expert-parallel one is refused)."""
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    out: dict[tuple[int, int], str] = {}
    for n in names:
        m = RANK_DIR.match(n)
        if not m or not os.path.isfile(os.path.join(root, n, MODEL_FILE)):
            continue
        if m.group(3) is not None:
            raise LayoutError(f"{root}: {n} is an expert-parallel rank of a legacy Megatron-LM checkpoint: "
                              "not supported (save with --ckpt-format torch_dist to reshard experts)")
        out[(int(m.group(1)), int(m.group(2) or 0))] = n
    return out


def _resolve(path: str) -> tuple[str, str] | None:
    """(prefix of the iteration directory relative to ``path`` ('' or 'iter_.../'), that
    directory) or None."""
    if _rank_dirs(path):
        return "", path
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        return None
    try:
        with open(tracker, encoding="utf-8") as f:
            text = f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "release":
        tag = "release"
    elif text.isdigit():
        tag = f"iter_{int(text):07d}"
    else:
        return None
    d = os.path.join(path, tag)
    return (tag + "/", d) if _rank_dirs(d) else None


def is_megatron_legacy(path: str) -> bool:
    """True for a legacy Megatron-LM checkpoint: an ``iter_NNNNNNN``/``release`` directory
    of ``mp_rank_*/model_optim_rng.pt``, or its parent naming it in ``latest_checkpointed_iteration.txt``."""
    return _resolve(str(path)) is not None


# ----------------------------------------------------------------------------- helpers

def _leaves(obj: Any, prefix: str) -> list[tuple[str, Any]]:
    """(dotted name, value) of the leaves of nested str-keyed dicts (a model state dict,
    flat or nested as the legacy ``state_dict_for_save_checkpoint`` makes it)."""
    if isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj):
        return [x for k, v in obj.items() for x in _leaves(v, f"{prefix}.{k}" if prefix else k)]
    return [(prefix, obj)]


def _arg(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _parallel_size(args: argparse.Namespace, name: str, where: str) -> int:
    """``args.<name>``, a tensor- or pipeline-parallel size (absent: 1): a positive int,
    else CorruptionError naming the file and the field."""
    v = _arg(args, name, 1)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise CorruptionError(f"{where}: args.{name} is {v!r:.40}, not a positive integer")
    return v


def _coords(**kw: int) -> "Coords":
    from ..rules.coords import Coords

    return Coords(**kw)


def rules_from_args(args: argparse.Namespace, naming: str) -> Rules:
    """The rules of the GPT model Megatron-LM's ``args`` describe (:func:`megatron_gpt`)."""
    from ..rules.presets import megatron_gpt

    try:
        heads = int(args.num_attention_heads)
        hidden = int(args.hidden_size)
        head_dim = int(_arg(args, "kv_channels") or hidden // heads)
        groups = int(_arg(args, "num_query_groups") or heads) if _arg(args, "group_query_attention") else heads
        vocab = int(args.padded_vocab_size)
        ffn = int(_arg(args, "ffn_hidden_size") or 4 * hidden)
        layers = int(args.num_layers)
    except (AttributeError, TypeError, ValueError) as e:
        raise LayoutError(f"the checkpoint's args do not describe a GPT model ({type(e).__name__}: {e})") from None
    return megatron_gpt(vocab, layers, heads, groups, head_dim, ffn, swiglu=bool(_arg(args, "swiglu")), qkv="interleaved",
                        tied=not _arg(args, "untie_embeddings_and_output_weights", False), naming=naming)


def hf_config(args: argparse.Namespace, dtype: str) -> dict[str, Any] | None:
    """A Hugging Face ``LlamaForCausalLM`` config of the model ``args`` describe, when it has
    Llama's shape (SwiGLU, RMSNorm, rotary embeddings on every channel rotating halves, no
    biases, no QK norm, no RoPE scaling); else None (export then needs ``--config``)."""
    if not (_arg(args, "swiglu") and _arg(args, "normalization") == "RMSNorm"
            and _arg(args, "position_embedding_type") == "rope" and not _arg(args, "add_bias_linear", True)
            and not _arg(args, "add_qkv_bias") and not _arg(args, "rotary_interleaved")
            and float(_arg(args, "rotary_percent", 1.0) or 1.0) == 1.0 and not _arg(args, "qk_layernorm")
            and not _arg(args, "use_rope_scaling")):
        return None
    heads, hidden = int(args.num_attention_heads), int(args.hidden_size)
    theta = float(_arg(args, "rotary_base", 10000))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": int(_arg(args, "ffn_hidden_size") or 4 * hidden), "num_hidden_layers": int(args.num_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_arg(args, "num_query_groups") or heads) if _arg(args, "group_query_attention") else heads,
        "head_dim": int(_arg(args, "kv_channels") or hidden // heads), "vocab_size": int(args.padded_vocab_size),
        "max_position_embeddings": int(_arg(args, "max_position_embeddings") or _arg(args, "seq_length") or 2048),
        "rms_norm_eps": float(_arg(args, "norm_epsilon", 1e-5)), "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": not _arg(args, "untie_embeddings_and_output_weights", False), "torch_dtype": dtype,
    }


class _Builder(ManifestBuilder):
    """The manifest being built from the ranks' ``model_optim_rng.pt`` (named relative to
    the root: the prefix is in every name)."""

    def __init__(self, root: str) -> None:
        super().__init__(root, "", ALLOWED)

    def tensor(self, name: str, shape: tuple[int, ...], t: StoredTensor, pieces: list, rank: int, layout: str) -> None:
        """The ``pieces`` of global tensor ``name`` that rank ``rank``'s tensor ``t`` holds."""
        if not t.is_contiguous():
            raise CorruptionError(f"{name!r}: a non-contiguous tensor in {t.file}")
        e = self.entry(name, shape, t.dtype, layout, t.file)
        if pieces:
            e.fragments.append(Fragment(t.file, t.offset, t.shape, pieces, [], itemsize(t.dtype), rank))


# ----------------------------------------------------------------------------- the ranks

class _Rank:
    """One ``model_optim_rng.pt``: its coordinates, file and unpickled content."""

    def __init__(self, rel: str, obj: Any, coords: Coords) -> None:
        if not isinstance(obj, dict):
            raise CorruptionError(f"{rel}: holds a {type(obj).__name__}, not Megatron's state dict")
        self.rel, self.obj, self.coords = rel, obj, coords
        self.rank = coords.rank("tp-dp-ep-pp")


def _place(b: _Builder, rules: Rules, r: _Rank, local: str, t: StoredTensor, name_of: Any, what: str,
           tied_copy: bool) -> str | None:
    """Add the pieces of one local tensor (of the model or one of its optimizer states);
    the global name its rule gives (None: not placed, reported)."""
    if tied_copy:
        b.replica(f"{r.rel}:{what}", "the last pipeline stage's copy of the tied word embeddings "
                  "(read from the first stage)", t)
        return None
    try:
        res = rules.resolve(local, tuple(t.shape), r.coords)
    except LayoutError as e:
        raise LayoutError(f"{r.rel}: {what} does not fit the model its args describe: {e}") from None
    if res is None:
        b.skip(f"{r.rel}:{what}", "matches no rule of the Megatron GPT model its args describe", t)
        return None
    owned: dict[str, list] = {}
    for tg in res.layout.targets:
        stored = res.part_names[tg.part]
        if tg.owner:
            owned.setdefault(stored, []).append(box_piece(tuple(t.shape), tg.local_box, res.stored_box(tg)))
    layout = f"megatron-legacy {res.rule.scheme.describe()}"
    for stored in dict.fromkeys(res.part_names):
        shape = res.part_shapes[res.part_names.index(stored)]
        b.tensor(name_of(stored), shape, t, owned.get(stored, []), r.rank, layout)
    if not owned:
        b.replica(f"{r.rel}:{what}", f"a tensor-parallel replica of {name_of(res.part_names[0])} (another tp rank's copy is read)", t)
    return res.name


def _tied_copy(local: str, args: argparse.Namespace, r: _Rank) -> bool:
    """The last stage's copy of tied embeddings (``word_embeddings_for_head`` in the legacy
    model, ``output_layer`` in Megatron-Core's when the output shares the embedding)."""
    tied = not _arg(args, "untie_embeddings_and_output_weights", False)
    last = r.coords.pp_rank == r.coords.pp - 1 and r.coords.pp > 1
    return tied and last and local in ("word_embeddings_for_head.weight", "output_layer.weight")


TIED_SAMPLE_ROWS = 16  # rows of a tied copy compared with the embedding they must equal


def _check_tied_copy(b: _Builder, local: str, t: StoredTensor, embed: StoredTensor | None, r: _Rank) -> None:
    """The last stage's copy of tied embeddings equals the first stage's embedding of the
    same tensor-parallel rank (Megatron all-reduces their gradients, so they stay bitwise
    equal): its shape and dtype, and ``TIED_SAMPLE_ROWS`` rows spread over it, compared;
    else a CorruptionError naming the file. An untied output layer read under args that
    say tied would otherwise be listed as a replica and dropped."""
    if embed is None or (t.shape, t.dtype) != (embed.shape, embed.dtype) or not embed.is_contiguous() \
            or not t.is_contiguous():
        what = "no embedding on the first stage" if embed is None else \
            f"{t.dtype} {list(t.shape)} against the embedding's {embed.dtype} {list(embed.shape)}"
        raise CorruptionError(f"{r.rel}: {local} is no copy of the tied word embeddings ({what}), but "
                              "args.untie_embeddings_and_output_weights is false: the args do not describe this checkpoint")
    rows = t.shape[0] if t.shape else 1
    row_bytes = t.nbytes // max(rows, 1)
    for i in sorted({rows - 1, *(k * rows // TIED_SAMPLE_ROWS for k in range(TIED_SAMPLE_ROWS))}):
        got, want = bytearray(row_bytes), bytearray(row_bytes)
        b.storage.reader(t.file).pread_into(t.offset + i * row_bytes, memoryview(got))
        b.storage.reader(embed.file).pread_into(embed.offset + i * row_bytes, memoryview(want))
        if got != want:
            raise CorruptionError(
                f"{r.rel}: {local} differs from the first stage's word embeddings (row {i} of tensor-parallel rank "
                f"{r.coords.tp_rank}), but args.untie_embeddings_and_output_weights is false, which makes it their copy: "
                "the args do not describe this checkpoint (an untied output layer would be dropped)")


def _check_stage_layers(rules: Rules, r: _Rank) -> None:
    """The rank's stage holds the stage-local layers ``0..n-1`` its rules give its pipeline
    stage (``args.num_layers`` split over the stages as the rules renumber them), else a
    CorruptionError naming the file: layers would otherwise get wrong global numbers."""
    for ren in (x for x in rules.renumber if x.axis == "pp"):
        counts = ren.counts(r.coords.pp)
        want, start = counts[r.coords.pp_rank], sum(counts[: r.coords.pp_rank])
        found = {int(m.group(1)) for name, _ in _leaves(r.obj["model"], "") if (m := re.search(ren.pattern, name))}
        if found != set(range(want)):
            held = sorted(found)
            raise CorruptionError(
                f"{r.rel}: pipeline stage {r.coords.pp_rank} of {r.coords.pp} holds {len(held)} layers (stage-local "
                f"{held[:8]}{' ...' if len(held) > 8 else ''}), but args.num_layers = {ren.total} gives it {want}"
                f"{f' (global layers {start} to {start + want - 1})' if want else ''}: the args do not describe this checkpoint")


VOCAB_PARALLEL = ("word_embeddings.weight", "word_embeddings_for_head.weight", "output_layer.weight")


def _check_vocab_rows(local: str, t: StoredTensor, args: argparse.Namespace, r: _Rank) -> None:
    """A vocabulary-parallel tensor (the embedding, the output layer) holds
    ``padded_vocab_size / tp`` rows on each tensor-parallel rank, as Megatron splits it;
    else a CorruptionError naming the file: the rows past the size the args give would be
    taken for padding and dropped."""
    if not local.endswith(VOCAB_PARALLEL) or not t.shape:
        return
    padded = _arg(args, "padded_vocab_size")
    if isinstance(padded, int) and not isinstance(padded, bool) and t.shape[0] * r.coords.tp != padded:
        raise CorruptionError(
            f"{r.rel}: {local} holds {t.shape[0]} rows on each of {r.coords.tp} tensor-parallel rank(s), "
            f"{t.shape[0] * r.coords.tp} in all, but args.padded_vocab_size = {padded}: the args do not describe this "
            "checkpoint")


def _read_model(b: _Builder, rules: Rules, args: argparse.Namespace, r: _Rank,
                embeddings: dict[int, StoredTensor]) -> list[tuple[str, str, StoredTensor]]:
    """The rank's model tensors as pieces; ``(local name, global name, tensor)`` of its
    parameters in model order (the optimizer's order). ``embeddings``: the first stage's
    word embeddings per tensor-parallel rank (filled on the first stage, checked against
    the last stage's tied copy)."""
    params = []
    for local, v in _leaves(r.obj["model"], ""):
        if local.endswith("_extra_state"):
            if isinstance(v, StoredTensor) or stored_tensors(v) or records_in(v):
                b.skip(f"{r.rel}:model.{local}", "TransformerEngine's extra state (FP8 scaling metadata): not "
                       "resharded", v)
            continue
        if not isinstance(v, StoredTensor):
            if v is not None:
                b.skip(f"{r.rel}:model.{local}", f"a {type(v).__name__} among the model's tensors: not read", v)
            continue
        _check_vocab_rows(local, v, args, r)
        if r.coords.pp_rank == 0 and local.endswith("embedding.word_embeddings.weight"):
            embeddings[r.coords.tp_rank] = v
        tied_copy = _tied_copy(local, args, r)
        if tied_copy:
            _check_tied_copy(b, local, v, embeddings.get(r.coords.tp_rank), r)
        g = _place(b, rules, r, local, v, lambda n: f"model.{n}", f"model.{local}", tied_copy)
        params.append((local, g or "", v))
    return params


def _param_groups(groups: Any, field: str) -> list[dict[str, Any]]:
    """The optimizer's ``param_groups`` (``field`` names where they are read; absent: none):
    dicts whose ``params`` are lists of integer indices and whose ``weight_decay`` and
    ``wd_mult`` are numbers; else a CorruptionError naming the file and the field."""
    if groups is None:
        return []
    if not isinstance(groups, list):
        raise CorruptionError(f"{field}.param_groups is of type {type(groups).__name__}, not a list")
    for i, g in enumerate(groups):
        if not isinstance(g, dict):
            raise CorruptionError(f"{field}.param_groups[{i}] is of type {type(g).__name__}, not a dict")
        ids = g.get("params")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in ids)):
            raise CorruptionError(f"{field}.param_groups[{i}].params is not a list of integer parameter indices "
                                  f"({ids!r:.60})")
        for key in ("weight_decay", "wd_mult"):
            if key in g and (not isinstance(g[key], (int, float)) or isinstance(g[key], bool)):
                raise CorruptionError(f"{field}.param_groups[{i}].{key} is {g[key]!r:.40}, not a number")
    return groups


def _groups_by_weight_decay(params: list[tuple[str, str, StoredTensor]], groups: list[dict[str, Any]],
                            where: str) -> list[list[tuple[str, str, StoredTensor]]]:
    """The model's parameters in the order of the optimizer's groups: Megatron puts biases
    and 1-d tensors in a group without weight decay, the others in one with it, each in
    model order; a group says which it is by ``wd_mult`` (newer versions) or its
    ``weight_decay`` (older ones: weight-decayed group first)."""
    decayed = [p for p in params if not (p[0].endswith(".bias") or len(p[2].shape) == 1)]
    plain = [p for p in params if p[0].endswith(".bias") or len(p[2].shape) == 1]
    decays = {float(g.get("weight_decay", 0.0)) for g in groups}
    kinds = []
    for i, g in enumerate(groups):
        if "wd_mult" in g:
            kinds.append(float(g["wd_mult"]) != 0.0)
        elif len(decays) > 1:
            kinds.append(float(g.get("weight_decay", 0.0)) != 0.0)
        else:  # no way to tell from the groups: the older order (decayed first), or the only kind there is
            kinds.append(i == 0 and bool(decayed))
    out, taken = [], {True: 0, False: 0}
    for kind, g in zip(kinds, groups):
        pool = decayed if kind else plain
        n = len(g.get("params") or [])
        out.append(pool[taken[kind]:taken[kind] + n])
        taken[kind] += n
    if taken[True] != len(decayed) or taken[False] != len(plain) or any(len(o) != len(g.get("params") or []) for o, g in zip(out, groups)):
        raise LayoutError(f"{where}: its optimizer's parameter groups ({[len(g.get('params') or []) for g in groups]} "
                          f"parameters) do not match the model's {len(decayed)} weight-decayed and {len(plain)} other parameters")
    return out


def _grad_scaler(b: _Builder, r: _Rank, scaler: Any) -> None:
    """The fp16 loss scaler's state (rank 0's): its tensors (``scale``, ``growth_tracker``...)
    as ``megatron.grad_scaler.<key>`` tensors, the rest as values."""
    if not isinstance(scaler, dict):
        if scaler is not None:
            b.value("megatron.grad_scaler", scaler)
        return
    for key, v in scaler.items():
        name = f"megatron.grad_scaler.{key}"
        if isinstance(v, StoredTensor):
            b.tensor(name, v.shape, v, [whole_piece(v.shape)] if v.numel else [], r.rank, "megatron-legacy value")
        else:
            b.value(name, v)


def _read_optimizer(b: _Builder, rules: Rules, args: argparse.Namespace, r: _Rank,
                    params: list[tuple[str, str, StoredTensor]]) -> None:
    """The non-distributed optimizer's per-parameter state and fp32 master copies."""
    osd = r.obj.get("optimizer")
    if isinstance(osd, list):
        b.skip(f"{r.rel}:optimizer", "the state of a ChainedOptimizer (several optimizers: MoE experts or a "
               "decoupled learning rate): not read", osd)
        return
    if not isinstance(osd, dict):
        if stored_tensors(osd):
            b.skip(f"{r.rel}:optimizer", f"an optimizer state of type {type(osd).__name__}: not read", osd)
        return
    inner = osd.get("optimizer") if isinstance(osd.get("optimizer"), dict) else osd
    field = f"{r.rel}: optimizer{'.optimizer' if inner is not osd else ''}"
    groups = _param_groups(inner.get("param_groups"), field)
    state = inner.get("state")
    if state is None:
        state = {}
    elif not isinstance(state, dict):
        raise CorruptionError(f"{field}.state is of type {type(state).__name__}, not a dict of per-parameter states")
    masters = osd.get("fp32_from_fp16_params")
    if r.coords.tp_rank == 0 and r.coords.pp_rank == 0:
        b.value("optim.param_groups", [dict(g) for g in groups])
        _grad_scaler(b, r, osd.get("grad_scaler"))
    elif "grad_scaler" in osd and stored_tensors(osd["grad_scaler"]):
        b.replica(f"{r.rel}:optimizer.grad_scaler", "the same loss scale on every rank (rank 0's is read)", osd["grad_scaler"])
    if not state and not masters:
        return
    where = f"{r.rel}:optimizer"
    ordered = _groups_by_weight_decay(params, groups, where)
    for gi, (g, members) in enumerate(zip(groups, ordered)):
        for pos, (index, (local, _, p)) in enumerate(zip(g.get("params") or [], members)):
            entries = state.get(index) or {}
            if not isinstance(entries, dict):
                raise CorruptionError(f"{field}.state[{index}] is of type {type(entries).__name__}, not a dict of the "
                                      "parameter's state tensors")
            entries = dict(entries)
            if isinstance(masters, list) and gi < len(masters) and isinstance(masters[gi], list) and pos < len(masters[gi]):
                entries["fp32_param"] = masters[gi][pos]
            for key, v in entries.items():
                what = f"optimizer.state.{index}.{key}" if key != "fp32_param" else f"optimizer.fp32_from_fp16_params.{gi}.{pos}"
                if not isinstance(v, StoredTensor):
                    continue
                if v.shape == p.shape or _tied_copy(local, args, r):
                    _place(b, rules, r, local, v, lambda n, k=key: f"optim.state.{n}.{k}", what, _tied_copy(local, args, r))
                elif not v.shape:
                    res = rules.resolve(local, tuple(p.shape), r.coords)
                    for stored in dict.fromkeys(res.part_names if res else []):
                        name = f"optim.state.{stored}.{key}"
                        if name in b.manifest.tensors:
                            b.replica(f"{r.rel}:{what}", f"the same {key} as {name} (read from another rank)", v)
                        else:
                            b.tensor(name, (), v, [whole_piece(())], r.rank, "megatron-legacy scalar")
                else:
                    b.skip(f"{r.rel}:{what}", f"shape {list(v.shape)} is not its parameter's {list(p.shape)}", v)


def _read_rest(b: _Builder, r: _Rank) -> None:
    """Everything of the state dict besides the model and optimizer: values once (rank 0),
    per-rank RNG state reported, copies on the other ranks as replicas."""
    for key, v in r.obj.items():
        if key in ("model", "optimizer"):
            continue
        first = r.coords.tp_rank == 0 and r.coords.pp_rank == 0
        if key == "rng_state":
            b.skip(f"{r.rel}:rng_state", "per-rank RNG state (Python, NumPy, torch and CUDA generators) of one "
                   "tensor- and pipeline-parallel rank: not mapped onto another layout", v)
        elif key == "iteration" and first:
            b.value("train.step", v)
        elif key == "args" and first:
            b.value("megatron.args", v)
        elif first:
            b.value(f"megatron.{key}", v)
            if stored_tensors(v):
                b.skip(f"megatron.{key}", "holds tensors beside plain values: not read", v)
        elif stored_tensors(v):
            b.replica(f"{r.rel}:{key}", f"rank 0's copy of megatron.{key} is read", v)


def read_megatron_legacy(path: str, regions: dict[str, list[Region]] | None = None) -> Manifest:
    """The manifest of the legacy Megatron-LM checkpoint at ``path`` (an iteration
    directory, or its parent with ``latest_checkpointed_iteration.txt``): see the module
    docstring. ``regions``, when given, receives each file's declared regions for the ledger."""
    found = _resolve(str(path))
    if found is None:
        raise NotACheckpointError(f"{path}: not a legacy Megatron-LM checkpoint (no mp_rank_*/{MODEL_FILE}, no "
                                  f"{TRACKER} naming an iteration directory holding them)")
    prefix, tag_dir = found
    dirs = _rank_dirs(tag_dir)
    b = _Builder(str(path))
    try:
        manifest = _read(b, dirs, prefix)
    finally:
        b.storage.close()
    b.account(manifest, regions)
    return manifest


def _read(b: _Builder, dirs: dict[tuple[int, int], str], prefix: str) -> Manifest:
    first = b.archive(f"{prefix}{dirs[min(dirs)]}/{MODEL_FILE}")
    args = first.get("args") if isinstance(first, dict) else None
    where = f"{prefix}{dirs[min(dirs)]}/{MODEL_FILE}"
    if not isinstance(args, argparse.Namespace):
        raise LayoutError(f"{where}: no Megatron args in the checkpoint: its model's sizes are unknown")
    version = first.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version < 3.0:
        raise LayoutError(f"{where}: checkpoint_version {version!r} (before 3.0, QKV was stored in another order): "
                          "not supported; load and save it once with Megatron-LM to upgrade it")
    if any(k.startswith("model") and k != "model" for k in first):
        raise LayoutError(f"{where}: virtual pipeline model chunks ({', '.join(k for k in first if k.startswith('model'))}) "
                          "are not supported")
    if _arg(args, "decoder_first_pipeline_num_layers") or _arg(args, "decoder_last_pipeline_num_layers") \
            or _arg(args, "num_experts"):
        raise LayoutError(f"{where}: uneven pipeline stages or MoE layers in a legacy checkpoint are not supported")
    tp, pp = _parallel_size(args, "tensor_model_parallel_size", where), _parallel_size(args, "pipeline_model_parallel_size", where)
    if tp * pp != len(dirs) or any(t >= tp or p >= pp for t, p in dirs):
        # never a set of tp * pp coordinates: the sizes are untrusted; at most len(dirs) + 4 visited
        missing = list(islice(((t, p) for t in range(tp) for p in range(pp) if (t, p) not in dirs), 4))
        raise CorruptionError(f"{prefix or './'}: rank directories {sorted(dirs)} for tensor-parallel size {tp} and "
                              f"pipeline size {pp} (from {where}; missing: {missing})")
    model = first.get("model")
    if not isinstance(model, dict):
        raise CorruptionError(f"{where}: no model state dict")
    naming = "legacy" if "language_model" in model else "mcore"
    rules = rules_from_args(args, naming)
    embeddings: dict[int, StoredTensor] = {}  # the first stage's, per tensor-parallel rank
    for (t, p), d in sorted(dirs.items(), key=lambda x: (x[0][1], x[0][0])):
        rel = f"{prefix}{d}/{MODEL_FILE}"
        obj = first if (t, p) == min(dirs) else b.archive(rel)
        r = _Rank(rel, obj, _coords(tp=tp, tp_rank=t, pp=pp, pp_rank=p))
        if not isinstance(r.obj.get("model"), dict):
            raise CorruptionError(f"{rel}: no model state dict")
        _check_stage_layers(rules, r)
        params = _read_model(b, rules, args, r, embeddings)
        _read_optimizer(b, rules, args, r, params)
        _read_rest(b, r)
        dist = f"{prefix}{d}/{DIST_OPTIM_FILE}"
        if b.storage.exists(dist):
            size = b.manifest.files[dist] = b.storage.size(dist)
            b.skipped[dist] = ("the distributed optimizer's flat per-bucket buffers (fp32 params, exp_avg, exp_avg_sq): "
                               "not read, the checkpoint does not store where each parameter lies in them")
            b.regions[dist] = [Region(dist, 0, size, dist)]
    m = b.manifest
    m.provenance = {"format": FORMAT, "checkpoint_version": version, "tensor_parallel": tp, "pipeline_parallel": pp,
                    "naming": naming, "rules": rules.to_json()}
    embed = next((e for n, e in m.tensors.items() if n.endswith("word_embeddings.weight")), None)
    config = hf_config(args, {"BF16": "bfloat16", "F16": "float16"}.get(embed.dtype if embed else "", "float32"))
    if config is not None:  # what `unickpt export --format hf` writes as config.json
        m.metadata["hf_config"] = encode_value(config, "hf_config")
    return m
