"""The collectives on CPU ranks: every algorithm gives the same bits (item 6), ``all_gather`` and
``reduce_scatter`` (item 4), interleaved calls of every op, size and algorithm on one communicator,
calls that do not match a peer's, and the crossover table (item 5). Rank bodies:
``tests/collectives/ranks.py``.

Faults already covered by ``tests/faults/test_faults.py`` (a skipped call, fused against all_reduce, fewer or
more fused rows, another dtype of the fused op, all_gather with fewer rows, reduce_scatter with more
rows, reduce_scatter against all_gather; 2 ranks) are not repeated here.
"""

import json

import pytest
import torch

from tests.collectives import ranks as cc
from tests.support.numerics import Checks, assert_same_bits, assert_within_ulp, dtype_name, out_ulp_tolerance
from tpcomm import dispatch
from tpcomm.dispatch import Crossover, CrossoverTable
from tpcomm.reference import share_bounds

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
#: Every algorithm a call can be forced to take: the kernels, and torch.distributed.
ALGOS = (*dispatch.ALGORITHMS, "fallback")


def _assert_same_raw(actual, expected, what):
    """Shape, dtype and every byte equal (any dtype: bool, integers and FP8 too)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    diff = cc.raw(actual) != cc.raw(expected)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.numel()} bytes differ"


def _assert_ranks_same_raw(per_rank, what):
    """Every rank's tensor has rank 0's shape, dtype and bytes (every rank checked before failing)."""
    ref = per_rank[0]
    differ = [r for r, t in enumerate(per_rank) if t.shape != ref.shape or t.dtype != ref.dtype
              or not torch.equal(cc.raw(t), cc.raw(ref))]
    assert not differ, f"{what}: ranks {differ} differ from rank 0"


# -- 1. every algorithm, the same bits (docs/numerics.md) ------------------------------------------------------
#: (id, world size, dtype, (T, H), exponent range of the inputs' 2**k scale, prefixes of rows, FP8 too).
#: "wide": normal values from 2**-60 to 2**40 in one row (squares stay finite in float32). "subnormal":
#: bf16 inputs and sums below 2**-126 mixed with small normals (the interpreter's bf16 widening mangles
#: subnormals: the kernels widen on the bits). fp16 from 2**-24 (its subnormals) up; fp32 from 2**-140
#: (its subnormals). H = 40: one partial tile of 64. T = 5 and the prefix 2: two-shot's shares of 5 rows
#: are 3/2 (2 ranks) or 2/2/1 (3 ranks), of 2 rows 1/1 or 1/1/0 (an idle rank).
BIT_CASES = [
    ("bf16-wide", 2, BF16, (5, 40), (-60, 40), [2], True),
    ("bf16-wide", 3, BF16, (5, 40), (-60, 40), [2], False),
    ("bf16-subnormal", 2, BF16, (3, 40), (-136, -118), [1], False),
    ("bf16-subnormal", 3, BF16, (2, 40), (-136, -118), [], False),
    ("fp16-wide", 2, FP16, (3, 40), (-24, 10), [], False),
    ("fp32-wide", 3, FP32, (3, 40), (-140, 40), [], False),
]
#: Outputs whose bits are exact for every algorithm, the fallback (torch.distributed) included.
EXACT_OUTPUTS = ("s", "residual_out", "residual_out_gemma")
#: Outputs of the norm: identical for the kernels; the fallback's mean is summed in another order
#: (docs/numerics.md, item 3), so it may differ by the dtype's ulp tolerance.
NORM_OUTPUTS = ("out", "out_no_residual", "out_gemma")
#: The FP8 per-token output of the kernels (the fallback quantises its own ``out``).
FP8_OUTPUTS = ("fp8_bytes", "fp8_scales")


@pytest.mark.parametrize("case", BIT_CASES, ids=[f"{c[0]}-w{c[1]}" for c in BIT_CASES])
def test_every_algorithm_gives_the_same_bits(pools, case):
    """lamport, one_shot, two_shot and fallback forced on the same wide-range inputs: all_reduce,
    residual_out exactly the reference's; every output of the kernels bit-identical to one-shot's (the
    fallback's norm within the ulp tolerance); every rank identical; the first rows of a call alone
    identical to those rows inside the whole call (batch invariance)."""
    name, world, dtype, shape, exponents, prefixes, fp8 = case
    pool = pools.get(world)
    algos = [a for a in ALGOS if not (a == "lamport" and dtype == FP32)]  # forced lamport on fp32 is one-shot
    results = pool.run(cc.algorithms_case, 3000 + world, shape, dtype, exponents, prefixes, algos, fp8=fp8)
    T, H = shape
    tol = out_ulp_tolerance(dtype, H)
    check = Checks()
    for r, res in enumerate(results):
        for a in algos:
            for op, plan in res["plans"][a].items():
                check.that(plan == a, f"rank {r}: {op} forced to {a} planned {plan!r}")
            launches = res["launches"][a]
            # the fallback: one launch a call, its signature through the all-gather kernel (FALLBACK_LAUNCHES)
            check.that(launches == res["calls"] if a == "fallback" else launches >= res["calls"],
                       f"rank {r}: {a} made {launches} kernel launches for {res['calls']} calls")
            for n, outs in res["runs"][a].items():
                where = f"rank {r} {a} {n} rows"
                check.that(outs["no_residual_is_none"], f"{where}: residual_out of the no-residual form")
                for k in EXACT_OUTPUTS:
                    check(assert_same_bits, outs[k], res["ref"][n][k], f"{where} {k} vs reference")
                for k in NORM_OUTPUTS:
                    check(assert_within_ulp, outs[k], res["ref"][n][k], tol, f"{where} {k} vs reference")
                    base = res["runs"]["one_shot"][n][k]
                    if a == "fallback":
                        check(assert_within_ulp, outs[k], base, tol, f"{where} {k} vs one_shot")
                    else:
                        check(assert_same_bits, outs[k], base, f"{where} {k} vs one_shot")
                if fp8 and a != "fallback":
                    for k in FP8_OUTPUTS:
                        check(assert_same_bits if k == "fp8_scales" else _assert_same_raw, outs[k],
                              res["runs"]["one_shot"][n][k], f"{where} {k} vs one_shot")
                if n != T:
                    for k, t in outs.items():
                        if isinstance(t, torch.Tensor):
                            full = res["runs"][a][T][k]
                            check(_assert_same_raw, t, full[:n], f"{where}: {k} alone vs inside {T} rows")
    for a in algos:
        for n, outs in results[0]["runs"][a].items():
            for k, t in outs.items():
                if isinstance(t, torch.Tensor):
                    check(_assert_ranks_same_raw, [res["runs"][a][n][k] for res in results], f"{a} {n} rows {k}")
    check.done()


# -- 2. all_gather ----------------------------------------------------------------------------------------
#: (world size, shape, dtype, dims): T = 1, odd sizes, rows not a multiple of 16, 1-D and 3-D.
GATHER_CASES = [
    (2, (1, 40), BF16, [0, 1, -1]),
    (3, (5, 123), FP16, [0, 1, -1]),
    (2, (3, 7), FP32, [0, 1, -1]),
    (3, (2, 3, 5), BF16, [0, 1, 2, -1]),
    (2, (7,), FP32, [0, -1]),
]
#: dtypes without a reduction kernel: gathered as bytes by the push kernel, bit for bit.
#: Kernel launches of a call that falls back on a communicator with kernels: one, which carries the call's
#: signature to the peers before the torch.distributed collective (docs/api.md).
FALLBACK_LAUNCHES = 1

GATHER_FALLBACK_DTYPES = [torch.int32, torch.int64, torch.bool, torch.uint8, torch.float64,
                          torch.float8_e4m3fn]


def _check_gather(results, expect_plan, check, expect_launches=None):
    for r, per_dim in enumerate(results):
        for dim, res in per_dim.items():
            where = f"rank {r} dim {dim}"
            if res["error"] is not None:
                check.that(False, f"{where}: all_gather raised {res['error']}")
                continue
            check(_assert_same_raw, res["y"], res["ref"], f"{where}: all_gather vs torch.cat")
            check.that(res["contiguous"], f"{where}: the result is not contiguous (torch.cat's is)")
            check.that(res["plan"] == expect_plan, f"{where}: plan {res['plan']!r}, expected {expect_plan!r}")
            if expect_plan == "fallback":
                check.that(res["launches"] == FALLBACK_LAUNCHES,
                           f"{where}: the fallback launched {res['launches']} kernels")
            elif expect_launches is not None:
                check.that(res["launches"] == expect_launches,
                           f"{where}: {res['launches']} launches, expected {expect_launches}")
            else:
                check.that(res["launches"] >= 1, f"{where}: no kernel launch")
            check.that(res["x_untouched"], f"{where}: x was modified")
    for dim in results[0]:
        if all(per_dim[dim]["y"] is not None for per_dim in results):
            check(_assert_ranks_same_raw, [per_dim[dim]["y"] for per_dim in results], f"dim {dim}")


@pytest.mark.parametrize("world,shape,dtype,dims", GATHER_CASES,
                         ids=[f"w{c[0]}-{dtype_name(c[2])}-{c[1]}" for c in GATHER_CASES])
def test_all_gather_kernel(pools, world, shape, dtype, dims):
    """Float inputs of random bits (NaN payloads, -0.0, subnormals, infinities) gathered along each
    dim by the push kernel: exactly ``torch.cat`` of every rank's input, on every rank."""
    results = pools.get(world).run(cc.all_gather_case, 3100 + len(shape), shape, dtype, dims)
    check = Checks()
    _check_gather(results, "push", check)
    check.done()


@pytest.mark.parametrize("dtype", GATHER_FALLBACK_DTYPES, ids=dtype_name)
def test_all_gather_other_dtypes_move_as_bytes_bit_exact(pool2, dtype):
    """dtypes without a reduction kernel still run the all-gather kernel: it copies their bytes."""
    results = pool2.run(cc.all_gather_case, 3200, (3, 7), dtype, [0, 1])
    check = Checks()
    _check_gather(results, "push", check)
    check.done()


@pytest.mark.parametrize("dtype", [BF16, torch.int16, torch.float8_e4m3fn], ids=dtype_name)
def test_all_gather_forced_fallback(pool2, dtype):
    """``use_algorithm("fallback")``: torch.distributed, the same bits as the kernel, for dtypes gloo
    lacks too (the fallback moves bytes)."""
    results = pool2.run(cc.all_gather_case, 3300, (5, 123), dtype, [0, 1], algo="fallback")
    check = Checks()
    _check_gather(results, "fallback", check)
    check.done()


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=dtype_name)
@pytest.mark.parametrize("algo", ["auto", "fallback"])
def test_unsigned_integers_on_every_path(pools, dtype, algo):
    """uint16 / uint32 / uint64, which gloo and NCCL lack: all_reduce, reduce_scatter and all_gather
    exact (sums wrap like a native sum) through the kernels and the fallback, 3 ranks (the results are
    checked on the ranks: the harness cannot pickle these dtypes)."""
    per_rank = pools.get(3).run(cc.unsigned_case, 3600, dtype_name(dtype), algo)
    check = Checks()
    for r, res in enumerate(per_rank):
        check.that(res == {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}, f"rank {r}: mismatches {res}")
    check.done()


