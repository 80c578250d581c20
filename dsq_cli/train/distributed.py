"""Data-parallel training: N processes, one per device, fairseq's DDP between them.

Two ways in:

* ``dsq train train.distributed_world_size=N`` on one machine: this process checks the config,
  prepares the data and makes the run directory, then spawns N workers and waits for them.
* Under ``torchrun`` (or ``srun`` setting RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
  MASTER_PORT): every process is already a worker; rank 0 prepares the data and makes the run
  directory, and tells the others where it is.

fairseq's own launcher (``distributed_utils.call_main``) is not used: it asserts CUDA devices
(``world size is 2 but have 0 available devices``) and divides by ``torch.cuda.device_count()``
under torchrun. The process group is initialised here instead: gloo on CPU, NCCL on GPUs.

What keeps the ranks in step (docs/scaling.md):
* the validation loss is fairseq's all-reduced one, and rank 0's value is broadcast before the
  DSQ schedule steps, so every rank takes the same precision change at the same update;
* a stop request (SIGINT/SIGTERM on any rank) is agreed on between updates by an all-reduce, so
  all ranks stop after the same update;
* only rank 0 writes the run directory's SPEC 5 files, checkpoints and wandb; rank R>0 writes
  only its own log, ``train.rankR.log``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# After rank 0 has exited (or any rank has failed), how long the others get before being stopped.
_GRACE_SECONDS = 60.0


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


# -- one machine: spawn the workers ---------------------------------------------------------------
def check_devices(world_size: int, device: str) -> None:
    """One device per rank on GPUs (before anything is written); CPU ranks share the cores."""
    if device != "cuda":
        return
    import torch

    if torch.cuda.device_count() < world_size:
        from dsq_cli.config import ConfigError

        raise ConfigError(
            f"train.distributed_world_size={world_size} but torch sees "
            f"{torch.cuda.device_count()} CUDA devices; lower it or use train.device=cpu"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(cfg, run_dir: Path, *, resumed: bool, device: str) -> dict[int, int | None]:
    """Run ``cfg.train.distributed_world_size`` workers on this machine, one per device; return
    each rank's exit code (None: it had to be killed). SIGINT/SIGTERM sent to this process are
    passed on to the workers, which stop together after the current update."""
    import multiprocessing

    world_size = int(cfg.train.distributed_world_size)
    context = multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    workers = [
        context.Process(
            target=_worker,
            args=(Rank(r, world_size, r), cfg, str(run_dir), resumed, device, init_method),
            name=f"dsq-rank{r}",
        )
        for r in range(world_size)
    ]
    forwarded = _forward_signals_to(workers)
    try:
        for worker in workers:
            worker.start()
        return _wait(workers)
    finally:
        for signum, handler in forwarded.items():
            signal.signal(signum, handler)


def _forward_signals_to(workers) -> dict:
    def forward(signum, frame):
        log.warning("%s received: passing it to the workers", signal.Signals(signum).name)
        for worker in workers:
            if worker.pid is not None and worker.exitcode is None:
                os.kill(worker.pid, signum)

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[signum] = signal.signal(signum, forward)
        except ValueError:  # not the main thread
            pass
    return previous


def _wait(workers) -> dict[int, int | None]:
    """Wait for every worker. Once rank 0 has ended, or any rank has failed, the others get a
    grace period (they may be blocked in a collective that will never complete), then stop."""
    deadline = None
    while any(w.is_alive() for w in workers):
        time.sleep(0.2)
        ended_badly = any(w.exitcode not in (None, 0) for w in workers)
        if deadline is None and (workers[0].exitcode is not None or ended_badly):
            deadline = time.monotonic() + _GRACE_SECONDS
        if deadline is not None and time.monotonic() > deadline:
            for worker in workers:
                if worker.is_alive():
                    log.error("%s did not finish; stopping it", worker.name)
                    worker.kill()
            for worker in workers:
                worker.join()
    codes = {}
    for r, worker in enumerate(workers):
        worker.join()
        code = worker.exitcode
        codes[r] = code if code is not None and code >= 0 else None
    return codes


def _worker(rank: Rank, cfg, run_dir: str, resumed: bool, device: str, init_method: str):
    """One spawned rank: its own process group so that a terminal's Ctrl-C reaches the parent
    only (which passes it on once), then the same per-rank training as under torchrun."""
    from .common import quiet_library_warnings
    from .run import train_rank

    os.setpgrp()
    quiet_library_warnings()  # what `dsq train` set in the parent, which a spawned child lacks
    init_process_group(rank, device, init_method)
    try:
        outcome = train_rank(cfg, Path(run_dir), rank=rank, device=device, resumed=resumed)
        code = outcome.exit_code
    finally:
        destroy_process_group()
    sys.exit(code)
