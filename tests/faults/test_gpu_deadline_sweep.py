"""A deadline sweep on ONE GPU: every op that waits, with one rank late by about the timeout.

Two loopback ranks (``tpcomm.loopback``) with a kernel timeout of 1 ms. Before each call, both ranks'
streams wait for a sleep on the current stream (long enough for the host to issue both calls), then rank 1's
stream sleeps ``n`` more (``torch.cuda._sleep``, cycles calibrated to nanoseconds once per run with CUDA
events), so rank 1's kernel starts about ``n`` after rank 0's. Per op, a bisection finds the delay at which
calls start to fail (about the timeout), then ``n`` sweeps that edge +-5 us in steps of 0.1 us, cycling over
three input sets (consecutive calls differ, on alternating parities). Each call (a trial) is judged by the
contract (docs/reliability.md, "What each rank sees"):

* ``bits``: no rank raised, and every rank's outputs are the plain-torch reference's bits;
* ``timeout/aborted``: rank 0 raised exactly ``PeerTimeoutError`` naming rank 1, and rank 1
  ``PeerAbortedError`` naming rank 0, both for the call's op and epoch (the late row of the table);

anything else (wrong bits without an error, one rank returning while the other raised, another error or
pairing) is a violation, and so is a trial that does not end: a watchdog (``faulthandler``) ends the process
with every thread's stack written beside the summary. After a failed call the group is closed and a new
one made (the documented recovery). Ops: the all-reduce under Lamport, one-shot and two-shot, the fused
norm, its FP8 per-token form, the full-width QK norm, the MoE finalize, all-gather and reduce-scatter (each
under the default dispatch, its plan recorded).

Also: a peer with another token count (16 rows against 32: grids of 16 and 32 programs), every op that
takes ``T``: ``PeerMismatchError`` on every rank, ending before any wait could run to its timeout (50 ms
here), never ``PeerTimeoutError``.

Environment: ``TPCOMM_SWEEP_OUT`` a path for the JSON summary (the GPU, trials, outcomes per op and per
1 us of offset from the edge, the first violations; written after each op); ``TPCOMM_SWEEP_S`` the seconds
the trials of all nine ops may take (default 150, an equal share each; compiling comes on top);
``TPCOMM_SWEEP_TRIALS`` trials per op (default 600). ``bash dev/gpu_runs.sh sweep`` runs it (the QK norm in
a process of its own, ``-k qk_rmsnorm``).

The judge (:func:`judge`, :func:`judge_mismatch`) and the summary run on the CPU too
(``test_the_judge_follows_the_contract``).

    python -m pytest -q -m gpu tests/faults/test_gpu_deadline_sweep.py
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import tempfile
import time
from collections import Counter, defaultdict

import pytest
import torch

from tests.support.numerics import Checks
from tpcomm.errors import PeerAbortedError, PeerMismatchError, PeerTimeoutError

WORLD = 2
#: The rank whose stream sleeps before its call.
LATE = 1
#: The sweep's kernel timeout: a trial costs about this plus the grace (an eighth) when it fails.
TIMEOUT_S = 1e-3
#: The mismatch case's timeout: long enough that a wait which runs to it shows in the call's time.
MISMATCH_TIMEOUT_S = 0.05
#: The timeout of the group that compiles and loads every kernel first. Triton specialises an integer
#: argument on its width and on divisibility by 16, so the timeouts in ns (1e9, 1e6, 5e7) all select the
#: same binaries: int32 multiples of 16.
WARM_TIMEOUT_S = 1.0
#: The sweep around the edge: +-SPAN_NS in steps of STEP_NS.
SPAN_NS, STEP_NS = 5_000, 100
#: Input sets cycled over the trials (3: consecutive calls differ, and a set meets both parities).
SETS = 3
#: The sleep that holds both ranks' streams while the host issues both calls: at least this, and four
#: times the longest first call on a new group (what follows every failed trial).
HOLD_NS_MIN = 2_000_000
#: A trial (issue, wait, checks) that takes longer than this has hung: the watchdog ends the process;
#: likewise an op's first calls (compiling its kernels) past WARM_BOUND_S.
TRIAL_BOUND_S, WARM_BOUND_S = 30.0, 300.0
#: Rows of the calls (decode-like: one program a row up to the grid cap), the peer's rows in the mismatch
#: case (another grid; a multiple of 16 like T, so that no kernel specialises anew) and the widths.
T, T_PEER, H = 16, 32, 2048
HQ, HK, K = 3072, 512, 8
EPS = 1e-6

SWEEP_OPS = ["all_reduce/lamport", "all_reduce/one_shot", "all_reduce/two_shot", "fused_add_rmsnorm",
             "fused_add_rmsnorm/fp8_per_token", "fused_qk_rmsnorm", "fused_moe_finalize_add_rmsnorm",
             "all_gather", "reduce_scatter"]
#: The ops that take a token count (the mismatch case).
T_OPS = SWEEP_OPS[:7]

BITS, FAILED, MISMATCH = "bits", "timeout/aborted", "mismatch"


# -- the judge (CPU and GPU) -------------------------------------------------------------------------------
def _name(e) -> str:
    return "returned" if e is None else type(e).__name__


def _detail(errors) -> str:
    return "; ".join(f"rank {r}: " + ("returned" if e is None else
                                      f"{type(e).__name__}(op={getattr(e, 'op', '?')}, peer={getattr(e, 'peer', '?')}, "
                                      f"epoch={getattr(e, 'epoch', '?')})")
                     for r, e in enumerate(errors))


def judge(op: str, errors: list, same: list, late: int = LATE) -> tuple[str, str]:
    """The outcome of one call of ``op`` in which rank ``late`` was late (docs/reliability.md, "What each
    rank sees"): ``(key, detail)``.

    Args:
        errors: per rank, the exception its call or ``check()`` raised, or None.
        same: per rank, whether its outputs are the reference's bits (read only where no rank raised).
    Returns:
        ``key`` is ``"bits"`` (no rank raised, every rank's bits right), ``"timeout/aborted"`` (every
        other rank raised exactly ``PeerTimeoutError`` naming ``late``, and ``late`` ``PeerAbortedError``
        naming another rank, all for ``op`` and one epoch), or ``"violation: ..."`` naming what each rank
        saw (without epochs, so that violations of one kind count together); ``detail`` adds the peers
        and epochs."""
    detail = _detail(errors)
    if all(e is None for e in errors):
        wrong = [r for r, s in enumerate(same) if not s]
        return (BITS, detail) if not wrong else (f"violation: wrong bits on rank(s) {wrong}, no error", detail)
    waiting = all(type(e) is PeerTimeoutError and e.peer == late for r, e in enumerate(errors) if r != late)
    aborted = type(errors[late]) is PeerAbortedError and errors[late].peer != late
    if waiting and aborted and all(e.op == op for e in errors) and len({e.epoch for e in errors}) == 1:
        return FAILED, detail
    return "violation: " + ", ".join(f"rank {r} {_name(e)}" for r, e in enumerate(errors)), detail


def judge_mismatch(op: str, errors: list, elapsed_s: float, timeout_s: float) -> tuple[str, str]:
    """The outcome of one call of ``op`` whose ranks passed different token counts: ``"mismatch"`` when
    every rank raised exactly ``PeerMismatchError`` for ``op`` and one epoch within ``timeout_s`` (no wait
    ran to its timeout), else ``"violation: ..."``; ``(key, detail)`` as :func:`judge`."""
    detail = _detail(errors) + f"; {elapsed_s * 1e3:.2f} ms"
    named = [_name(e) for e in errors]
    if not all(type(e) is PeerMismatchError and e.op == op for e in errors) or len({e.epoch for e in errors}) != 1:
        return "violation: " + ", ".join(f"rank {r} {n}" for r, n in enumerate(named)), detail
    if elapsed_s >= timeout_s:
        return "violation: PeerMismatchError only after a wait ran to its timeout", detail
    return MISMATCH, detail


class Tally:
    """Outcomes of one op's trials: counts per key, per offset from the edge rounded to 1 us, and the first
    few violations' details."""

    KEEP = 8

    def __init__(self):
        self.outcomes: Counter = Counter()
        self.by_offset: dict = defaultdict(Counter)
        self.examples: list = []
        self.extra: dict = {}

    def add(self, key: str, detail: str, offset_ns: float | None = None) -> None:
        self.outcomes[key] += 1
        if offset_ns is not None:
            self.by_offset[round(offset_ns / 1000)][key] += 1
        if key.startswith("violation") and len(self.examples) < self.KEEP:
            where = "" if offset_ns is None else f" (offset {offset_ns:+.0f} ns)"
            self.examples.append(f"{key}{where}: {detail}")

    @property
    def trials(self) -> int:
        return sum(self.outcomes.values())

    @property
    def violations(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k.startswith("violation"))

    def as_dict(self) -> dict:
        return {"trials": self.trials, "outcomes": dict(self.outcomes),
                "by_offset_us": [[us, dict(v)] for us, v in sorted(self.by_offset.items())],
                "violations": self.examples, **self.extra}


def write_summary(path: str | None, summary: dict) -> None:
    """``summary`` as JSON at ``path`` (nothing without one), with the total of trials."""
    if not path:
        return
    total = sum(t["trials"] for part in ("sweep", "mismatch") for t in summary.get(part, {}).values())
    with open(path, "w") as f:
        json.dump({**summary, "trials": total}, f, indent=1, sort_keys=True)


def test_the_judge_follows_the_contract(tmp_path):
    """Each outcome the contract allows, and the ones it does not, on exceptions made here (CPU): the
    late row's pairing only in that order, for one op and epoch; no mixed results; wrong bits without an
    error; a mismatch on every rank only, and only before the timeout; the summary's totals."""
    def timeout(peer, epoch=7, op="all_reduce"):
        return PeerTimeoutError(op, 1 - peer, peer, epoch, 0, TIMEOUT_S)

    def aborted(peer, epoch=7, op="all_reduce"):
        return PeerAbortedError(op, 1 - peer, peer, epoch, 0, TIMEOUT_S)

    def mismatch(peer, epoch=7, op="all_reduce"):
        return PeerMismatchError(op, 1 - peer, peer, epoch, 0, TIMEOUT_S)

    cases = {
        "bits": ([None, None], [True, True], BITS),
        "wrong bits on rank 1": ([None, None], [True, False], "violation: wrong bits on rank(s) [1], no error"),
        "the late row": ([timeout(1), aborted(0)], [None, None], FAILED),
        "the late row, reversed": ([aborted(1), timeout(0)], [None, None], "violation: rank 0 PeerAbortedError, "
                                                                            "rank 1 PeerTimeoutError"),
        "timeouts on both": ([timeout(1), timeout(0)], [None, None], "violation: rank 0 PeerTimeoutError, "
                                                                      "rank 1 PeerTimeoutError"),
        "a mismatch beside a timeout": ([mismatch(1), aborted(0)], [None, None],
                                        "violation: rank 0 PeerMismatchError, rank 1 PeerAbortedError"),
        "one rank returned": ([timeout(1), None], [None, True], "violation: rank 0 PeerTimeoutError, rank 1 returned"),
        "two epochs": ([timeout(1, epoch=7), aborted(0, epoch=8)], [None, None], "violation: rank 0 "
                       "PeerTimeoutError, rank 1 PeerAbortedError"),
        "another op": ([timeout(1, op="all_gather"), aborted(0)], [None, None], "violation: rank 0 "
                       "PeerTimeoutError, rank 1 PeerAbortedError"),
    }
    check = Checks()
    for name, (errors, same, want) in cases.items():
        got, detail = judge("all_reduce", errors, same)
        check.that(got == want, f"{name}: {got!r} ({detail}), expected {want!r}")
    for name, errors, elapsed, want in (
            ("every rank", [mismatch(1), mismatch(0)], 0.001, MISMATCH),
            ("after the timeout", [mismatch(1), mismatch(0)], 0.06, "violation: PeerMismatchError only after a "
                                                                    "wait ran to its timeout"),
            ("a timeout on one rank", [mismatch(1), timeout(0)], 0.001, "violation: rank 0 PeerMismatchError, "
                                                                        "rank 1 PeerTimeoutError"),
            ("one rank returned", [mismatch(1), None], 0.001, "violation: rank 0 PeerMismatchError, rank 1 returned")):
        got, detail = judge_mismatch("all_reduce", errors, elapsed, MISMATCH_TIMEOUT_S)
        check.that(got == want, f"mismatch, {name}: {got!r} ({detail}), expected {want!r}")
    tally = Tally()
    for key, offset in ((BITS, -4200), (BITS, -600), (FAILED, 700), ("violation: x", 4400)):
        tally.add(key, "d", offset)
    path = tmp_path / "sweep.json"
    write_summary(str(path), {"sweep": {"op": tally.as_dict()}, "mismatch": {"op": Tally().as_dict()}})
    got = json.loads(path.read_text())
    check.that(got["trials"] == 4 and got["sweep"]["op"]["outcomes"] == {BITS: 2, FAILED: 1, "violation: x": 1},
               f"summary: {got}")
    check.that(got["sweep"]["op"]["by_offset_us"] == [[-4, {BITS: 1}], [-1, {BITS: 1}], [1, {FAILED: 1}],
                                                     [4, {"violation: x": 1}]], f"by offset: {got}")
    check.that(tally.violations == 1 and got["sweep"]["op"]["violations"] == ["violation: x (offset +4400 ns): d"],
               f"violations: {got['sweep']['op']['violations']}")
    check.done()


# -- the calls and their references (GPU) ------------------------------------------------------------------
def _rand(g, rows, cols, scale=4.0):
    return (torch.randn(rows, cols, device=g.device, generator=g) * scale).to(torch.bfloat16)


def _weight(g, cols, dtype=torch.bfloat16):
    return (1 + 0.5 * torch.randn(cols, device=g.device, generator=g)).to(dtype)


def build(name: str, rows: list[int], seed: int, device: str = "cuda"):
    """The call of op ``name`` with rank ``r`` passing ``rows[r]`` tokens: ``(fn, expected)``, ``fn(rank)``
    making the call on a loopback rank and returning its outputs (a tuple), ``expected`` every rank's
    reference outputs (None where the ranks' token counts differ). What tensor parallelism shares (the
    residual, the norm weight, the MoE routing) is the same on every rank of the same token count."""
    import tpcomm
    from tpcomm import reference as R

    g = torch.Generator(device=device).manual_seed(seed)
    same = len(set(rows)) == 1
    xs = [_rand(g, n, H) for n in rows]  # every rank's own rows (the all-reduce's, the norm's x)
    shared = {n: (_rand(g, n, H, 1.0), _weight(g, H)) for n in sorted(set(rows))}  # residual, weight
    res, w = [shared[n][0] for n in rows], [shared[n][1] for n in rows]
    s = R.reduce_in_rank_order(xs) if same else None
    if name == "all_gather":
        return (lambda rank: (rank.all_gather(xs[rank.rank]),)), [(torch.cat(xs),)] * WORLD if same else None
    if name == "reduce_scatter":
        return ((lambda rank: (rank.reduce_scatter(xs[rank.rank]),)),
                [(share,) for share in torch.tensor_split(s, WORLD)] if same else None)
    if name.startswith("all_reduce"):
        return (lambda rank: (rank.all_reduce(xs[rank.rank]),)), [(s,)] * WORLD if same else None
    if name == "fused_add_rmsnorm":
        def fn(rank):
            return rank.fused_add_rmsnorm(xs[rank.rank], res[rank.rank], w[rank.rank], EPS)
        return fn, [R.add_rmsnorm_reference(s, res[0], w[0], EPS)] * WORLD if same else None
    if name == "fused_add_rmsnorm/fp8_per_token":  # returns (q, scales, residual_out, out)
        def fn(rank):
            return rank.fused_add_rmsnorm(xs[rank.rank], res[rank.rank], w[rank.rank], EPS, quant="fp8_per_token",
                                          emit_unquantized=True)
        if not same:
            return fn, None
        out, ro = R.add_rmsnorm_reference(s, res[0], w[0], EPS)
        return fn, [(*R.per_token_quant_reference(out, torch.float8_e4m3fn), ro, out)] * WORLD
    if name == "fused_qk_rmsnorm":
        qs, ks = [_rand(g, n, HQ) for n in rows], [_rand(g, n, HK) for n in rows]
        wq, wk = [_weight(g, HQ) for _ in rows], [_weight(g, HK, torch.float32) for _ in rows]
        def fn(rank):
            return rank.fused_qk_rmsnorm(qs[rank.rank], ks[rank.rank], wq[rank.rank], wk[rank.rank], EPS)
        return fn, tpcomm.fused_qk_rmsnorm_reference(qs, ks, wq, wk, EPS) if same else None
    if name == "fused_moe_finalize_add_rmsnorm":  # the permuted layout, M = T * K + 3 rows, a negative scaling
        routing = {n: (torch.randperm(n * K + 3, device=device, generator=g)[:n * K].view(n, K),
                       torch.rand(n, K, device=device, generator=g)) for n in sorted(set(rows))}
        args = [dict(expert_out=_rand(g, n * K + 3, H), index=routing[n][0], topk_weights=routing[n][1],
                     scaling=-1.5) for n in rows]
        def fn(rank):
            return rank.fused_moe_finalize_add_rmsnorm(residual=res[rank.rank], weight=w[rank.rank], eps=EPS,
                                                       **args[rank.rank])
        if not same:
            return fn, None
        finalized = R.reduce_in_rank_order([tpcomm.moe_finalize_reference(**a) for a in args])
        return fn, [R.add_rmsnorm_reference(finalized, res[0], w[0], EPS)] * WORLD
    raise ValueError(f"build: unknown op {name!r}")


def op_and_algo(name: str) -> tuple[str, str]:
    """The op the errors name and the algorithm forced (``auto``: the default dispatch)."""
    op, _, form = name.partition("/")
    return op, form if form in ("lamport", "one_shot", "two_shot") else "auto"


def _same_bits(a, b) -> bool:
    return (a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


# -- trials (GPU) ------------------------------------------------------------------------------------------
class Watchdog:
    """Ends the process (exit status 1) with every thread's stack, and the trial that hung, in ``path``
    when a trial runs past ``bound_s`` (``faulthandler``: its own thread, so a main thread stuck in a CUDA
    call is caught too)."""

    def __init__(self, path: str, bound_s: float):
        self.path, self.bound_s = path, bound_s
        self.file = open(path, "w")

    @contextlib.contextmanager
    def watch(self, what: str, bound_s: float | None = None):
        """Watch one step named ``what`` for ``bound_s`` (default the trial's bound)."""
        bound_s = bound_s or self.bound_s
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"ran past {bound_s:g} s: {what}\n")
        self.file.flush()
        faulthandler.dump_traceback_later(bound_s, exit=True, file=self.file)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self.file.close()
        os.unlink(self.path)


class Clock:
    """``torch.cuda._sleep`` cycles for a duration: ``ns = ns_per_cycle * cycles + offset_ns``, fitted
    from CUDA-event timings of two sleeps (the smallest of five each)."""

    def __init__(self):
        torch.cuda._sleep(4_000_000)  # the clocks up from idle first
        torch.cuda.synchronize()
        points = []
        for cycles in (500_000, 4_000_000):
            best = float("inf")
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) * 1e6)
            points.append((cycles, best))
        (c0, t0), (c1, t1) = points
        self.ns_per_cycle = (t1 - t0) / (c1 - c0)
        self.offset_ns = t0 - self.ns_per_cycle * c0

    def cycles(self, ns: float) -> int:
        return max(0, int((ns - self.offset_ns) / self.ns_per_cycle))


