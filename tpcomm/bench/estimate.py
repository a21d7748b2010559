"""How long a sweep will take on the GPUs, printed before it starts (``--estimate`` prints it and
exits; no GPU needed).

A model of the run, fitted to the per-phase seconds that every JSON holds (``phases_s``), from the
2-H200 runs of ``tpcomm bench --quick`` and of a sweep at hidden 8192:

* start-up (processes, imports, NCCL, the FlashInfer and symmetric-memory workspaces) and the plots;
* tpcomm's Triton compilations, at the first call of each op, algorithm, hidden size and dtype (counted
  once per hidden size and dtype: the kernels may share them, so this errs long);
* per contender and shape: the check on fresh inputs, the capture and the re-check after timing (a fixed
  part and a part per byte of the message);
* the replays, whose count follows :func:`tpcomm.bench.config.replay_count`: a graph replay is ``K``
  calls of ``CALL_FLOOR_US`` plus the message at ``CALL_GBPS``, plus the line-up; an eager replay is
  ``K`` calls of at least ``EAGER_HOST_US`` (host overhead) each.

It assumes every contender is installed; each one missing saves its share.
"""

from __future__ import annotations

from . import contenders as contenders_mod
from .config import BenchConfig, calls_per_replay, message_bytes, replay_count, runs_shape

#: Start-up and wrap-up seconds outside the contenders' turns (measured: 9 s of the quick run's 24 s,
#: its 10 one-panel plots included), and seconds per plot panel (one per op, mode, dtype and hidden size).
STARTUP_S = 8.0
PANEL_S = 0.1
#: The per-phase fit below explains the turns of the two runs to within 15% (H=8192: 0.95-1.08x of the
#: measured turns; quick: 0.87x): the modelled turns are scaled by this margin.
MARGIN = 1.15
#: tpcomm's compilations per hidden size and dtype, seconds (measured in the quick run at H=6144 bf16:
#: 6.4 s in all, of which the FP8 epilogue's variants 3.5 s and the fused ones 1.8 s).
COMPILE_S = {"fused": 1.8, "fused_fp8": 3.5, "all_reduce": 0.6, "all_gather": 0.2, "reduce_scatter": 0.3}
#: Check + capture + re-check per contender and shape: seconds, and seconds per byte of the message
#: (measured: ~0.01 s at 4 MiB, ~0.05 s at 256 MiB).
FIXED_S, FIXED_S_PER_BYTE = 0.01, 1.6e-10
#: A call on the GPU: a latency floor and the message at a bus rate (µs, GB/s); NCCL's all-reduce is
#: 13 µs at 0.2 MiB and 0.9 ms at 256 MiB on 2 H200s, the unfused FP8 path 2.9 ms.
CALL_FLOOR_US = 10.0
CALL_GBPS = 200.0
#: Host time of an eager call: tpcomm ~150 µs, NCCL + torch epilogue ~85, FlashInfer TRT-LLM ~22.
EAGER_HOST_US = 80.0
#: Refill, line-up all-reduce, GPU sleep (graph) or host synchronisation (eager), event wait, ms.
REPLAY_OVERHEAD_MS = {"graph": 0.45, "eager": 0.3}


def _call_us(nbytes: int) -> float:
    return CALL_FLOOR_US + nbytes / (CALL_GBPS * 1e3)


def item_seconds(nbytes: int, mode: str, cfg: BenchConfig) -> float:
    """Seconds one contender spends on one shape in ``mode`` (fixed part excluded)."""
    K = calls_per_replay(nbytes, cfg)
    per_call = _call_us(nbytes) if mode == "graph" else max(_call_us(nbytes), EAGER_HOST_US)
    replay_ms = K * per_call / 1e3
    reps = replay_count(replay_ms, cfg) + max(1, cfg.warmup_replays)
    return reps * (replay_ms + REPLAY_OVERHEAD_MS[mode]) / 1e3


def estimate_seconds(cfg: BenchConfig) -> float:
    """Seconds of device time the sweep of ``cfg`` is expected to take (every contender installed)."""
    cs = contenders_mod.make(cfg.contenders)
    panels = len(cfg.ops) * len(cfg.modes) * len(cfg.hiddens) * len(cfg.dtypes)
    fixed = STARTUP_S + PANEL_S * panels
    fixed += sum(COMPILE_S[op] for op in cfg.ops) * len(cfg.hiddens) * len(cfg.dtypes)
    total = 0.0
    for d in cfg.dtypes:
        for H in cfg.hiddens:
            for T in cfg.tokens:
                n = message_bytes(T, H, d)
                for op in ("copy",) + tuple(cfg.ops):
                    if runs_shape(op, T, cfg.world_size):
                        continue
                    for c in cs:
                        if op in c.ops:
                            total += FIXED_S + FIXED_S_PER_BYTE * n
                            total += sum(item_seconds(n, m, cfg) for m in cfg.modes if m in c.modes)
    return fixed + MARGIN * total
