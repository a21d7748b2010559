"""How long a sweep will take on the GPU machine, printed before it starts (``--estimate`` prints it and
exits; no GPU needed).

A model of the run, fitted to the ``--quick`` run on 2 H200s (``docs/data/bench-quick-2xH200.log``):
start-up (processes, NCCL, FlashInfer's workspaces), plus for each contender, shape and mode a fixed
cost (binding, the check on fresh inputs, capture, the agreement steps) and the timed replays, whose
number follows :func:`tpcomm.bench.config.replay_count`. A call is modelled as ``CALL_FLOOR_US`` plus
its bytes at ``CALL_GBPS``. It errs long: contenders that are not installed take no time.
"""

from __future__ import annotations

from . import contenders as contenders_mod
from .config import BenchConfig, calls_per_replay, message_bytes, replay_count, runs_shape

#: Seconds before the first measurement: spawning the ranks, imports, NCCL and the workspaces.
STARTUP_S = 35.0
#: Seconds of Triton compilation per op, hidden size and dtype that tpcomm runs first (one or two
#: kernels per algorithm the shapes reach).
COMPILE_S = 1.5
#: Fixed seconds per contender, shape and mode: bind, check (inputs of every rank, the reference),
#: capture and agreement for graph mode; eager mode reuses the bound contender.
FIXED_S = {"graph": 0.06, "eager": 0.015}
#: Host and line-up cost of one replay (the all-reduce, the GPU sleep of ~100 µs, the event wait), ms.
REPLAY_OVERHEAD_MS = 0.25
#: A call: a latency floor and the message at a bus rate (µs, GB/s), roughly NCCL's on 2 H200s.
CALL_FLOOR_US = 15.0
CALL_GBPS = 250.0


def _call_us(nbytes: int) -> float:
    return CALL_FLOOR_US + nbytes / (CALL_GBPS * 1e3)


def estimate_seconds(cfg: BenchConfig) -> float:
    """Seconds of device time the sweep of ``cfg`` is expected to take (every contender installed)."""
    cs = contenders_mod.make(cfg.contenders)
    total = STARTUP_S
    ops = ("copy",) + tuple(cfg.ops)
    tp_ops = [op for op in cfg.ops]
    total += COMPILE_S * len(tp_ops) * len(cfg.hiddens) * len(cfg.dtypes)
    for d in cfg.dtypes:
        for H in cfg.hiddens:
            for T in cfg.tokens:
                n = message_bytes(T, H, d)
                K = calls_per_replay(n, cfg)
                replay_ms = K * _call_us(n) / 1e3
                reps = replay_count(replay_ms, cfg) + max(1, cfg.warmup_replays)
                for op in ops:
                    if runs_shape(op, T, cfg.world_size):
                        continue
                    for c in cs:
                        if op not in c.ops:
                            continue
                        for mode in cfg.modes:
                            if mode in c.modes:
                                total += FIXED_S[mode] + reps * (replay_ms + REPLAY_OVERHEAD_MS) / 1e3
    return total
