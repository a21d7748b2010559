"""Rank bodies of the resource-hygiene tests (``tests/hygiene/test_hygiene.py`` on CPU ranks,
``tests/hygiene/test_gpu_hygiene.py`` on 2 GPUs): create/use/close cycles of a Communicator, measuring what a
leak would grow, and ranks that die after set-up."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import tpcomm


def open_fds() -> int:
    """File descriptors open in this process."""
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def shm_maps() -> int:
    """Mappings of tpcomm shared-memory files in this process (the anonymous ``/memfd:tpcomm-...``, or
    unlinked files, listed as ``/dev/shm/tpcomm-... (deleted)``), which stay mapped until the last tensor
    on them is freed."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/tpcomm-" in ln or "/memfd:tpcomm-" in ln for ln in f)


def shm_files_of_this_process() -> list[str]:
    prefix = f"tpcomm-{os.getpid()}-"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def _snapshot(device: torch.device) -> dict:
    import gc

    gc.collect()
    snap = {"fds": open_fds(), "rss": rss_bytes(), "maps": shm_maps(), "files": len(shm_files_of_this_process())}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        snap.update(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
                    device_used=total - free)
    return snap


def create_close_cycles(rank: int, world_size: int, cycles: int, device: torch.device, max_bytes=None,
                        call_every: int = 1) -> dict:
    """``cycles`` times: create a Communicator, make one fused call and one all_reduce (every
    ``call_every``-th cycle: calls cost far more than set-up under the CPU interpreter), close it.
    Returns snapshots (fds, RSS, shm mappings and files; on CUDA memory allocated, reserved and used on
    the device) after a first warm-up cycle and after the last, plus the largest number of tpcomm files
    seen while a communicator was open, and whether every call was right."""
    def cycle(calls: bool):
        with tpcomm.Communicator(max_bytes=max_bytes) as comm:
            files = len(shm_files_of_this_process())
            uses = comm.uses_kernels
            if not calls:
                return files, True, uses
            x = torch.full((3, 64), float(rank + 1), dtype=torch.bfloat16, device=device)
            out, ro = comm.fused_add_rmsnorm(x, x, torch.ones(64, dtype=torch.bfloat16, device=device))
            y = comm.all_reduce(x)
            total = float(sum(range(1, world_size + 1)))
            right = bool((y == total).all()) and bool((ro == total + rank + 1).all())
        return files, right, uses

    cycle(True)  # the first communicator compiles kernels, starts threads and fills allocator caches
    dist.barrier()
    before = _snapshot(device)
    files_open, all_right, kernels = 0, True, True
    t0 = time.perf_counter()
    for i in range(cycles):
        files, right, uses = cycle(i % call_every == call_every - 1)
        files_open = max(files_open, files)
        all_right &= right
        kernels &= uses
    seconds = time.perf_counter() - t0
    dist.barrier()
    after = _snapshot(device)
    return {"before": before, "after": after, "files_while_open": files_open, "right": all_right,
            "kernels": kernels, "seconds": seconds}


