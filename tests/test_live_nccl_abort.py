"""The dead generation's communicators are aborted off the re-forming's critical path
(unickpt.live.nccl_abort; issue: NCCL's abort took ~1.2 s of a 1.2 s re-forming on an
H200). Run on torch's fake backend, whose groups go through the same registry and the
same ``ProcessGroup.abort`` as NCCL's; the abort made slow, to see what waits for it."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from unickpt.live.nccl_abort import abort_in_background, join_aborts, pending_aborts

SLOW_S = 0.5  # each abort's duration here (NCCL's proxy threads join on a 500 ms tick)


@pytest.fixture
def slow_aborts(monkeypatch):
    """``ProcessGroup.abort`` taking SLOW_S each; the groups aborted and the threads they were aborted on."""
    real, seen = dist.ProcessGroup.abort, []

    def abort(pg):
        time.sleep(SLOW_S)
        seen.append((pg, threading.current_thread().name))
        real(pg)

    monkeypatch.setattr(dist.ProcessGroup, "abort", abort)
    yield seen
    join_aborts(5)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_new_generation_forms_while_the_old_groups_are_aborted(slow_aborts):
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    sub, default = dist.new_group([0, 1]), dist.group.WORLD
    t0 = time.monotonic()
    assert abort_in_background()
    assert not dist.is_initialized()  # torch's registry forgot the old groups at once
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)  # the next generation
    fresh = dist.new_group([0, 1])
    formed = time.monotonic() - t0
    assert formed < SLOW_S and pending_aborts() == 1 and not slow_aborts, formed
    assert dist.get_world_size() == 3 and dist.get_process_group_ranks(fresh) == [0, 1]
    assert join_aborts(5) == 0
    # both old groups aborted (the newest first, as torch's own abort does), none of the new ones
    assert [pg for pg, _ in slow_aborts] == [sub, default]
    assert {name for _, name in slow_aborts} == {"unickpt-abort-old-groups"}
    assert dist.group.WORLD is not default


def test_nothing_to_abort_without_a_group():
    assert not dist.is_initialized()
    assert not abort_in_background()
    assert join_aborts(1) == 0
