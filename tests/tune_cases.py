"""Rank bodies of ``tests/test_tune.py``: ``tpcomm tune``'s sweep (eager mode) on pool ranks, and a
communicator made with ``TPCOMM_DISPATCH_TABLE`` pointing at a table the tune wrote."""

from __future__ import annotations

import torch
from harness import new_communicator

from tpcomm.tune.config import TuneConfig
from tpcomm.tune.rank import measure


def tiny_sweep(ctx, cfg: TuneConfig) -> dict:
    """The sweep of ``cfg`` on this rank in eager mode; graph mode must be refused on CPU ranks first
    (before anything collective)."""
    comm = ctx.comm()
    try:
        measure(comm, cfg, graph=True)
        refused = None
    except ValueError as e:
        refused = str(e)
    result = measure(comm, cfg, graph=False, show_progress=False)
    result["graph_refused"] = refused
    return result


def plans_with_table(ctx, path: str, probes: list) -> list:
    """A new communicator with ``TPCOMM_DISPATCH_TABLE=path``: the algorithm it plans for each
    ``(op, nbytes, hidden)`` of ``probes`` (bf16), and the table it loaded (as JSON)."""
    comm = new_communicator(env={"TPCOMM_DISPATCH_TABLE": path})
    try:
        plans = [comm.plan(op, n, h, torch.bfloat16).algorithm for op, n, h in probes]
        return [plans, comm.table.to_json()]
    finally:
        comm.close()