def close_without_gc_case(ctx) -> dict:
    """With Python's cyclic collector off: a communicator makes the same calls twice (the second are
    repeats of recorded launches, whose replays hold views of the workspace), then closes. Whether each
    repeat's code (:mod:`tpcomm.hit_code`) is gone right after close(), by reference counting alone: it
    holds the replays, and through them the workspace. (The mappings themselves cannot be counted here:
    Triton's interpreter keeps each launch's argument storages in a reference cycle of its own until
    the next gc pass; GPU launches do not go through it.)"""
    import gc
    import weakref

    x = torch.ones(3, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    gc.collect()
    gc.disable()
    try:
        comm = tpcomm.Communicator(max_bytes=1 << 16)
        for _ in range(2):
            comm.all_reduce(x)
            comm.fused_add_rmsnorm(x, x, w)
        codes = [weakref.ref(entry.hit) for entry in comm._calls._entries.values()]
        comm.close()
        alive = sum(ref() is not None for ref in codes)
    finally:
        gc.enable()
    return {"recorded": len(codes), "alive": alive}


def pool_cycles(ctx, cycles: int, call_every: int, max_bytes=None) -> dict:
    return create_close_cycles(ctx.rank, ctx.world_size, cycles, torch.device("cpu"), max_bytes, call_every)


def gpu_cycles(rank: int, world_size: int, cycles: int) -> dict:
    return create_close_cycles(rank, world_size, cycles, torch.device("cuda", torch.cuda.current_device()))


def launch_die(rank: int, world_size: int, pid_dir: str, how: str, dying: list[int]) -> int:
    """Write this rank's pid to ``pid_dir``, create a Communicator and make one call, then the ranks in
    ``dying`` die: ``sigkill`` (``SIGKILL`` to itself: no handler, no atexit) or ``exit``
    (``os._exit``); the others wait at a barrier that fails once a peer is gone, or return."""
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    comm = tpcomm.Communicator(timeout_s=1.0)
    comm.all_reduce(torch.ones(4, 16))
    if rank in dying:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(9)
    comm.close()
    return rank


def launch_die_after_and_during_setup(rank: int, world_size: int, pid_dir: str) -> int:
    """Both ranks: write the pid to ``pid_dir``, set up a Communicator and use it (its files are unlinked
    once every rank has mapped them), then start a second one and die by ``SIGKILL`` inside its set-up,
    right after this rank's shared-memory file was created and mapped (``Workspace._arm``), writing that
    file's path to ``rank<r>.setup`` first."""
    from tpcomm import workspace

    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    comm = tpcomm.Communicator(timeout_s=1.0)
    comm.all_reduce(torch.ones(4, 16))
    dist.barrier()

    def die(self, buffer):
        with open(os.path.join(pid_dir, f"rank{rank}.setup"), "w") as f:
            f.write("\n".join(self._shm_paths))
        os.kill(os.getpid(), signal.SIGKILL)

    workspace.Workspace._arm = die
    tpcomm.Communicator(timeout_s=1.0)
    return rank  # not reached


def fail_close_create_cycles(ctx, cycles: int, timeout_s: float) -> dict:
    """``cycles`` times: a new Communicator, one right call, then a failure, then ``close()`` on every rank.
    Even cycles fail by a mismatch (rank 1 calls ``all_reduce`` where rank 0 calls the fused op on the
    same tensor: both raise ``PeerMismatchError``); odd cycles by a skipped call (rank 1 skips, rank 0
    raises ``PeerTimeoutError`` after ``timeout_s``). Returns snapshots before and after (fds, RSS, shm
    mappings and files), what each cycle raised on this rank, and whether the right calls (one per cycle,
    and one on a last communicator) were right."""
    from tpcomm.errors import PeerMismatchError, PeerTimeoutError

    device = torch.device("cpu")
    rank, world = ctx.rank, ctx.world_size
    x = torch.full((2, 32), float(rank + 1), dtype=torch.bfloat16)
    w = torch.ones(32, dtype=torch.bfloat16)
    total = float(sum(range(1, world + 1)))

    def right_call(comm) -> bool:
        return bool((comm.all_reduce(x) == total).all())

    def cycle(i: int) -> tuple[str, bool]:
        comm = tpcomm.Communicator(timeout_s=timeout_s)
        try:
            ok = right_call(comm) and right_call(comm)  # recorded, then replayed
            seen = "none"
            try:
                if i % 2 == 0:
                    if rank == 1:
                        comm.all_reduce(x)
                    else:
                        comm.fused_add_rmsnorm(x, None, w)
                elif rank != 1:
                    comm.all_reduce(x)
                comm.check()
            except PeerMismatchError:
                seen = "PeerMismatchError"
            except PeerTimeoutError:
                seen = "PeerTimeoutError"
            dist.barrier()  # every rank has given up on the failed call
            return seen, ok
        finally:
            comm.close()

    cycle(0)
    cycle(1)  # warm-up: both failure kinds compiled once
    dist.barrier()
    before = _snapshot(device)
    seen, all_right = [], True
    for i in range(cycles):
        what, ok = cycle(i)
        seen.append(what)
        all_right &= ok
    dist.barrier()
    with tpcomm.Communicator() as last:
        all_right &= right_call(last)
    after = _snapshot(device)
    return {"before": before, "after": after, "seen": seen, "right": all_right}
