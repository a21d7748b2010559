"""Bandwidths, speed-ups and the share of copy bandwidth (pure arithmetic, no GPU).

With ``n`` the row's bytes (:func:`tpcomm.bench.config.message_bytes`), ``t`` the time of one call in
µs and ``W`` the world size, following nccl-tests:

    algbw = n / t                                       (GB/s, 1 GB = 1e9 bytes)
    busbw = algbw * 2 (W - 1) / W    all-reduce, fused, fused_fp8
    busbw = algbw * (W - 1) / W      all-gather, reduce-scatter
    busbw = algbw                    the peer copy

Bus bandwidth is what each GPU's links carry per second in a bandwidth-optimal algorithm, so it is
comparable across ops and world sizes; for two GPUs an all-reduce's busbw is ``n / t``.

Copy bandwidth (the reference of the bandwidth goals): every rank at once writes ``n`` bytes into the next rank's
memory (rank ``r`` into rank ``(r + 1) % W``, a peer-mapped symmetric buffer), timed like every other
contender; ``copy_bw = n / t_copy``, the faster of a copy-engine copy (``Tensor.copy_``) and an SM copy
(an elementwise kernel storing to the peer). ``% of copy bandwidth = 100 * busbw / copy_bw`` at the
same ``n``: for two GPUs, ``100 * t_copy / t``. It is meaningful for large messages, where copy
bandwidth no longer depends on ``n`` (below a few MiB both numbers are latency).
"""

from __future__ import annotations

#: busbw / algbw for each op, as a function of the world size.
BUS_FACTOR = {
    "fused": lambda W: 2 * (W - 1) / W,
    "fused_fp8": lambda W: 2 * (W - 1) / W,
    "all_reduce": lambda W: 2 * (W - 1) / W,
    "all_gather": lambda W: (W - 1) / W,
    "reduce_scatter": lambda W: (W - 1) / W,
    "copy": lambda W: 1.0,
}


def algbw_gbps(nbytes: int, us: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes per second) of ``nbytes`` moved in ``us`` µs.

    Raises:
        ValueError: ``us`` is not positive.
    """
    if not us > 0:
        raise ValueError(f"algbw_gbps: us must be > 0, got {us}")
    return nbytes / (us * 1e-6) / 1e9


def busbw_gbps(op: str, nbytes: int, us: float, world_size: int) -> float:
    """Bus bandwidth in GB/s: :func:`algbw_gbps` times ``BUS_FACTOR[op](world_size)``.

    Raises:
        ValueError: ``op`` is not in :data:`BUS_FACTOR`, ``world_size`` < 1 or ``us`` <= 0.
    """
    if op not in BUS_FACTOR:
        raise ValueError(f"busbw_gbps: op must be one of {', '.join(BUS_FACTOR)}, got {op!r}")
    if world_size < 1:
        raise ValueError(f"busbw_gbps: world_size must be >= 1, got {world_size}")
    return algbw_gbps(nbytes, us) * BUS_FACTOR[op](world_size)


def speedup(other_us: float | None, ours_us: float | None) -> float | None:
    """How many times faster ours is: ``other_us / ours_us`` (> 1: ours is faster); None if either is
    missing."""
    if other_us is None or ours_us is None or not ours_us > 0:
        return None
    return other_us / ours_us


def copy_percent(busbw: float | None, copy_bw: float | None) -> float | None:
    """``100 * busbw / copy_bw`` (the module docstring); None if either is missing."""
    if busbw is None or copy_bw is None or not copy_bw > 0:
        return None
    return 100.0 * busbw / copy_bw