def test_all_gather_chunked(pool2):
    """5000 bf16 elements through 4096-byte slots: flat rows of 1024 (half a slot), 2 rows a launch, so
    3 launches; the same bytes as one launch would give."""
    results = pool2.run(cc.all_gather_case, 3400, (5, 1000), BF16, [0, 1], max_bytes=4096)
    check = Checks()
    _check_gather(results, "push", check, expect_launches=3)
    check.done()


# -- 2. reduce_scatter ------------------------------------------------------------------------------------
#: (world size, shape, dtype, dim, max_bytes, algo, the kernel runs). T divisible by W or not, T < W
#: (ranks with empty shares), dims 1 and -1, 3-D, rows narrower than 16 elements and integer dtypes
#: (torch.distributed), a forced fallback, and a chunked call (13 rows of 300 through 4096-byte slots:
#: 3 rows of each share a launch, shares of 7 and 6 rows: 3 launches).
SCATTER_CASES = [
    (2, (4, 40), BF16, 0, None, "auto", True),
    (2, (5, 40), BF16, 0, None, "auto", True),
    (2, (1, 40), BF16, 0, None, "auto", True),
    (3, (2, 40), FP16, 0, None, "auto", True),
    (3, (7, 24), FP32, 0, None, "auto", True),
    (3, (5, 24), BF16, 0, None, "auto", True),
    (2, (40, 5), BF16, 1, None, "auto", True),
    (3, (2, 7, 24), FP16, 1, None, "auto", True),
    (2, (3, 2, 5), FP32, -1, None, "auto", "gather"),  # rows under 16 elements: all-gather kernel + sum
    (2, (6, 8), BF16, 0, None, "auto", "gather"),
    (2, (5, 7), torch.int32, 0, None, "auto", "gather"),  # integers: the all-gather kernel + an exact sum
    (3, (4, 3), torch.int64, 0, None, "auto", "gather"),
    (2, (5, 40), BF16, 0, None, "fallback", False),
    (2, (13, 300), BF16, 0, 4096, "auto", True),
    (2, (5, 7), torch.int16, 0, None, "auto", "gather"),  # a dtype gloo and NCCL lack: the kernel ...
    (3, (4, 3), torch.int16, 0, None, "fallback", False),  # ... and the fallback (bytes + exact sum)
]


