"""Resource hygiene on CPU ranks: create/close cycles leak no file descriptors, shared memory or
memory, and ranks killed with SIGKILL leave nothing in /dev/shm. The GPU variant is
``tests/hygiene/test_gpu_hygiene.py``."""

import glob
import os

import pytest

from tests.hygiene import ranks
from tests.support.numerics import Checks
from tpcomm.launch import RankFailure, launch

#: Create/close cycles.
CYCLES = 50
#: Cycles that also make calls: one in ten (a call costs 10x a set-up under the interpreter).
CALL_EVERY = 10
#: max_bytes of the cycled communicators: 4 MiB, so each one's Lamport buffers (armed, so resident) hold
#: 16 MiB and a leaked workspace per cycle would add 800 MiB.
CYCLE_MAX_BYTES = 4 << 20
#: RSS growth allowed over the cycles: allocator and interpreter caches, far below one leaked workspace
#: per ten cycles (80 MiB).
RSS_SLACK = 32 << 20


def test_create_close_cycles_leak_nothing(pools):
    pool = pools.get(2)
    results = pool.run(ranks.pool_cycles, CYCLES, CALL_EVERY, CYCLE_MAX_BYTES)
    check = Checks()
    for r, res in enumerate(results):
        b, a = res["before"], res["after"]
        check.that(res["kernels"] and res["right"], f"rank {r}: calls fell back or were wrong: {res}")
        check.that(a["fds"] <= b["fds"], f"rank {r}: open fds {b['fds']} -> {a['fds']} over {CYCLES} cycles")
        check.that(a["maps"] == b["maps"], f"rank {r}: tpcomm shm mappings {b['maps']} -> {a['maps']}")
        check.that(res["files_while_open"] == 0 and a["files"] == 0,
                   f"rank {r}: tpcomm files in /dev/shm: {res['files_while_open']} while open, {a['files']} after")
        check.that(a["rss"] - b["rss"] <= RSS_SLACK,
                   f"rank {r}: RSS grew {(a['rss'] - b['rss']) / 2**20:.1f} MiB over {CYCLES} cycles")
    check.done()


def test_close_frees_the_workspace_without_the_cyclic_collector(pools):
    """close() drops the recorded repeats by reference counting: their code (whose namespace once held the
    function itself, a cycle) and with it the replays' views of the workspace are freed at once, not at
    the next gc pass."""
    for r, res in enumerate(pools.get(2).run(ranks.close_without_gc_case)):
        assert res["recorded"] == 2 and res["alive"] == 0, f"rank {r}: {res}"


def _files_of(pids) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") for p in pids if n.startswith(f"tpcomm-{p}-"))


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Both ranks SIGKILLed: first after using a communicator, then inside a second one's set-up. Yields
    the pids, what launch raised and the files the second set-up had created; removes those files."""
    d = tmp_path_factory.mktemp("killed")
    before = set(os.listdir("/dev/shm"))  # a file of an earlier run whose pid the ranks reuse is not theirs
    with pytest.raises(RankFailure) as info:
        launch(ranks.launch_die_after_and_during_setup, 2, "cpu", args=(str(d),), timeout_s=120)
    pids = [int(open(p).read()) for p in sorted(glob.glob(str(d / "rank*.pid")))]
    in_setup = [ln for p in sorted(glob.glob(str(d / "rank*.setup"))) for ln in open(p).read().split()]
    yield {"pids": pids, "error": str(info.value), "in_setup": in_setup, "before": before}
    for path in in_setup:  # whatever the outcome, leave /dev/shm clean
        if os.path.exists(path):
            os.unlink(path)


def test_ranks_killed_after_set_up_leave_nothing(killed):
    """No tpcomm file of a killed rank is left, other than the ones its unfinished set-up had created."""
    check = Checks()
    check.that(len(killed["pids"]) == 2, f"ranks that started: {killed['pids']}")
    check.that("did not finish" in killed["error"], f"launch said: {killed['error']}")
    setup = {os.path.basename(p) for p in killed["in_setup"]}
    left = [n for n in _files_of(killed["pids"]) if n not in setup and n not in killed["before"]]
    check.that(left == [], f"left in /dev/shm: {left}")
    check.done()


def test_a_rank_killed_during_set_up_leaves_nothing(killed):
    """A rank killed between creating its shared-memory file and the end of set-up: nothing left."""
    check = Checks()
    check.that(killed["in_setup"] != [], "no rank reached the set-up step the test kills it in")
    left = [p for p in killed["in_setup"] if os.path.exists(p)]
    check.that(left == [], f"left in /dev/shm by set-ups that were killed: {left}")
    check.done()


#: Fail-close-create cycles (a mismatch or a peer timeout each), and the timeout of those that time out.
FAIL_CYCLES = 20
FAIL_TIMEOUT_S = 0.3


def test_fail_close_create_cycles_leak_nothing(pools):
    """After a failure, ``close()`` on every rank and a new communicator on the same group works, 20 times
    in a row (mismatches and peer timeouts alternating), leaving no file descriptor, shared memory or
    memory behind."""
    results = pools.get(2).run(ranks.fail_close_create_cycles, FAIL_CYCLES, FAIL_TIMEOUT_S)
    check = Checks()
    for r, res in enumerate(results):
        b, a = res["before"], res["after"]
        expected = ["PeerMismatchError" if i % 2 == 0 else ("PeerTimeoutError" if r == 0 else "none")
                    for i in range(FAIL_CYCLES)]
        check.that(res["seen"] == expected, f"rank {r}: raised {res['seen']}, expected {expected}")
        check.that(res["right"], f"rank {r}: a call on a new communicator after a failure was wrong")
        check.that(a["fds"] <= b["fds"], f"rank {r}: open fds {b['fds']} -> {a['fds']}")
        check.that(a["maps"] == b["maps"], f"rank {r}: tpcomm shm mappings {b['maps']} -> {a['maps']}")
        check.that(a["files"] == 0, f"rank {r}: {a['files']} tpcomm files left in /dev/shm")
        check.that(a["rss"] - b["rss"] <= RSS_SLACK, f"rank {r}: RSS grew {(a['rss'] - b['rss']) / 2**20:.1f} MiB")
    check.done()
