"""What Megatron-LM and Megatron-DeepSpeed pickle beside tensors, allowed as data.

One allow-list for every reader of a file Megatron writes: the legacy Megatron-LM reader
(``model_optim_rng.pt``, :mod:`unickpt.adapters.megatron_legacy`) and the DeepSpeed reader
(Megatron-DeepSpeed's ``client_state`` in ``mp_rank_XX_model_states.pt``,
:mod:`unickpt.adapters.deepspeed`). Megatron's training state holds:

* ``args``: an ``argparse.Namespace`` (built as one: only its attributes are set), whose
  values include Megatron's enums (``attention_backend``, ``model_type``,
  ``position_embedding_type``...: kept as text, ``"AttnBackend(5)"``, the enum class is
  never imported) and torch dtypes (``params_dtype``: the unpickler's own dtypes);
* ``rng_state``: ``np.random.get_state()`` (NumPy's ``_reconstruct``, ``ndarray``,
  ``dtype``, ``scalar``: inert records, never built; the readers report the RNG state as
  skipped) with the raw bytes pickle protocol 2 writes through ``_codecs.encode`` and
  ``bytes()``, and torch's ByteTensors;
* TransformerEngine's ``_extra_state`` as older versions return it: an ``io.BytesIO``
  (inert record, reported as skipped).

Anything else is refused by the unpickler (:class:`~unickpt.UnsafePickleError`).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import UnickptError
from .torch_archive import inert_records


class MegatronEnum(str):
    """An enum value of Megatron's args (``AttnBackend.auto``), kept as ``"Class(value)"``:
    the enum class is never imported."""


def _enum(name: str) -> Any:
    def build(value: Any = None) -> MegatronEnum:
        if not isinstance(value, (int, str, type(None))):
            raise UnickptError(f"an enum {name} with a value of type {type(value).__name__}")
        return MegatronEnum(f"{name}({value!r})")
    return build


# Megatron-Core's (Megatron-LM; Megatron-DeepSpeed vendors megatron.core too) and the older
# megatron.model.enums (Megatron-DeepSpeed, Megatron-LM before megatron.core)
ENUMS = frozenset({
    ("megatron.core.transformer.enums", "AttnBackend"), ("megatron.core.transformer.enums", "AttnMaskType"),
    ("megatron.core.transformer.enums", "AttnType"), ("megatron.core.transformer.enums", "LayerType"),
    ("megatron.core.transformer.enums", "ModelType"), ("megatron.core.enums", "ModelType"),
    ("megatron.model.enums", "AttnMaskType"), ("megatron.model.enums", "AttnType"),
    ("megatron.model.enums", "LayerType"), ("megatron.model.enums", "PositionEmbeddingType"),
    ("megatron.core.enums", "Fp8Recipe"),
})


def _latin1(text: Any = "", encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as pickle protocol 2 uses it for raw bytes (NumPy's arrays): latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnickptError(f"a _codecs.encode record with arguments of types {type(text).__name__}, {encoding!r:.20}")
    return text.encode("latin-1")


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()`` as pickle protocol 2 writes an empty bytes object; nothing else."""
    if args:
        raise UnickptError("a bytes(...) record with arguments (protocol 2 writes only bytes())")
    return b""


MEGATRON_ALLOWED: dict[tuple[str, str], Any] = {
    ("_codecs", "encode"): _latin1,
    ("__builtin__", "bytes"): _empty_bytes,
    ("builtins", "bytes"): _empty_bytes,
    ("argparse", "Namespace"): argparse.Namespace,
    **{key: _enum(key[1]) for key in ENUMS},
    # np.random.get_state() in the RNG state: read as inert records (reported as skipped)
    **inert_records("numpy.core.multiarray", ("_reconstruct", "scalar")),
    **inert_records("numpy._core.multiarray", ("_reconstruct", "scalar")),
    **inert_records("numpy", ("ndarray", "dtype")),
    # TransformerEngine's _extra_state (FP8 metadata) as older versions return it: reported as skipped
    **inert_records("_io", ("BytesIO",)),
}
