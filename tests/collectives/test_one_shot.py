"""Numerics of the one-shot kernels (``kernels/one_shot.py`` push and ``kernels/lamport.py``, which share
``kernels/epilogue.py``) against the contract of docs/numerics.md, on CPU ranks under Triton's interpreter.

Each case forces one algorithm (``TPCOMM_ALGO`` while the communicator is created) and checks:
``s`` (all_reduce) and ``residual_out`` bit-exact against ``reduce_in_rank_order`` +
``add_rmsnorm_reference`` computed on each rank from seeds, ``out`` within the dtype's ulp tolerance
(``numerics.out_ulp_tolerance``), the same bits on every rank, and the plan that actually ran.
"""

import pytest
import torch

from tests.collectives import ranks
from tests.support.numerics import (
    Checks,
    algo_dtype_pairs,
    assert_ranks_identical,
    assert_same_bits,
    assert_same_values,
    assert_within_ulp,
    bits,
    dtype_name,
    out_ulp_tolerance,
    ulp_distance,
)

ALGO_DTYPES = [pytest.param(a, d, id=f"{a}-{dtype_name(d)}") for a, d in algo_dtype_pairs()]
#: (T, H) of the random-input cases: hidden sizes 1 (a row of one), 7 and 123 (odd, not a multiple of any
#: vector width), 2880 (a real model's, not a power of two); token counts 1 (decode), 3 (below the CPU
#: grid cap of 4 programs), 5 (above it: a program takes two rows). Every hidden size and every token
#: count appears, the widest rows under both grid regimes; not every pair (each costs a pool call).
SHAPES = [(1, 1), (3, 7), (5, 7), (5, 123), (1, 2880), (5, 2880)]


def check_fused(results, dtype, H, algo, check, residual=True):
    """Every rank: residual_out bit-exact, out within tolerance, x untouched, the forced plan ran;
    all ranks: identical bits."""
    tol = out_ulp_tolerance(dtype, H)
    for r, res in enumerate(results):
        check(assert_within_ulp, res["out"], res["out_ref"], tol, f"rank {r} out")
        if residual:
            check(assert_same_bits, res["residual_out"], res["residual_out_ref"], f"rank {r} residual_out")
        else:
            check.that(res["residual_out"] is None, f"rank {r}: residual_out is not None without residual")
        check.that(res["x_untouched"], f"rank {r}: fused_add_rmsnorm modified its input x")
        check.that(res["plan"] == algo, f"rank {r}: plan {res['plan']!r}, expected {algo!r}")
        if "s" in res:
            check(assert_same_bits, res["s"], res["s_ref"], f"rank {r} all_reduce")
    check(assert_ranks_identical, [res["out"] for res in results], "out")
    if residual:
        check(assert_ranks_identical, [res["residual_out"] for res in results], "residual_out")


# -- exact small-integer sums -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (3, 123), (4100,)], ids=str)
@pytest.mark.parametrize("algo,dtype", ALGO_DTYPES)
def test_all_reduce_small_integers_exact(pool, algo, dtype, shape):
    """Small integers sum exactly in every dtype: compare with the integer sum, bit for bit.
    (4100,) is flat rows of ALL_REDUCE_ROW elements plus a partial one."""
    results = pool.run(ranks.all_reduce_case, 11, shape, dtype, kind="int", algo=algo)
    check = Checks()
    for r, res in enumerate(results):
        check(assert_same_bits, res["y"], res["exact"].to(dtype), f"rank {r} all_reduce")
        check.that(res["plan"] == algo, f"rank {r}: plan {res['plan']!r}, expected {algo!r}")
    check.done()


@pytest.mark.parametrize("shape", [(1, 7), (5, 123)], ids=str)
@pytest.mark.parametrize("algo,dtype", ALGO_DTYPES)
def test_fused_residual_out_small_integers_exact(pool, algo, dtype, shape):
    results = pool.run(ranks.fused_case, 12, shape, dtype, kind="int", algo=algo)
    check = Checks()
    for r, res in enumerate(results):
        check(assert_same_bits, res["residual_out"], res["exact_residual_out"].to(dtype),
              f"rank {r} residual_out")
    check_fused(results, dtype, shape[-1], algo, check)
    check.done()


# -- random inputs against the reference ------------------------------------------------------------------
@pytest.mark.parametrize("T,H", SHAPES, ids=[f"{t}x{h}" for t, h in SHAPES])
@pytest.mark.parametrize("algo,dtype", ALGO_DTYPES)
def test_fused_matches_reference(pool, algo, dtype, H, T):
    results = pool.run(ranks.fused_case, 100 + 10 * H + T, (T, H), dtype, algo=algo,
                       also_all_reduce=True)
    check = Checks()
    check_fused(results, dtype, H, algo, check)
    check.done()