def new_group(timeout_s: float):
    from tpcomm.loopback import loopback_group

    return loopback_group(WORLD, max_bytes=1 << 20, timeout_s=timeout_s)


def run_call(ranks, fn, algo: str, hold_cycles: int = 0, late_cycles: int = 0):
    """One call on every rank: both ranks' streams held by a sleep of ``hold_cycles`` on the current
    stream, rank ``LATE``'s stream sleeping ``late_cycles`` more before its call. Returns ``(outputs per
    rank or None, errors per rank, host issue seconds, GPU seconds of the call)``, after a synchronisation;
    an error is what the call raised on the host or what ``check()`` raises."""
    from tpcomm.loopback import run_ranks

    issue_errors: dict = {}

    def call(rank):
        if rank.rank == LATE and late_cycles:
            torch.cuda._sleep(late_cycles)
        try:
            with rank.use_algorithm(algo):
                return fn(rank)
        except Exception as e:  # noqa: BLE001 -- judged with the other ranks' outcomes
            issue_errors[rank.rank] = e
            return None

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if hold_cycles:
        torch.cuda._sleep(hold_cycles)
    start.record()
    t0 = time.perf_counter()
    outs = run_ranks(ranks, call)
    issue_s = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    errors = []
    for rank in ranks:
        try:
            rank.check()
            errors.append(issue_errors.get(rank.rank))
        except Exception as e:  # noqa: BLE001 -- judged
            errors.append(e)
    return outs, errors, issue_s, start.elapsed_time(end) / 1e3


