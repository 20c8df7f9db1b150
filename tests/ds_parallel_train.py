"""Write DeepSpeed checkpoints beyond pure data parallelism on CPU (gloo), 2 ranks, for
tests/test_deepspeed_layouts.py:

* ``pp``: a PipelineModule of 4 layers in 2 stages (ZeRO-1): ``layer_XX-model_states.pt``,
  ``mp_rank_00/01_model_states.pt``, ``zero_pp_rank_0_mp_rank_00/01_optim_states.pt``;
* ``tp``: an MLP under AutoTP (column- then row-parallel, a replicated norm), tensor-parallel over the 2
  ranks (ZeRO-1):
  ``mp_rank_00/01`` files with DeepSpeed's ``universal_checkpoint_info``.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 \\
        tests/ds_parallel_train.py pp ckpt_dir
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def _config(stage: int = 1, micro: int = 2, accumulation: int = 1, world: int = 2) -> dict:
    return {"train_batch_size": micro * accumulation * world, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accumulation, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "gradient_clipping": 0.0}


def pipeline(deepspeed, out: str) -> None:
    from deepspeed.pipe import PipelineModule

    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 4)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_config(accumulation=2, world=1))

    def batches():
        g = torch.Generator().manual_seed(1)
        while True:
            yield torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)

    data = batches()
    for _ in range(2):
        engine.train_batch(data)
    engine.save_checkpoint(out)


def tensor_parallel(deepspeed, out: str) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up_proj = nn.Linear(8, 16)  # column-parallel: weight and bias split on dim 0
            self.down_proj = nn.Linear(16, 8)  # row-parallel: weight split on dim 1, bias replicated
            self.norm = nn.LayerNorm(8)  # replicated

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.down_proj(torch.relu(self.up_proj(x))))

    model = Model()
    config = _config(micro=2, world=2)
    config["tensor_parallel"] = {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*up_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*down_proj\.weight$"], "partition_type": "row"}]}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(out)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    import torch.distributed as dist

    from ds_job import init_gloo

    deepspeed = init_gloo()
    torch.manual_seed(0)
    {"pp": lambda: pipeline(deepspeed, out), "tp": lambda: tensor_parallel(deepspeed, out)}[mode]()
    dist.barrier()


if __name__ == "__main__":
    main()
    from ds_job import leave_without_finalizing

    leave_without_finalizing()