@pytest.mark.parametrize("world,shape,dtype,dim,max_bytes,algo,kernel", SCATTER_CASES,
                         ids=[f"w{c[0]}-{dtype_name(c[2])}-{c[1]}-dim{c[3]}" + ("-chunked" if c[4] else "")
                              + ("-fallback" if c[5] == "fallback" else "") for c in SCATTER_CASES])
def test_reduce_scatter(pools, world, shape, dtype, dim, max_bytes, algo, kernel):
    """This rank's ``tensor_split`` share of the exact sum, bit for bit, equal to the same rows of
    ``all_reduce``; empty on the last ranks when T < W; the kernel (as many launches as its plan needs)
    or torch.distributed as documented."""
    results = pools.get(world).run(cc.reduce_scatter_case, 3500, shape, dtype, dim, max_bytes, algo)
    check = Checks()
    T = shape[dim]
    for r, res in enumerate(results):
        start, length = share_bounds(T, world, r)
        want = list(shape)
        want[dim] = length
        check.that(tuple(res["y"].shape) == tuple(want), f"rank {r}: share of shape {tuple(res['y'].shape)}, "
                                                         f"expected {tuple(want)}")
        check.that(res["bounds"] == (start, length), f"rank {r}: share_bounds {res['bounds']}")
        check(_assert_same_raw, res["y"], res["ref"], f"rank {r}: share vs the exact sum's")
        check(_assert_same_raw, res["y"], res["ar_rows"], f"rank {r}: share vs all_reduce's rows")
        if kernel == "gather":
            check.that(res["launches"] >= 1, f"rank {r}: no launch: the integers did not go through the kernel")
        elif kernel:
            check.that(res["launches"] == res["expected_launches"] and res["launches"] >= 1,
                       f"rank {r}: {res['launches']} launches, expected {res['expected_launches']}")
            if max_bytes:
                check.that(res["launches"] > 1, f"rank {r}: the chunked case ran in one launch")
        else:
            check.that(res["launches"] == FALLBACK_LAUNCHES,
                       f"rank {r}: {res['launches']} launches; expected torch.distributed")
    check.done()


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_share_bounds_cut_like_tensor_split(world):
    for T in range(0, 12):
        rows = torch.arange(T)
        for r, piece in enumerate(torch.tensor_split(rows, world)):
            start, length = share_bounds(T, world, r)
            assert rows[start:start + length].tolist() == piece.tolist(), (T, world, r)


