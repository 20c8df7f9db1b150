"""Rank functions of tests/test_dcp_dropin.py (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def async_save_process_mode(rank: int, world: int, path: str) -> None:
    """``dcp.async_save`` in process mode through unickpt's writer: the checkpoint holds
    the state as it was at the call, although the live state changes during the save."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import unickpt
    from unickpt.dcp import StorageWriter

    w = torch.arange(32, dtype=torch.float32).reshape(8, 4) + rank
    want = w.clone()
    fut = dcp.async_save({f"w{rank}": w, "step": 3}, storage_writer=StorageWriter(path),
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    w.add_(100.0)  # the training step after the call
    fut.result()
    dist.barrier()
    assert unickpt.verify(path).ok
    for r in range(world):
        assert torch.equal(unickpt.load_tensor(path, f"w{r}"), torch.arange(32, dtype=torch.float32).reshape(8, 4) + r)
    assert torch.equal(unickpt.load_tensor(path, f"w{rank}"), want)
