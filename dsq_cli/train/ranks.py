"""Where this process stands in a data-parallel group, and the few collectives the training loop
needs. A leaf: it imports nothing from dsq_cli, so every layer of training may use it.

The process group is initialised here rather than by fairseq's launcher
(``distributed_utils.call_main``), which asserts CUDA devices and divides by
``torch.cuda.device_count()`` under torchrun: gloo on CPU, NCCL on GPUs.

What keeps the ranks in step (docs/scaling.md):
* the validation loss is fairseq's all-reduced one, and rank 0's value is broadcast
  (`broadcast_from_main`) before the DSQ schedule steps, so every rank takes the same precision
  change at the same update;
* a stop request (SIGINT/SIGTERM on any rank) is agreed on between updates by an all-reduce
  (`max_over_ranks`), so all ranks stop after the same update.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Rank:
    """Where this process stands in the data-parallel group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # the device index on this machine

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


SINGLE = Rank()


def backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def fairseq_ddp_backend(device: str) -> str:
    """fairseq's ``--ddp-backend``: torch's DDP on GPUs. On CPU fairseq's wrapper would hand
    torch's DDP ``device_ids=[device_id]``, which it refuses for a CPU module (it wants None), so
    CPU ranks use fairseq's own ``legacy_ddp``: the same averaged gradients, all-reduced in
    buckets after the backward pass instead of overlapping with it."""
    return "pytorch_ddp" if device == "cuda" else "legacy_ddp"


def from_environment() -> Rank | None:
    """The rank torchrun / srun gave this process, or None when it was started on its own."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or int(world) <= 1 or "RANK" not in os.environ:
        return None
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    return Rank(int(os.environ["RANK"]), int(world), int(local))


def init_process_group(rank: Rank, device: str, init_method: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank.local_rank)
    dist.init_process_group(
        backend(device),
        init_method=init_method,
        rank=rank.rank,
        world_size=rank.world_size,
        timeout=datetime.timedelta(minutes=30),
    )


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_from_main(value):
    """Rank 0's ``value`` on every rank (any picklable object); ``value`` as is when alone."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def max_over_ranks(value: int) -> int:
    """The largest ``value`` any rank holds (used to agree on a stop request)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())
