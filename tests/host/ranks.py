"""Rank bodies of the host-side tests: launch bodies of ``tests/host/test_launch.py`` (for
``tpcomm.launch.launch``: ``fn(rank, world_size, *args)``) and the pool body of ``tests/host/test_arguments.py``
(``fn(ctx, *args)``).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import tpcomm


# -- launch bodies: (rank, world_size, *args) ------------------------------------------------------------
def launch_identity(rank, world_size, tag):
    """What a launched rank sees of its set-up, and a kernel all_reduce on a fresh Communicator."""
    with tpcomm.Communicator() as comm:
        y = comm.all_reduce(torch.full((3, 5), float(rank + 1), dtype=torch.bfloat16))
        uses_kernels = comm.uses_kernels
    # plain values: tensors in a launch result are the subject of test_launch_returns_tensors
    return {"y": y.float().tolist(), "y_dtype": str(y.dtype), "uses_kernels": uses_kernels,"rank": rank,
            "world_size": world_size, "dist_rank": dist.get_rank(),
            "dist_world": dist.get_world_size(), "backend": str(dist.get_backend()),
            "interpret": os.environ.get("TRITON_INTERPRET"), "omp": os.environ.get("OMP_NUM_THREADS"),
            "threads": torch.get_num_threads(), "tag": tag, "pid": os.getpid()}


def launch_environment(rank, world_size, names):
    """The values of the variables ``names`` in a launched rank, and whether its kernels run under the
    interpreter."""
    from tpcomm.env import interpreter_enabled

    return {n: os.environ.get(n) for n in names}, interpreter_enabled()


def launch_cuda_rank(rank, world_size):
    """An NCCL all-reduce of ``rank + 1`` on this rank's GPU, the rank's NVLS setting and whether its
    kernels run under the interpreter."""
    from tpcomm.env import interpreter_enabled

    x = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    return x.tolist(), os.environ.get("NCCL_NVLS_ENABLE"), interpreter_enabled(), torch.cuda.current_device()


def launch_raise_on(rank, world_size, bad_rank, message):
    """Rank ``bad_rank`` raises ValueError(message); the others return their rank."""
    if rank == bad_rank:
        raise ValueError(message)
    return rank


def launch_sleep(rank, world_size, seconds):
    time.sleep(seconds)
    return rank


def launch_return_tensors(rank, world_size, n):
    """Return ``n`` small CPU tensors (a picklable value, as launch documents)."""
    return [torch.full((2,), float(rank * n + i)) for i in range(n)]


def descriptors_after_dropped_communicators(ctx, n: int) -> tuple[int, int]:
    """Open descriptors of this process before and after ``n`` communicators made, used once and dropped
    without ``close()``."""
    import gc
    import os

    def count():
        gc.collect()
        return len(os.listdir(f"/proc/{os.getpid()}/fd"))
    before = count()
    for _ in range(n):
        comm = tpcomm.Communicator()
        comm.all_reduce(torch.ones(8))
        del comm
    return before, count()


def launch_die_or_catch(rank, world_size, timeout_s):
    """The last rank exits (``os._exit(3)``) after the communicator's set-up; every other rank's
    all-reduce then raises ``PeerTimeoutError``, which it catches and returns."""
    comm = tpcomm.Communicator(timeout_s=timeout_s)
    dist.barrier()
    if rank == world_size - 1:
        os._exit(3)
    try:
        comm.all_reduce(torch.ones(4, 16, dtype=torch.bfloat16))
    except tpcomm.PeerTimeoutError as e:
        return e
    finally:
        comm.close()
    return "no error"
