"""Rank functions for the resume-anywhere tests (module level so spawn can import them)."""

from __future__ import annotations

import json

from unickpt.examples.train import run

SMALL = ["--steps", "8", "--seed", "3"]


def train(rank: int, world: int, flags: list[str], out: str | None) -> None:
    """Run the example trainer on an already initialised group; rank 0 writes its records."""
    records = run(SMALL + flags)
    if rank == 0 and out:
        with open(out, "w") as f:
            json.dump(records, f)


def train_many(rank: int, world: int, jobs: list[tuple[list[str], str]]) -> None:
    """Several trainer runs in one set of processes (saves process start-up time)."""
    import torch.distributed as dist

    for flags, out in jobs:
        train(rank, world, flags, out)
        dist.barrier()


def train_many_printing(rank: int, world: int, jobs: list[tuple[list[str], str]]) -> None:
    """``train_many``, each run's printed lines kept in ``<out>.stdout`` (rank 0's)."""
    import contextlib
    import io

    import torch.distributed as dist

    for flags, out in jobs:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            train(rank, world, flags, out)
        if rank == 0:
            with open(f"{out}.stdout", "w") as f:
                f.write(printed.getvalue())
        dist.barrier()
