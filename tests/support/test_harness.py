"""The test harness itself (``tests/support/harness.py``): a failing or hung call must fail its test with the
ranks' tracebacks and kill the pool, never hang the suite. Uses its own pools (the shared ones stay)."""

import time

import pytest

from tests.support import ranks
from tests.support.harness import PoolTimeout, RankError, RankPool


def test_rank_errors_carry_every_traceback_and_kill_the_pool():
    pool = RankPool(2)
    try:
        with pytest.raises(RankError) as info:
            pool.run(ranks.raise_on_every_rank, "planted-7")
        msg = str(info.value)
        assert all(f"planted-7 on rank {r}" in msg for r in (0, 1)) and "Traceback" in msg, msg
        assert not pool.alive and not any(p.is_alive() for p in pool._procs)
    finally:
        pool.kill()


#: A call timeout far below the planted sleep, so the test shows the kill, not the sleep.
CALL_TIMEOUT_S = 2.0


def test_a_hung_call_times_out_and_kills_the_pool():
    pool = RankPool(2)
    try:
        assert pool.run(ranks.sleep_on_rank, 1, 0.0) == [0, 1]
        t0 = time.monotonic()
        with pytest.raises(PoolTimeout, match=r"ranks \[1\] did not answer"):
            pool.run(ranks.sleep_on_rank, 1, 600.0, timeout_s=CALL_TIMEOUT_S)
        # 10 s: killing and joining the processes, beyond the timeout
        assert time.monotonic() - t0 < CALL_TIMEOUT_S + 10
        assert not pool.alive and not any(p.is_alive() for p in pool._procs)
    finally:
        pool.kill()