# -- 3. interleaving ---------------------------------------------------------------------------------------
#: Consecutive calls of very different sizes, ops and algorithms on one communicator: 1 row, 48000
#: elements (12 flat rows of 4096), 3 rows, partial tiles (H = 24 in tiles of 32, a last flat row of 4),
#: T < W for reduce_scatter, and the fallback between kernels; each must meet its own call's contract,
#: so no flag or data of one call can be taken for another's.
INTERLEAVE = [
    ("fused", (1, 64), BF16, "lamport"),
    ("all_reduce", (3000, 16), BF16, "two_shot"),
    ("fused", (3, 40), FP16, "two_shot"),
    ("all_gather", (3000, 16), BF16, "auto"),
    ("fused_no_res", (1, 24), BF16, "one_shot"),
    ("reduce_scatter", (7, 24), BF16, "auto"),
    ("all_reduce", (4100,), BF16, "lamport"),
    ("fused", (5, 24), FP32, "one_shot"),
    ("reduce_scatter", (1, 16), FP16, "auto"),
    ("all_gather", (3, 7), FP32, "auto"),
    ("fused", (3, 40), FP16, "fallback"),
    ("all_reduce", (1,), FP32, "two_shot"),
    ("fused", (3, 40), FP16, "lamport"),
    ("all_gather", (1, 24), BF16, "auto"),
    ("fused_no_res", (2, 64), BF16, "two_shot"),
    ("all_reduce", (3, 40), FP16, "one_shot"),
]
#: Largest per-call delay of a rank: about a call's own duration under the interpreter, so ranks arrive
#: in every order.
INTERLEAVE_SKEW_S = 0.03


