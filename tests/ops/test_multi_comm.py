"""Several communicators in one process, used interleaved: a TP group and the world group, two TP
groups crossed with two data-parallel groups (4 CPU ranks), and two communicators on one group.

The 4-rank pool is started by this module only (a few seconds); the calls are single rows or a few
rows, so the interpreter's cost stays small.
"""

import pytest

from tests.ops import ranks
from tests.support.numerics import Checks

#: Steps of interleaved calls: every op of MULTI_STEPS on each communicator (4 steps cycle through
#: them), both call paths (ops on odd steps, methods on even ones), a delayed rank at each step.
STEPS = 6
#: Seconds one rank (a different one each step) sleeps before its calls.
SKEW_S = 0.05


@pytest.fixture
def pool4(pools):
    return pools.get(4)  # started once per session, restarted if a test killed it


@pytest.mark.parametrize("layout", ["tp_world", "tp_dp"])
def test_two_groups_interleaved(pool4, layout):
    """Each rank holds a TP communicator and a world (``tp_world``) or data-parallel (``tp_dp``) one; the
    two TP groups call them in opposite orders, one rank is delayed at every step; every result matches
    the contract on its own group's inputs, and the group ranks are those of the groups."""
    results = pool4.run(ranks.multi_comm_case, layout, STEPS, 2400, SKEW_S)
    half = pool4.world_size // 2
    check = Checks()
    for r, got in enumerate(results):
        bad = [(i, which) for i, which, ok in got["report"] if not ok]
        check.that(not bad, f"rank {r}: wrong results at (step, communicator) {bad}")
        check.that(len(got["report"]) == 2 * STEPS, f"rank {r}: {len(got['report'])} calls checked")
        other = (r, 4) if layout == "tp_world" else (r // half, 2)
        check.that(got["ranks"]["tp"] == (r % half, half, True), f"rank {r}: TP communicator {got['ranks']['tp']}")
        check.that(got["ranks"]["other"] == (*other, True), f"rank {r}: other communicator {got['ranks']['other']}")
        check.that(got["distinct_handles"], f"rank {r}: the two communicators share an ops handle")
    check.done()


def test_two_communicators_on_one_group(pool2):
    """Two communicators on the world group (one with a 256-byte workspace), alternating which goes
    first, through tpcomm.ops: every result matches the contract."""
    results = pool2.run(ranks.same_group_comms_case, 6, 2500)
    bad = [(r, i, which) for r, rep in enumerate(results) for i, which, ok in rep if not ok]
    assert not bad, f"wrong results at (rank, step, communicator): {bad}"
    assert all(len(rep) == 12 for rep in results)
