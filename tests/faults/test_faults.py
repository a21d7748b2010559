"""Fault injection on 2 CPU ranks ("no silent hang"): a peer that skips a call, calls another
op, or calls with another size (fewer rows, more rows, more rows on the same grid), dtype or FP8 format
or group size. Every rank
that makes a call its peer does not match must raise :class:`tpcomm.PeerTimeoutError` (or its subclass
:class:`tpcomm.PeerMismatchError`) naming the op, the epoch and the missing rank, within the timeout and a
margin; never return (a returned value is a silent wrong answer, or a right one by luck). Afterwards the
communicator keeps raising (it is unusable: docs/reliability.md) and a new one works.

The rank bodies are in ``tests/faults/ranks.py``; all runs go through one pool call (module fixture).
"""

import pytest

from tests.faults import ranks as cases
from tests.support.numerics import Checks
from tpcomm import dispatch

#: Kernel timeout of the faulty calls: short, so that the whole file takes seconds. The faults of
#: ``test_fault_raises...`` wait for no peer that is merely slow (both ranks make a call together
#: first); ``test_every_rank_fails_the_same_call`` allows for a slow start where it could matter.
TIMEOUT_S = 0.5
#: Margin on top of TIMEOUT_S for the call's own work and a busy 2-core machine (a call of a few rows
#: takes 0.1-0.3 s under the interpreter).
MARGIN_S = 4.0

ALGOS = list(dispatch.ALGORITHMS)
#: (fault, algorithm) pairs that do not raise on every rank yet, with why (none: Lamport carries the call
#: signature in per-program call tags since they were found here).
NOT_YET: dict = {}
RUNS = ([(f, a) for f in cases.FAULTS if f not in cases.GATHER_FAULTS for a in ALGOS]
        + [(f, None) for f in cases.GATHER_FAULTS])


def _param(fault, algo):
    marks = ()
    if (fault, algo) in NOT_YET:
        marks = pytest.mark.xfail(strict=True, reason=NOT_YET[(fault, algo)])
    return pytest.param(fault, algo, id=f"{fault}[{algo or 'auto'}]", marks=marks)


@pytest.fixture(scope="module")
def faults(pools):
    """Per rank: ``{"fault[algo]": what it saw}`` from one pool call running every fault."""
    return pools.get(2).run(cases.fault_batch, RUNS, TIMEOUT_S, timeout_s=300)


@pytest.mark.parametrize("fault,algo", [_param(f, a) for f, a in RUNS])
def test_fault_raises_the_named_error_on_every_waiting_rank(faults, fault, algo):
    check = Checks()
    expected = cases.expected_errors(fault)
    for r, (op, call, peer) in expected.items():
        res = faults[r][f"{fault}[{algo}]"]
        seen = res["seen"]
        check.that(not res["warm"], f"rank {r}: the call both ranks made first was wrong: {res['warm']}")
        for ret in res["returned"]:
            check.that(False, f"rank {r}: {ret}")
        if seen is None:
            check.that(False, f"rank {r}: raised nothing")
            continue
        epoch = res["epoch"] + call
        check.that(seen["type"] in ("PeerTimeoutError", "PeerMismatchError") and "peer" in seen,
                   f"rank {r}: raised {seen['type']}: {seen['message']}")
        if "peer" in seen:
            check.that((seen["op"], seen["epoch"], seen["peer"], seen["rank"]) == (op, epoch, peer, r),
                       f"rank {r}: error says op={seen['op']!r} epoch={seen['epoch']} peer={seen['peer']} "
                       f"rank={seen['rank']}; expected op={op!r} epoch={epoch} peer={peer} rank={r}")
            msg = seen["message"]
            for word in (op, f"epoch {epoch}", f"rank {peer}"):
                check.that(word in msg, f"rank {r}: the message does not say {word!r}: {msg}")
        check.that(res["elapsed"] < TIMEOUT_S + MARGIN_S,
                   f"rank {r}: took {res['elapsed']:.2f} s to raise (timeout {TIMEOUT_S} s)")
        for name, what in (("again", "call"), ("again_empty", "empty call"), ("again_fallback", "fallback call")):
            again = res.get(name)
            check.that(again is not None and again["isinstance"] and again["seconds"] < MARGIN_S,
                       f"rank {r}: the next {what} on the same communicator raised {again}; expected "
                       "PeerTimeoutError at once (the communicator is unusable)")
        check.that("failed" in res.get("repr", ""), f"rank {r}: repr after the failure: {res.get('repr')!r}")
    check.done()


def test_a_new_communicator_works_after_the_faults(faults):
    """The documented remedy: after every fault above, a new communicator on the same ranks is right."""
    check = Checks()
    for r, res in enumerate(faults):
        check.that(not res["after"], f"rank {r}: a new communicator's fused call: {res['after']}")
    check.done()


def test_expected_errors_cover_every_rank_that_calls():
    """The table of faults: rank 0 always calls; rank 1 calls unless it skips."""
    for fault, (calls0, calls1) in cases.FAULTS.items():
        assert calls0, fault
        assert set(cases.expected_errors(fault)) == ({0, 1} if calls1 else {0}), fault