#: Rows wider than one tile (MAX_BLOCK_H = 8192): 8200 takes two tiles (every algorithm and dtype),
#: 16400 three (bf16 only: the interpreter's cost grows with H). T = 1 keeps the cost down.
SEVERAL_TILES = ([pytest.param(a, d, 8200, id=f"{a}-{dtype_name(d)}-8200") for a, d in algo_dtype_pairs()]
                 + [pytest.param(a, torch.bfloat16, 16400, id=f"{a}-bfloat16-16400")
                    for a, d in algo_dtype_pairs() if d == torch.bfloat16])


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("algo,dtype,H", SEVERAL_TILES)
def test_fused_several_tiles(pool, algo, dtype, residual, H):
    results = pool.run(ranks.fused_case, 200 + H, (1, H), dtype, residual=residual, algo=algo,
                       also_all_reduce=True)
    check = Checks()
    check_fused(results, dtype, H, algo, check, residual=residual)
    check.done()


@pytest.mark.parametrize("shape", [(1, 64), (5, 123), (1, 8200)], ids=str)
@pytest.mark.parametrize("algo,dtype", ALGO_DTYPES)
def test_fused_gemma(pool, algo, dtype, shape):
    """Gemma-style ``1 + w``: the weights are drawn around 0, so ``w`` alone would give a different
    answer (checked: the reference with gemma=False must differ)."""
    results = pool.run(ranks.fused_case, 300, shape, dtype, gemma=True, algo=algo)
    check = Checks()
    check_fused(results, dtype, shape[-1], algo, check)
    tol = out_ulp_tolerance(dtype, shape[-1])
    check.that(not bool((ulp_distance(results[0]["out_ref_other"], results[0]["out_ref"]) <= tol).all()),
               "the gemma and plain references agree: this case cannot tell them apart")
    check.done()


@pytest.mark.parametrize("shape", [(1, 7), (5, 2880)], ids=str)
@pytest.mark.parametrize("algo,dtype", ALGO_DTYPES)
def test_fused_without_residual(pool, algo, dtype, shape):
    """``fused_add_rmsnorm(x, None, w)`` returns ``(out, None)`` with ``out = rms_norm(s)``."""
    results = pool.run(ranks.fused_case, 400, shape, dtype, residual=False, algo=algo,
                       also_all_reduce=True)
    check = Checks()
    check_fused(results, dtype, shape[-1], algo, check, residual=False)
    check.done()


@pytest.mark.parametrize("algo", ["lamport", "one_shot"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=dtype_name)
def test_fused_fp32_weight(pool, algo, x_dtype):
    """A float32 norm weight with 16-bit activations: the weight is widened, never rounded to x's
    dtype first."""
    results = pool.run(ranks.fused_case, 500, (3, 123), x_dtype, w_dtype=torch.float32, algo=algo)
    check = Checks()
    check_fused(results, x_dtype, 123, algo, check)
    check.done()


@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
def test_fused_eps(pool2, eps):
    """eps is a runtime argument: different values in one communicator, each matching the reference."""
    results = pool2.run(ranks.fused_case, 600, (3, 64), torch.float32, eps=eps, algo="one_shot")
    check = Checks()
    check_fused(results, torch.float32, 64, "one_shot", check)
    check.done()


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 123), (2, 2880), (4100,)], ids=str)
@pytest.mark.parametrize("algo,dtype", ALGO_DTYPES)
def test_all_reduce_matches_reference(pool, algo, dtype, shape):
    results = pool.run(ranks.all_reduce_case, 700 + sum(shape), shape, dtype, algo=algo)
    check = Checks()
    for r, res in enumerate(results):
        check(assert_same_bits, res["y"], res["ref"], f"rank {r} all_reduce")
        check.that(res["plan"] == algo, f"rank {r}: plan {res['plan']!r}, expected {algo!r}")
    check(assert_ranks_identical, [res["y"] for res in results], "all_reduce")
    check.done()


# -- outputs: NaN-poisoned, in place, strided ---------------------------------------------------------------
#: (out mode, shape) pairs of test_all_reduce_out: NaN-filled on rows and on a flat tensor of a partial
#: row, in place on the flat one, strided on rows.
OUT_CASES = [("nan", (5, 123)), ("nan", (4100,)), ("inplace", (4100,)), ("strided", (5, 123))]


@pytest.mark.parametrize("out_mode,shape", OUT_CASES, ids=[f"{m}-{s}" for m, s in OUT_CASES])
@pytest.mark.parametrize("algo,dtype", ALGO_DTYPES)
def test_all_reduce_out(pool, algo, dtype, shape, out_mode):
    """``out`` pre-filled with NaN: every element written (inputs are finite, so a NaN left is an
    element never written). ``out=x``: in place. A strided ``out`` (every other element of a NaN-filled
    buffer): its elements written, the gaps between them untouched."""
    results = pool.run(ranks.all_reduce_case, 800, shape, dtype, out_mode=out_mode, algo=algo)
    check = Checks()
    for r, res in enumerate(results):
        check.that(not res["y"].isnan().any(), f"rank {r}: {int(res['y'].isnan().sum())} elements of out "
                                               f"never written (still NaN)")
        check(assert_same_bits, res["y"], res["ref"], f"rank {r} all_reduce out={out_mode}")
        check.that(res["x_untouched"], f"rank {r}: all_reduce with out={out_mode} modified x")
        if res["gaps"] is not None:
            check.that(bool(res["gaps"].isnan().all()), f"rank {r}: elements between a strided out's "
                                                        "elements were overwritten")
    check.done()


