"""Rank bodies of ``tests/test_soak.py``: the soak (``tpcomm/soak.py``) on pool ranks, with communicators
that work, that corrupt one result, or whose rank 1 skips one call (the soak must count a mismatch, a
hang, and go on after the hang)."""

from __future__ import annotations

import functools

import torch

from tpcomm import soak


class _Wrapped:
    """A Communicator whose ``method`` misbehaves on its kernel call ``at`` (0-based, counting the calls of
    ``method`` that run a kernel) on rank ``rank``: ``corrupt`` adds 1 to the result, ``skip`` returns a
    result without making the call. (Skipping a call that goes through ``torch.distributed`` would leave
    the peers' gloo collectives unmatched: a deadlock of the test harness, not of tpcomm.)"""

    def __init__(self, comm, method: str, at: int, rank: int, how: str):
        self._comm, self._method, self._at, self._rank, self._how = comm, method, at, rank, how
        self._count = 0

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name != self._method:
            return attr

        def call(x, *args, **kwargs):
            plan = self._comm.plan(name, x.numel() * x.element_size(), x.shape[-1], x.dtype)
            if plan.algorithm == "fallback":
                return attr(x, *args, **kwargs)
            i, self._count = self._count, self._count + 1
            if i != self._at or self._comm.rank != self._rank:
                return attr(x, *args, **kwargs)
            if self._how == "skip":
                return torch.zeros_like(x)
            return attr(x, *args, **kwargs) + 1
        return call


def _make_comms(cfg, method, at, rank, how):
    default, small = soak.default_make_comms(cfg)
    return [_Wrapped(default, method, at, rank, how), small]


def pool_soak(ctx, cfg_kwargs: dict, fault: tuple | None = None) -> dict:
    """``soak.soak_rank`` on this pool rank with ``soak.make_config("cpu", ...)``; ``fault`` is
    ``(method, at, rank, how)`` for the default communicator (see ``_Wrapped``), or None."""
    cfg = soak.make_config("cpu", ctx.world_size, **cfg_kwargs)
    make = functools.partial(_make_comms, method=fault[0], at=fault[1], rank=fault[2], how=fault[3]) if fault \
        else None
    return soak.soak_rank(ctx.rank, ctx.world_size, cfg, make_comms=make)