@pytest.mark.parametrize("world", [2, 3], ids=["w2", "w3"])
def test_interleaved_calls(pools, world):
    results = pools.get(world).run(cc.interleave_case, 3600 + world, INTERLEAVE, INTERLEAVE_SKEW_S)
    check = Checks()
    for r, report in enumerate(results):
        check.that(len(report) == len(INTERLEAVE), f"rank {r}: {len(report)} steps reported")
        for (fail, _, launches), (op, shape, dtype, algo) in zip(report, INTERLEAVE):
            step = f"rank {r}: {op} {shape} {dtype_name(dtype)} {algo}"
            check.that(fail is None, f"{step}: {fail}")
            check.that(launches == FALLBACK_LAUNCHES if algo == "fallback" else launches >= 1,
                       f"{step}: {launches} launches")
    for i, (op, shape, dtype, algo) in enumerate(INTERLEAVE):
        if op != "reduce_scatter":  # shares differ between ranks
            check.that(len({report[i][1] for report in results}) == 1, f"step {i} {op} {shape}: ranks differ")
    check.done()


# -- 4. calls that do not match a peer's --------------------------------------------------------------------
#: Kernel timeout of the mismatched calls: short (each fault waits at most about this long), yet long
#: against the scheduling noise of ranks that start a call together after a barrier.
MISMATCH_TIMEOUT_S = 0.5
#: Margin for the call's own work on a busy 2-core machine.
MISMATCH_MARGIN_S = 4.0


def _calls(*per_rank):
    return list(per_rank)


