"""What a new user tripped on (issue 37), each with the real thing:

* a corrupt newest checkpoint (one flipped byte that only rank 1 reads, 2 ranks, gloo):
  ``CheckpointManager.restore`` resumes the step before it on every rank, bitwise, and
  the one line names the checkpoint passed over, the rank and the checksum that failed;
  ``latest()`` and ``load()`` pass it over too.
"""

from __future__ import annotations

from unickpt.testing import run_ranks

from trust_cases import corrupt_newest_is_passed_over


def test_a_corrupt_newest_checkpoint_is_passed_over_by_every_rank(tmp_path):
    run_ranks(corrupt_newest_is_passed_over, 2, str(tmp_path / "ckpt"))