class Sweep:
    """One op's trials on a loopback group replaced after every failed call."""

    def __init__(self, name: str, clock: Clock, watchdog: Watchdog):
        from tpcomm.loopback import close_group

        self.name, self.clock, self.watchdog = name, clock, watchdog
        self.op, self.algo = op_and_algo(name)
        self.sets = [build(name, [T] * WORLD, seed) for seed in range(SETS)]
        self.tally = Tally()
        self.trial = 0
        with watchdog.watch(f"{name}: compiling and loading", WARM_BOUND_S):
            warm = new_group(WARM_TIMEOUT_S)
            try:  # every kernel compiled and loaded first, one call per run_ranks (tpcomm.loopback)
                for fn, expected in self.sets:
                    self._expect_bits(warm, fn, expected, "a call without delay")
                with warm[0].use_algorithm(self.algo):
                    plan = self._plan(warm[0])
            finally:
                torch.cuda.synchronize()
                close_group(warm)
        # the host's time to issue a first call on a new group (what follows every failed trial), the
        # ranks held meanwhile by a long sleep: the hold of every trial is four times the longest
        with watchdog.watch(f"{name}: first calls on a new group", WARM_BOUND_S):
            self.ranks = new_group(TIMEOUT_S)
            try:
                issue = [self._expect_bits(self.ranks, fn, expected, "a call on a new group, held for 50 ms",
                                           clock.cycles(50e6)) for fn, expected in self.sets]
            except BaseException:
                self.close()
                raise
        self.hold_ns = max(HOLD_NS_MIN, 4e9 * max(issue))
        self.tally.extra.update(plan=plan, hold_ns=self.hold_ns, first_issue_us=[round(i * 1e6, 1) for i in issue],
                                late_issue=0)

    def _expect_bits(self, ranks, fn, expected, what: str, hold_cycles: int = 0) -> float:
        """One call without delay, which must give the reference's bits; returns its host issue seconds."""
        outs, errors, issue_s, _ = run_call(ranks, fn, self.algo, hold_cycles)
        key, detail = judge(self.op, errors, self._same(outs, expected))
        assert key == BITS, f"{self.name}: {what} gave {key} ({detail})"
        return issue_s

    def _plan(self, rank) -> str:
        if self.op in ("fused_qk_rmsnorm",):
            return "kernel"
        op = {"fused_moe_finalize_add_rmsnorm": "fused_add_rmsnorm"}.get(self.op, self.op)
        width = H if op in ("fused_add_rmsnorm", "reduce_scatter") else 0
        return rank.plan(op, T * H * 2, width, torch.bfloat16).algorithm

    @staticmethod
    def _same(outs, expected) -> list:
        if outs is None or expected is None:
            return [False] * WORLD
        return [o is not None and len(o) == len(e) and all(_same_bits(a, b) for a, b in zip(o, e))
                for o, e in zip(outs, expected)]

    def run(self, late_ns: float, offset_ns: float | None) -> str:
        """One trial with rank ``LATE`` late by ``late_ns``; returns its outcome's key."""
        from tpcomm.loopback import close_group

        fn, expected = self.sets[self.trial % SETS]
        self.trial += 1
        with self.watchdog.watch(f"{self.name}, trial {self.trial}, late by {late_ns:.0f} ns"):
            outs, errors, issue_s, _ = run_call(self.ranks, fn, self.algo, self.clock.cycles(self.hold_ns),
                                                self.clock.cycles(late_ns))
            key, detail = judge(self.op, errors, self._same(outs, expected))
            if issue_s * 1e9 > self.hold_ns:
                self.tally.extra["late_issue"] += 1
            self.tally.add(key, detail, offset_ns)
            if key != BITS:  # a failed call leaves the group unusable: a new one (after every kernel returned)
                close_group(self.ranks)
                self.ranks = new_group(TIMEOUT_S)
        return key

    def find_edge(self, steps: int = 12) -> float:
        """The delay at which calls start to fail, by bisection between half and one and a half timeouts
        (each step a judged trial)."""
        lo, hi = 0.5 * TIMEOUT_S * 1e9, 1.5 * TIMEOUT_S * 1e9
        ends = (self.run(lo, None), self.run(hi, None))
        self.tally.extra["ends"] = {"early": ends[0], "late": ends[1]}
        for _ in range(steps):
            mid = (lo + hi) / 2
            if self.run(mid, None) == BITS:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def close(self) -> None:
        from tpcomm.loopback import close_group

        torch.cuda.synchronize()
        close_group(self.ranks)