#: name -> (world size, the call of each rank (op, shape, dtype, forced algorithm)).
MISMATCHES = {
    # the same bytes as another op (rows of 64 bf16 in both)
    **{f"all_reduce against all_gather [{a}]": (2, _calls(("all_reduce", (2, 64), BF16, a),
                                                          ("all_gather", (2, 64), BF16, "auto")))
       for a in dispatch.ALGORITHMS},
    # a flat all_reduce of 4100 against 4150 elements: 2 rows of 4096 (the same grid) on both
    **{f"all_reduce, other size on the same grid [{a}]": (2, _calls(("all_reduce", (4100,), BF16, a),
                                                                    ("all_reduce", (4150,), BF16, a)))
       for a in dispatch.ALGORITHMS},
    # ranks that force different algorithms for the same call
    "one_shot against two_shot": (2, _calls(("fused", (3, 64), BF16, "one_shot"),
                                            ("fused", (3, 64), BF16, "two_shot"))),
    "lamport against one_shot": (2, _calls(("fused", (2, 64), BF16, "lamport"),
                                           ("fused", (2, 64), BF16, "one_shot"))),
    "lamport against two_shot": (2, _calls(("all_reduce", (2, 64), BF16, "lamport"),
                                           ("all_reduce", (2, 64), BF16, "two_shot"))),
    # two-shot's first half against the whole of it
    "reduce_scatter against all_reduce": (2, _calls(("reduce_scatter", (4, 64), BF16, "auto"),
                                                    ("all_reduce", (4, 64), BF16, "two_shot"))),
    "all_gather, other dtype": (2, _calls(("all_gather", (2, 64), BF16, "auto"),
                                          ("all_gather", (2, 64), FP16, "auto"))),
    # 3 ranks: one odd rank out; the other two agree with each other and must still raise
    "rank 2 all_gather, ranks 0-1 all_reduce": (3, _calls(*[("all_reduce", (2, 64), BF16, "one_shot")] * 2,
                                                          ("all_gather", (2, 64), BF16, "auto"))),
    "rank 1 fewer rows, two-shot fused": (3, _calls(("fused", (4, 64), BF16, "two_shot"),
                                                    ("fused", (3, 64), BF16, "two_shot"),
                                                    ("fused", (4, 64), BF16, "two_shot"))),
}
#: Faults that do not raise on every rank, and why.
MISMATCH_NOT_YET: dict = {}  # none since Lamport carries the call signature (call tags)
#: Longer timeouts where the expected outcome needs a peer to arrive within it (the xfail above: the
#: 4150-element rank must have pushed before the 4100-element one gives up, or both raise by luck).
MISMATCH_TIMEOUTS = {"all_reduce, other size on the same grid [lamport]": 2.0}
#: Seconds the late rank of NAMED_PEER sleeps before its call: far longer than the others take to see
#: the odd rank's flags.
LATE_S = 2.0
#: 3 ranks: rank 1 calls all_gather, ranks 0 and 2 the fused op (one program each); rank 2 comes late.
#: Rank 0 sees rank 1's other signature at once: the error must name rank 1, not the late rank 2
#: (whose call is right, and who arrives well within the timeout of a wait that had not given up).
NAMED_PEER = (_calls(("fused", (1, 64), BF16, "one_shot"), ("all_gather", (1, 64), BF16, "auto"),
                     ("fused", (1, 64), BF16, "one_shot")), [0.0, 0.0, LATE_S])


@pytest.fixture(scope="module")
def mismatches(pools):
    """``{name: [result of each rank]}`` from one pool call per world size."""
    seen = {}
    for world in (2, 3):
        faults = [(name, calls, [0.0] * world, MISMATCH_TIMEOUTS.get(name, MISMATCH_TIMEOUT_S))
                  for name, (w, calls) in MISMATCHES.items() if w == world]
        if world == 3:
            faults.append(("named peer", *NAMED_PEER, MISMATCH_TIMEOUT_S))
        per_rank = pools.get(world).run(cc.mismatch_batch, faults, timeout_s=300)
        for name, *_ in faults:
            seen[name] = [res[name] for res in per_rank]
    return seen


def _mismatch_param(name):
    marks = [pytest.mark.xfail(strict=True, reason=MISMATCH_NOT_YET[name])] if name in MISMATCH_NOT_YET else []
    return pytest.param(name, id=name, marks=marks)


def _check_raised(results, world, check, timeout_s=MISMATCH_TIMEOUT_S):
    for r, res in enumerate(results):
        check.that(res["warm_ok"], f"rank {r}: the call every rank made first was wrong")
        seen = res["seen"]
        if seen is None:
            check.that(False, f"rank {r}: the call returned without an error")
            continue
        check.that(seen["type"] in ("PeerTimeoutError", "PeerMismatchError") and seen.get("peer") in
                   set(range(world)) - {r}, f"rank {r}: raised {seen['type']}: {seen['message']}")
        check.that(res["elapsed"] < timeout_s + MISMATCH_MARGIN_S,
                   f"rank {r}: took {res['elapsed']:.2f} s to raise")


