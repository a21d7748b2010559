"""Timing on one rank: agreement between ranks, CUDA-graph capture, timed replays (GPU only).

Method (docs/performance.md):

* **Graph mode.** A contender's ``K`` calls (call ``k`` reads input set ``k``) are warmed up eagerly on a
  side stream, then captured in one CUDA graph. Before every replay the input sets are refilled
  (untimed), a one-element NCCL all-reduce lines the ranks up (it ends at about the same moment on
  every GPU) and a GPU sleep of about 100 µs lets every host enqueue the replay before any starts;
  CUDA events around the replay give µs per call = elapsed / ``K``.
* **Eager mode.** The same, with the ``K`` calls issued one after another from Python instead of a graph
  replay and no sleep: the host synchronises after the line-up all-reduce, so the events measure from
  the moment the host starts issuing, host overhead (Python, argument checks, launches) included.
* ``warmup_replays`` replays are dropped; the number of timed replays follows the slowest rank's last
  warm-up replay (:func:`tpcomm.bench.config.replay_count`), the same on every rank.
* The parent takes, for each replay, the slowest rank's time and reports the median over replays
  (:mod:`tpcomm.bench.summary`).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from .config import BenchConfig, replay_count

#: GPU cycles slept between the line-up all-reduce and a graph replay (~100 µs at 2 GHz): longer than a
#: host needs to record an event and launch a graph (~10-20 µs), so every rank's replay is queued before
#: any starts.
SYNC_SLEEP_CYCLES = 200_000


def device() -> torch.device:
    """Where this rank's tensors live: its GPU under NCCL, else the CPU (gloo ranks, which run the eager
    mode only: the logic of a sweep can be exercised without GPUs)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync() -> None:
    """Wait for this rank's GPU work (nothing to wait for on the CPU)."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def agree(error: str | None) -> str | None:
    """Collective: None when no rank has an error, else the first rank's (so every rank skips together).

    One small all-reduce when all is well; the messages travel (``all_gather_object``) only on failure.
    """
    flag = torch.tensor([1 if error else 0], dtype=torch.int32, device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()) == 0:
        return None
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next(f"rank {q}: {e}" for q, e in enumerate(errors) if e)


def agreed_max(value: float) -> float:
    """Collective: the largest ``value`` over the ranks."""
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def describe(e: BaseException) -> str:
    """``Type: message`` on one line, at most 300 characters."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def capture(call: Callable[[int], object], calls: int):
    """Warm ``call(k)`` up eagerly on a side stream (NCCL set-up, compilation), then capture
    ``call(0) ... call(calls - 1)`` in one CUDA graph. Returns ``(graph, [outputs of each call])``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for k in range(min(calls, 2)):
            call(k)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [call(k) for k in range(calls)]
    torch.cuda.synchronize()
    return g, outs


def time_replays(run: Callable[[], None], refill: Callable[[], None], calls: int, cfg: BenchConfig,
                 graph: bool) -> list[float]:
    """µs per call of each timed replay of ``run`` (``calls`` calls) on this rank. Collective: every rank
    runs the same replays together.

    Args:
        run: one replay (``graph.replay`` or the eager loop).
        refill: restores every input set before a replay (untimed).
        calls: calls per replay.
        graph: True: sleep on the GPU after the line-up so the replay is queued before it starts;
            False (eager): synchronise the host instead, so host overhead is timed.
    """
    dev = device()
    line_up = torch.zeros(1, device=dev)
    if dev.type == "cpu":  # gloo ranks: eager only, host clock
        if graph:
            raise ValueError("time_replays: graph mode needs CUDA")

        def once() -> float:
            refill()
            dist.all_reduce(line_up)
            t0 = time.perf_counter()
            run()
            return (time.perf_counter() - t0) * 1e3
    else:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def once() -> float:
            refill()
            dist.all_reduce(line_up)
            if graph:
                torch.cuda._sleep(SYNC_SLEEP_CYCLES)
            else:
                torch.cuda.synchronize()
            start.record()
            run()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)  # ms

    last = 0.0
    for _ in range(max(1, cfg.warmup_replays)):
        last = once()
    n = replay_count(agreed_max(last), cfg)
    return [once() * 1000.0 / calls for _ in range(n)]