@pytest.fixture(scope="module")
def sweep_env():
    """The clock, the watchdog and the summary every test of this module adds to (written after each)."""
    out = os.environ.get("TPCOMM_SWEEP_OUT") or None
    budget_s = float(os.environ.get("TPCOMM_SWEEP_S", "150"))
    trials = int(os.environ.get("TPCOMM_SWEEP_TRIALS", "600"))
    hang = (out + ".hang.txt") if out else os.path.join(tempfile.gettempdir(), f"tpcomm-sweep-{os.getpid()}.hang.txt")
    watchdog = Watchdog(hang, TRIAL_BOUND_S)
    clock = Clock()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    summary = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
               "timeout_s": TIMEOUT_S, "mismatch_timeout_s": MISMATCH_TIMEOUT_S, "ns_per_cycle": clock.ns_per_cycle,
               "sleep_offset_ns": clock.offset_ns, "span_ns": SPAN_NS, "step_ns": STEP_NS, "rows": T, "hidden": H,
               "budget_s": budget_s, "trials_per_op": trials, "sweep": {}, "mismatch": {}}
    yield dict(out=out, budget_s=budget_s / len(SWEEP_OPS), trials=trials, clock=clock, watchdog=watchdog,
               summary=summary)
    watchdog.close()
    write_summary(out, summary)


