"""Rank bodies of ``tests/support/test_harness.py``: a body that raises and one that sleeps, to check
that the pool fails or times out a call instead of hanging.
"""

from __future__ import annotations

import time


# -- harness self-checks ----------------------------------------------------------------------------------
def raise_on_every_rank(ctx, message):
    raise ValueError(f"{message} on rank {ctx.rank}")


def sleep_on_rank(ctx, rank, seconds):
    if ctx.rank == rank:
        time.sleep(seconds)
    return ctx.rank