@pytest.mark.parametrize("name", [_mismatch_param(n) for n in MISMATCHES])
def test_mismatched_call_raises_on_every_rank(mismatches, name):
    """Every rank raises PeerTimeoutError or PeerMismatchError naming another rank (never returns),
    within the timeout and a margin."""
    check = Checks()
    _check_raised(mismatches[name], MISMATCHES[name][0], check, MISMATCH_TIMEOUTS.get(name, MISMATCH_TIMEOUT_S))
    check.done()


def test_error_names_the_rank_whose_call_differs(mismatches):
    """3 ranks, rank 1 makes another call, rank 2 comes late: every rank raises, and ranks 0 and 2
    name rank 1."""
    results = mismatches["named peer"]
    check = Checks()
    _check_raised(results, 3, check)
    for r in (0, 2):
        seen = results[r]["seen"] or {}
        check.that(seen.get("peer") == 1, f"rank {r} names rank {seen.get('peer')}: {seen.get('message')}")
    check.done()


# -- 5. the crossover table --------------------------------------------------------------------------------
def _table(lamport_max, two_shot_min, world=2, ops=("all_reduce", "fused_add_rmsnorm")):
    return CrossoverTable({op: {world: Crossover(lamport_max, two_shot_min, "test")} for op in ops}, "test")


def test_table_json_round_trip():
    t = CrossoverTable({"all_reduce": {2: Crossover(1, 2, "a"), 4: Crossover(3, 4, "b")},
                        "fused_add_rmsnorm": {3: Crossover(0, 7, "")}}, device="cpu test")
    assert CrossoverTable.from_json(t.to_json()) == t
    assert CrossoverTable.from_json(dispatch.DEFAULT_TABLE.to_json()) == dispatch.DEFAULT_TABLE


BAD_TABLES = {
    "not json": "lamport: 4 MiB",
    "no entries": json.dumps({"device": "x"}),
    "top level list": json.dumps([1, 2]),
    "unknown op": json.dumps({"entries": {"all_to_all": {"2": {"lamport_max_bytes": 0, "two_shot_min_bytes": 0}}}}),
    "negative threshold": json.dumps({"entries": {"all_reduce": {"2": {"lamport_max_bytes": -1,
                                                                       "two_shot_min_bytes": 0}}}}),
    "world size 1": json.dumps({"entries": {"all_reduce": {"1": {"lamport_max_bytes": 0, "two_shot_min_bytes": 0}}}}),
    "missing threshold": json.dumps({"entries": {"all_reduce": {"2": {"lamport_max_bytes": 0}}}}),
    "threshold not a number": json.dumps({"entries": {"all_reduce": {"2": {"lamport_max_bytes": "big",
                                                                           "two_shot_min_bytes": 0}}}}),
    "entry not an object": json.dumps({"entries": {"all_reduce": {"2": 5}}}),
    "entries a list": json.dumps({"entries": []}),
    "op entries a list": json.dumps({"entries": {"all_reduce": [1]}}),
}
#: Bad tables that do not raise ValueError yet.
BAD_TABLES_NOT_YET = {
    name: ("tpcomm/dispatch.py CrossoverTable.from_json calls .items() on the JSON value and catches only "
           "KeyError, TypeError and JSONDecodeError: a list raises AttributeError, which "
           "Communicator._load_table does not catch either, so rank 0 raises while the other ranks wait in "
           "broadcast_object_list")
    for name in ()
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=BAD_TABLES_NOT_YET[n])]
                                               if n in BAD_TABLES_NOT_YET else []) for n in BAD_TABLES])
