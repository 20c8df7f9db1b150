"""Writes tests/data/megatron_legacy_tp2_pp2/: a legacy Megatron-LM checkpoint
(``--ckpt-format torch``, tensor parallel 2 x pipeline parallel 2, legacy
``language_model.encoder.*`` names, GQA with 4 query heads in 2 groups, SwiGLU, a padded
vocabulary of 30 -> 32 rows, bf16 weights with the fp32 main params - carrying Megatron's
tensor-parallel attributes - and AdamW state of megatron-core's
``Float16OptimizerWithFloat16Params``), built as Megatron-LM's
``megatron/training/checkpointing.py`` writes it (see tests/megatron_legacy_cases.py for
what was followed), and ``expected.pt``: the global state from a live global AdamW step,
the ground truth of the tests. Regenerate with:

    rm -rf tests/data/megatron_legacy_tp2_pp2
    PYTHONPATH=src:tests python tests/data/make_megatron_legacy.py tests/data/megatron_legacy_tp2_pp2
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import megatron_legacy_cases as cases  # noqa: E402

if __name__ == "__main__":
    out = sys.argv[1]
    cfg = cases.Cfg()
    cases.write(cfg, os.path.join(out, "ckpt"))
    torch.save(cases.truth(cfg), os.path.join(out, "expected.pt"))