def test_partly_overlaps_only_for_shared_bytes_other_than_in_place():
    """The overlap check of ``all_reduce``'s out (contiguous out and x of one size): shifted views of one
    buffer overlap, the same view (in place), adjacent and separate tensors do not."""
    from tpcomm.validate import partly_overlaps as _partly_overlaps

    buf = torch.zeros(100, dtype=torch.bfloat16)
    assert _partly_overlaps(buf[1:51], buf[:50]) and _partly_overlaps(buf[:50], buf[1:51])
    assert _partly_overlaps(buf[49:99], buf[:50])  # one element shared
    assert not _partly_overlaps(buf[:50], buf[:50])  # in place
    assert not _partly_overlaps(buf[50:], buf[:50]) and not _partly_overlaps(buf[:50], buf[50:])  # adjacent
    assert not _partly_overlaps(torch.zeros(50, dtype=torch.bfloat16), buf[:50])


@pytest.mark.parametrize("k", [1, -1, 16])
@pytest.mark.parametrize("algo,dtype", ALGO_DTYPES)
def test_all_reduce_out_overlapping_x(pool, algo, dtype, k):
    """``out`` and ``x`` views of one buffer, ``out`` ``k`` elements after ``x`` (partly overlapping,
    not in place): the exact sum all the same (``x`` is reduced from a copy). Under the interpreter only
    the one-shot and Lamport cases with ``k > 0`` fail without the copy (programs run one after another);
    on GPUs every case can."""
    results = pool.run(ranks.all_reduce_case, 810, (4100,), dtype, out_mode=f"overlap{k}", algo=algo)
    check = Checks()
    for r, res in enumerate(results):
        check(assert_same_bits, res["y"], res["ref"], f"rank {r} all_reduce, out {k} elements after x")
    check.done()


# -- special values -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("algo,dtype", ALGO_DTYPES)
def test_negative_zero_gives_positive_zero(pool, algo, dtype):
    """All ranks pass -0.0: the accumulator starts at +0.0, so s = +0.0 (sign bit clear), and
    residual_out = +0.0 + -0.0 = +0.0; out = +0.0 * inv * 1 = +0.0."""
    results = pool.run(ranks.negative_zero_case, dtype, algo=algo)
    check = Checks()
    for r, res in enumerate(results):
        for name in ("s", "residual_out", "out", "out_no_residual"):
            t = res[name]
            check.that(bool((bits(t) == 0).all()), f"rank {r} {name}: {int((bits(t) != 0).sum())} of "
                                                   f"{t.numel()} elements are not +0.0 "
                                                   f"(bits {bits(t)[0, :4].tolist()})")
    check.done()


@pytest.mark.parametrize("algo,dtype", ALGO_DTYPES)
def test_nan_and_inf_propagate(pool, algo, dtype):
    """NaN anywhere gives NaN, +Inf + finite = +Inf, +Inf + -Inf = NaN, as IEEE says; a NaN in one row
    does not reach another row. Compared with the reference, NaN matching any NaN. The calls warn of
    nothing (the interpreter's NumPy warnings are off in tpcomm's kernels, as the GPU has none)."""
    results = pool.run(ranks.special_values_case, dtype, algo=algo)
    check = Checks()
    for r, res in enumerate(results):
        check(assert_same_values, res["s"], res["s_ref"], f"rank {r} all_reduce")
        check(assert_same_values, res["residual_out"], res["residual_out_ref"], f"rank {r} residual_out")
        check(assert_same_values, res["out"], res["out_ref"], f"rank {r} out")
        s = res["s"].float()
        check.that(bool(s[0, 0].isnan()) and s[0, 1] == float("inf") and bool(s[0, 2].isnan())
                   and s[0, 3] == float("-inf"), f"rank {r}: s[0, :4] = {s[0, :4].tolist()}, expected "
                                                 "[nan, inf, nan, -inf]")
        check.that(not res["out"][1].isnan().any(), f"rank {r}: NaN leaked into the finite row 1")
        check.that(not res["warnings"], f"rank {r}: the calls warned: {res['warnings'][:3]}")
        check.that(not res["out"][2].isnan().any(), f"rank {r}: the row of huge values normalised to NaN: "
                                                    f"{res['out'][2, :4].tolist()}")
    check.done()