def test_bad_table_raises_value_error(name):
    with pytest.raises(ValueError):
        CrossoverTable.from_json(BAD_TABLES[name])


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=dtype_name)
@pytest.mark.parametrize("op", ["all_reduce", "fused_add_rmsnorm"])
def test_choose_follows_the_thresholds(op, dtype):
    """Lamport up to its threshold (16-bit only), one-shot below the two-shot threshold, two-shot at and
    above it; fp32 never Lamport."""
    lam, two = 4096, 65536
    table = _table(lam, two)
    want = {lam - 2: "lamport", lam: "lamport", lam + 2: "one_shot", two - 2: "one_shot", two: "two_shot",
            two + 2: "two_shot", 1 << 30: "two_shot"}
    for nbytes, algo in want.items():
        if dtype == FP32 and algo == "lamport":
            algo = "one_shot"
        got = dispatch.choose(op, 2, nbytes, 64, dtype, table=table).algorithm
        assert got == algo, f"{op} {dtype} {nbytes} bytes: {got}, expected {algo}"


@pytest.mark.parametrize("nbytes", [2, 4096, 1 << 20, 4 << 20, 64 << 20])
def test_choose_never_lamport_for_fp32(nbytes):
    for table in (dispatch.DEFAULT_TABLE, _table(1 << 40, 1 << 41)):
        for forced in ("auto", "lamport"):
            plan = dispatch.choose("fused_add_rmsnorm", 2, nbytes, 64, FP32, forced=forced, table=table)
            assert plan.algorithm != "lamport", (nbytes, forced, plan)


def test_lookup_uses_the_nearest_smaller_world_and_defaults_for_missing_ops():
    t = CrossoverTable({"all_reduce": {2: Crossover(1, 10), 4: Crossover(2, 20)}})
    assert [t.lookup("all_reduce", w).two_shot_min_bytes for w in (2, 3, 4, 8)] == [10, 10, 20, 20]
    assert t.lookup("fused_add_rmsnorm", 2) == dispatch.DEFAULT_TABLE.lookup("fused_add_rmsnorm", 2)


#: Calls probed through a communicator: 4 rows of 256 bf16 (2048 bytes, at rank 0's two-shot threshold),
#: a flat all_reduce of 2000 bytes (just below it).
TABLE_PROBES = [("fused_add_rmsnorm", (4, 256), BF16), ("all_reduce", (1000,), BF16)]


def test_rank_zero_table_wins(pools, tmp_path):
    """Each rank points TPCOMM_DISPATCH_TABLE somewhere else: rank 0 at a table whose two-shot threshold
    is 2048 bytes (no Lamport), rank 1 at one that would send both probes to Lamport, rank 2 at no file
    at all. Every rank loads rank 0's table and plans (and runs) the same algorithms: two-shot at 2048
    bytes, one-shot at 2000."""
    a, b = tmp_path / "rank0.json", tmp_path / "rank1.json"
    a.write_text(_table(0, 2048).to_json())
    b.write_text(_table(1 << 20, 1 << 30).to_json())
    results = pools.get(3).run(cc.table_case, [str(a), str(b), str(tmp_path / "missing.json")], TABLE_PROBES)
    check = Checks()
    want = CrossoverTable.from_json(a.read_text())
    for r, res in enumerate(results):
        check.that(CrossoverTable.from_json(res["table"]) == want, f"rank {r} loaded {res['table']}")
        check.that(res["plans"] == ["two_shot", "one_shot"], f"rank {r}: plans {res['plans']}")
        check.that(all(res["ok"]), f"rank {r}: results against the reference {res['ok']}")
        check.that(all(n >= 1 for n in res["launches"]), f"rank {r}: launches {res['launches']}")
    check.done()


@pytest.mark.parametrize("bad", ["missing file", "not json", "unknown op"])
def test_bad_table_on_rank_zero_raises_on_every_rank(pool2, tmp_path, bad):
    """A table rank 0 cannot use: ValueError naming TPCOMM_DISPATCH_TABLE on every rank (no hang),
    even though rank 1's own table is fine."""
    good = tmp_path / "good.json"
    good.write_text(_table(0, 8192).to_json())
    path = tmp_path / "bad.json"
    if bad != "missing file":
        path.write_text(BAD_TABLES[bad])
    results = pool2.run(cc.table_error_case, [str(path), str(good)])
    check = Checks()
    for r, seen in enumerate(results):
        check.that(seen is not None and seen[0] == "ValueError" and "TPCOMM_DISPATCH_TABLE" in seen[1],
                   f"rank {r}: {seen}")
    check.done()