@pytest.mark.parametrize("name", SWEEP_OPS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_call_near_the_deadline_completes_or_fails_on_every_rank(sweep_env, name):
    """Rank 1 late by the edge +-5 us (and the bisection's delays): every call gives the reference's bits
    on every rank, or PeerTimeoutError on rank 0 and PeerAbortedError on rank 1 for that call; never
    anything else, never a hang."""
    env = sweep_env
    try:
        sweep = Sweep(name, env["clock"], env["watchdog"])
    except BaseException as e:
        env["summary"]["sweep"][name] = {"trials": 0, "error": f"{type(e).__name__}: {e}"}
        write_summary(env["out"], env["summary"])
        raise
    try:
        started = time.monotonic()
        edge = sweep.find_edge()
        offsets = [-SPAN_NS + i * STEP_NS for i in range(2 * SPAN_NS // STEP_NS + 1)]
        i = 0
        while i < env["trials"] and time.monotonic() - started < env["budget_s"]:
            offset = offsets[i % len(offsets)]
            sweep.run(edge + offset, offset)
            i += 1
        sweep.tally.extra.update(edge_ns=edge, seconds=time.monotonic() - started)
    finally:
        sweep.close()
        env["summary"]["sweep"][name] = sweep.tally.as_dict()
        write_summary(env["out"], env["summary"])
    tally = sweep.tally
    assert tally.violations == 0, (f"{name}: {tally.violations} of {tally.trials} calls broke the contract "
                                   f"(outcomes {dict(tally.outcomes)}); first: " + " | ".join(tally.examples[:3]))
    assert tally.outcomes[BITS] and tally.outcomes[FAILED], (f"{name}: the sweep did not straddle the edge "
                                                             f"(outcomes {dict(tally.outcomes)})")


#: Calls a peer with another token count makes per op (each on a new group).
MISMATCH_TRIALS = 20


@pytest.mark.parametrize("name", T_OPS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_peer_with_another_token_count_is_a_mismatch_on_every_rank(sweep_env, name):
    """Rank 0 passes 16 tokens, rank 1 32 (grids of 16 and 32 programs), no delay: PeerMismatchError on
    every rank, for that call, before any wait could run to its timeout; never PeerTimeoutError."""
    from tpcomm.loopback import close_group

    op, algo = op_and_algo(name)
    tally = Tally()
    call, _ = build(name, [T, T_PEER], seed=99)
    with sweep_env["watchdog"].watch(f"{name}: compiling and loading", WARM_BOUND_S):
        warm = new_group(WARM_TIMEOUT_S)
        try:  # both token counts compiled and loaded by matching calls first (tpcomm.loopback)
            for rows in ([T] * WORLD, [T_PEER] * WORLD):
                fn, expected = build(name, rows, seed=98)
                outs, errors, _, _ = run_call(warm, fn, algo)
                key, detail = judge(op, errors, Sweep._same(outs, expected))
                assert key == BITS, f"{name}: a matching call of {rows[0]} rows gave {key} ({detail})"
        finally:
            torch.cuda.synchronize()
            close_group(warm)
    try:
        for trial in range(MISMATCH_TRIALS):
            with sweep_env["watchdog"].watch(f"{name}, mismatch trial {trial}"):
                ranks = new_group(MISMATCH_TIMEOUT_S)
                try:
                    _, errors, _, gpu_s = run_call(ranks, call, algo)
                finally:
                    torch.cuda.synchronize()
                    close_group(ranks)
            tally.add(*judge_mismatch(op, errors, gpu_s, MISMATCH_TIMEOUT_S))
    finally:
        sweep_env["summary"]["mismatch"][name] = tally.as_dict()
        write_summary(sweep_env["out"], sweep_env["summary"])
    assert tally.violations == 0, (f"{name}: {tally.violations} of {tally.trials} calls were not a mismatch on every "
                                   f"rank (outcomes {dict(tally.outcomes)}); first: " + " | ".join(tally.examples[:3]))
