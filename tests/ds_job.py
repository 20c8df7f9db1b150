"""What every DeepSpeed job of the tests (ds_train.py, ds_parallel_train.py, ds_moe_train.py)
does to start and to end on CPU (gloo)."""

from __future__ import annotations

import importlib
import os
import sys


def init_gloo():
    """Import DeepSpeed and initialise its process group on gloo; returns the module.

    DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce kernel on first use
    (minutes on a small machine, cached under ~/.cache/torch_extensions); gloo is all these
    tests need, so the kernel is skipped: deterministic and no compiler needed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def leave_without_finalizing() -> None:
    """End the job once every rank has written everything and passed its final barrier.

    DeepSpeed keeps its process groups in module globals, so they outlive
    destroy_process_group() and are destroyed during interpreter finalization, where gloo's
    threads can abort the process ("terminate called without an active exception", seen once
    in CI after a complete run): leave without finalizing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