#: The timing and algorithm faults (``cases.ORDER_FAULTS``) per world size: the late rank under
#: each kernel; another algorithm once (the call forces it).
ORDER_RUNS = {w: [(f, a) for f in cases.ORDER_FAULTS[w] if f != "other algorithm" for a in ALGOS]
              + [("other algorithm", None)] for w in (2, 3)}


@pytest.fixture(scope="module")
def order_faults(pools):
    """``{world: per rank {"fault[algo]": what it saw}}``, one pool call per world size, both at once
    (their late ranks mostly sleep)."""
    tickets = {w: pools.get(w).submit(cases.fault_batch, ORDER_RUNS[w], TIMEOUT_S) for w in (2, 3)}
    return {w: pools.get(w).collect(t, timeout_s=300) for w, t in tickets.items()}


@pytest.mark.parametrize("world,fault,algo", [pytest.param(w, f, a, id=f"{w}ranks-{f}[{a or 'auto'}]")
                                              for w in (2, 3) for f, a in ORDER_RUNS[w]])
def test_every_rank_fails_the_same_call(order_faults, world, fault, algo):
    """A rank that arrives after its peers gave up on it (late, or late after skipping a call) fails the
    same call, at the same epoch, with PeerAbortedError naming a rank that gave up; those raise
    PeerTimeoutError naming it. Ranks running different algorithms all time out. No rank returns a
    value for that call (docs/reliability.md, "What each rank sees")."""
    check = Checks()
    for r, (kinds, op, call, peer) in cases.EXPECTED[world][fault].items():
        res = order_faults[world][r][f"{fault}[{algo}]"]
        seen = res["seen"]
        check.that(not res["warm"], f"rank {r}: the call every rank made first was wrong: {res['warm']}")
        for ret in res["returned"]:
            check.that(False, f"rank {r}: {ret}")
        if seen is None or "peer" not in seen:
            check.that(False, f"rank {r}: raised {seen}")
            continue
        got = (seen["op"], seen["epoch"], seen["rank"])
        want = (op, res["epoch"] + call, r)
        check.that(seen["type"] in kinds and got == want,
                   f"rank {r}: {seen['type']} (op, epoch, rank) {got}, expected one of {kinds} {want}: "
                   f"{seen['message']}")
        check.that(seen["peer"] != r and (peer is None or seen["peer"] == peer),
                   f"rank {r}: names rank {seen['peer']} at fault, expected {peer}: {seen['message']}")
        check.that(res["elapsed"] < TIMEOUT_S + MARGIN_S,
                   f"rank {r}: took {res['elapsed']:.2f} s to raise (timeout {TIMEOUT_S} s)")
    for r, ranks in enumerate(order_faults[world]):
        check.that(not ranks["after"], f"rank {r}: a new communicator's fused call: {ranks['after']}")
    check.done()


@pytest.mark.parametrize("world", [2, 3])
def test_a_killed_rank_is_named_by_every_survivor(tmp_path, world):
    """The last rank is killed after a call every rank made; every other rank's next call raises
    PeerTimeoutError naming it, at the next epoch, within the timeout, the grace and a margin
    (docs/reliability.md, "What each rank sees")."""
    import json

    from tpcomm.launch import RankFailure, launch

    with pytest.raises(RankFailure):
        launch(cases.killed_rank, world, "cpu", args=(str(tmp_path), TIMEOUT_S), timeout_s=240)
    check = Checks()
    for r in range(world - 1):
        path = tmp_path / f"rank{r}.json"
        if not path.exists():
            check.that(False, f"rank {r}: wrote no result")
            continue
        seen = json.loads(path.read_text())
        check.that(seen["warm"], f"rank {r}: the call every rank made first was wrong")
        got = (seen["type"], seen.get("op"), seen.get("epoch"), seen.get("peer"), seen.get("rank"))
        want = ("PeerTimeoutError", "all_reduce", seen["epoch_before"], world - 1, r)
        check.that(got == want, f"rank {r}: (type, op, epoch, peer, rank) {got}, expected {want}: "
                                f"{seen.get('message')}")
        check.that(seen["seconds"] < 2 * TIMEOUT_S + MARGIN_S,
                   f"rank {r}: took {seen['seconds']:.2f} s to raise (timeout {TIMEOUT_S} s and its grace)")
    check.done()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["forced", "wide"])
def test_a_rank_that_falls_back_alone_fails_the_call_on_every_rank(pools, world, mode):
    """One rank's call falls back to torch.distributed (forced there, or a row wider than max_bytes there
    only) while its peers run kernels: every rank raises (the fallback rank in the all-gather launch that
    precedes every fallback call of a communicator with kernels), none returns, and after close() a new
    communicator on the same process group is right (no collective was left to pair with its set-up)."""
    results = pools.get(world).run(cases.fallback_on_one_rank_case, mode, TIMEOUT_S)
    check = Checks()
    for r, res in enumerate(results):
        check.that(res["seen"].startswith("Peer") and res["seen"].endswith(" fused_add_rmsnorm"),
                   f"rank {r}: the call {res['seen']}; expected a PeerTimeoutError naming fused_add_rmsnorm")
        check.that(res["after"], f"rank {r}: the new communicator's all-reduce is wrong")
    check.done()
