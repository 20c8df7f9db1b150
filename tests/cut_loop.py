"""Survivors blocked in collectives of groups a DeviceMesh made (tests/test_live.py).

Generation 0, 4 ranks on a dp2 x tp2 mesh (tp groups {0,1}, {2,3}; dp groups {0,2}, {1,3}):
rank 0 waits in an all-reduce on its tp group for rank 1, which waits on its dp group for
rank 3, which waits to be SIGKILLed; rank 2 waits on its tp group for rank 3. Rank 3's
death breaks ranks 1 and 2's connections at once; rank 0's peer (rank 1) is alive, so rank
0 fails only because rank 1 cuts every group of the generation, the mesh's included.
Generation 1, 3 ranks on a 1-D mesh with FSDP2: rank 1 waits in FSDP2's all-gather (the
forward) for rank 0, which waits in a ``recv`` from rank 2, which waits to be killed.
Generation 2, 2 ranks: done. Each rank appends ``{"rank", "generation", "failed_at"}`` when
its collective fails, and ``{"ready": pid}`` when it is the one to kill. The meshes are
kept in a module global past ``fn``, as user code often does: destroying the groups alone
would not end a peer's wait then.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import unickpt

# what a user's code often keeps past fn (a module-level cache, a framework's global): the
# old generation's groups stay alive here, so only cutting them ends a peer's wait on them
HELD: list = []


def main() -> None:
    log = sys.argv[1]

    def note(**doc) -> None:
        with open(log, "a") as f:
            f.write(json.dumps(doc) + "\n")

    def train(world: unickpt.World) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if world.size == 2:
            note(done=world.rank, generation=world.generation)
            return
        victim = world.size - 1
        if world.size == 4:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            HELD.append(mesh)
            dist.barrier()
            try:
                if world.rank == victim:
                    note(ready=os.getpid())
                    time.sleep(3600)
                group = mesh["dp"].get_group() if world.rank == 1 else mesh["tp"].get_group()
                dist.all_reduce(torch.ones(4), group=group)
            except BaseException:
                note(rank=world.rank, generation=world.generation, failed_at=time.time())
                raise
        else:
            mesh = init_device_mesh("cpu", (world.size,))
            model = torch.nn.Linear(8, 8)
            fully_shard(model, mesh=mesh)
            HELD.append((mesh, model))
            dist.barrier()
            try:
                if world.rank == victim:
                    note(ready=os.getpid())
                    time.sleep(3600)
                if world.rank == 0:
                    dist.recv(torch.empty(4), src=victim)
                else:
                    model(torch.ones(2, 8))  # FSDP2 all-gathers the parameters: waits for rank 0
            except BaseException:
                note(rank=world.rank, generation=world.generation, failed_at=time.time())
                raise

    unickpt.run(train)


if __name__ == "__main__":
    main()
