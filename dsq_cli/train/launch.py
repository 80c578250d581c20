"""Start N training processes on this machine, one per device, and wait for them.

``dsq train train.distributed_world_size=N``: the parent checks the config, prepares the data and
makes the run directory (`entry`), then `spawn` starts N workers, each running the per-rank
function it is handed as ``target``, and waits. Under torchrun or srun every process is already a
worker and this module is not used.

The launcher knows nothing of what the ranks run: it imports only `ranks`, and receives the
per-rank function as an argument, so that the layer above it (`entry`, `rank_run`) is never
imported from below.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

from .ranks import Rank, destroy_process_group, init_process_group

log = logging.getLogger(__name__)

# After rank 0 has exited (or any rank has failed), how long the others get before being stopped.
GRACE_SECONDS = 60.0

# target(rank, *args) -> the process's exit code
RankTarget = Callable[..., int]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(world_size: int, device: str, target: RankTarget, args: tuple) -> dict[int, int | None]:
    """Run ``target(rank, *args)`` in ``world_size`` processes, one per device, in one process
    group; return each rank's exit code (None: it had to be killed). SIGINT/SIGTERM sent to this
    process are passed on to the workers, which stop together after the current update.
    ``target`` and ``args`` must be picklable (a module-level function and plain values)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    workers = [
        context.Process(
            target=_worker,
            args=(target, Rank(r, world_size, r), device, init_method, args, os.getpid()),
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
            deadline = time.monotonic() + GRACE_SECONDS
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


def threads_per_process(processes: int, cores: int | None = None) -> int:
    """The intra-op threads of each of ``processes`` CPU training processes (ranks, or a sweep's
    parallel jobs) on this machine: its cores shared out, at least one. Each would otherwise
    start a thread per core, and with GNU OpenMP's busy waiting N processes of as many threads
    as cores run several times slower than processes that share the cores (torchrun, for the
    same reason, gives each process one thread)."""
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)  # the cores this process may use
        cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    return max(1, cores // processes)


# Linux's prctl option: the signal a process receives when its parent dies
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> bool:
    """Have the kernel SIGKILL this process when its parent (pid ``parent``) dies, however it
    dies; exit at once if it already has. The launcher holds the run's lock (`runs.hold`): a
    worker that outlived a killed launcher would go on writing to a run directory that the lock
    no longer guards. False where the system offers no such request (not Linux): there the
    workers stop when the launcher passes its signals on, and not when it is killed."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl.restype = ctypes.c_int
    if prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    if os.getppid() != parent:  # the parent died before the request: nobody would send it
        os._exit(1)
    return True


def _worker(target: RankTarget, rank: Rank, device: str, init_method: str, args: tuple,
            parent: int):  # fmt: skip
    """One spawned rank: its own process group, so that a terminal's Ctrl-C reaches the parent
    only (which passes it on once), then ``target`` inside the initialised process group. It
    dies with the launching process (`die_with_parent`). On CPU it takes its share of the cores
    (`threads_per_process`), unless OMP_NUM_THREADS says."""
    os.setpgrp()
    die_with_parent(parent)
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(threads_per_process(rank.world_size))
    init_process_group(rank, device, init_method)
    try:
        code = target(rank, *args)
    finally:
        destroy_process_group()
    sys.exit(code)
