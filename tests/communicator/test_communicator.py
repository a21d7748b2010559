"""``Communicator`` (``tpcomm/communicator.py``): validation, shapes and layouts, chunking, batch
invariance, fallback, repeated calls and skew, life cycle, peer timeouts. CPU ranks, world sizes 2 and 3.
"""

import re

import pytest
import torch

from tests.collectives import ranks as collectives_ranks
from tests.communicator import ranks
from tests.support.numerics import (
    Checks,
    algo_dtype_pairs,
    assert_ranks_identical,
    assert_same_bits,
    assert_within_ulp,
    bits,
    dtype_name,
    out_ulp_tolerance,
)

ALGO_DTYPES = [pytest.param(a, d, id=f"{a}-{dtype_name(d)}") for a, d in algo_dtype_pairs()]
#: One 16-bit dtype and float32 (where the algorithm takes it) per algorithm: for the checks of layouts
#: and row mapping, where fp16 takes bf16's paths (both are 16-bit; the numerics tests cover each dtype).
ALGO_LAYOUT_DTYPES = [p for p in ALGO_DTYPES if p.values[1] != torch.float16]
ALGOS = sorted({a for a, _ in algo_dtype_pairs()})


# -- bad inputs ------------------------------------------------------------------------------------------------
#: case -> (exception type, argument name the message must contain, op prefix of the message)
BAD_INPUTS = {
    "fused_int_x": (TypeError, "x", "fused_add_rmsnorm"),
    "fused_fp8_x": (TypeError, "x", "fused_add_rmsnorm"),
    "all_reduce_fp8_x": (TypeError, "x", "all_reduce"),
    "all_reduce_bool_x": (TypeError, "x", "all_reduce"),
    "all_reduce_complex_x": (TypeError, "x", "all_reduce"),
    "residual_shape": (ValueError, "residual", "fused_add_rmsnorm"),
    "residual_rows": (ValueError, "residual", "fused_add_rmsnorm"),
    "residual_dtype": (TypeError, "residual", "fused_add_rmsnorm"),
    "weight_shape": (ValueError, "weight", "fused_add_rmsnorm"),
    "weight_2d": (ValueError, "weight", "fused_add_rmsnorm"),
    "weight_int": (TypeError, "weight", "fused_add_rmsnorm"),
    "eps_negative": (ValueError, "eps", "fused_add_rmsnorm"),
    "eps_inf": (ValueError, "eps", "fused_add_rmsnorm"),
    "eps_nan": (ValueError, "eps", "fused_add_rmsnorm"),
    "eps_none": (TypeError, "eps", "fused_add_rmsnorm"),
    "eps_float32_overflow": (ValueError, "eps", "fused_add_rmsnorm"),
    "eps_int_beyond_float64": (ValueError, "eps", "fused_add_rmsnorm"),
    "gemma_not_bool": (TypeError, "gemma", "fused_add_rmsnorm"),
    "quant_empty": (ValueError, "quant", "fused_add_rmsnorm"),
    "out_shape": (ValueError, "out", "all_reduce"),
    "out_dtype": (ValueError, "out", "all_reduce"),
    "x_not_tensor_fused": (TypeError, "x", "fused_add_rmsnorm"),
    "x_not_tensor_all_reduce": (TypeError, "x", "all_reduce"),
    "residual_not_tensor": (TypeError, "residual", "fused_add_rmsnorm"),
    "weight_not_tensor": (TypeError, "weight", "fused_add_rmsnorm"),
    "out_not_tensor": (TypeError, "out", "all_reduce"),
    "x_scalar": (ValueError, "x", "fused_add_rmsnorm"),
    "x_meta_device_fused": (ValueError, "x", "fused_add_rmsnorm"),
    "x_meta_device_all_reduce": (ValueError, "x", "all_reduce"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises(pool2, case):
    """The documented exception type, prefixed with the op and naming the argument, on every rank; the
    ranks stay in step (a correct call right after)."""
    exc, arg, op = BAD_INPUTS[case]
    results = pool2.run(ranks.bad_input_case, case)
    check = Checks()
    expected_after = torch.full((2, 32), float(sum(range(1, pool2.world_size + 1))), dtype=torch.bfloat16)
    for r, res in enumerate(results):
        seen = res["error"]
        check.that(seen is not None, f"rank {r}: {case} raised nothing")
        if seen is not None:
            name, msg = seen
            check.that(name == exc.__name__, f"rank {r}: {case} raised {name} ({msg!r}), expected {exc.__name__}")
            check.that(re.search(rf"\b{arg}\b", msg) is not None,
                       f"rank {r}: {case}: message does not name {arg!r}: {msg!r}")
            check.that(msg.startswith(f"{op}:"), f"rank {r}: {case}: message not prefixed with {op!r}: {msg!r}")
        check(assert_same_bits, res["after"], expected_after, f"rank {r}: all_reduce after {case}")
    check.done()


#: case -> (exception type, word the message must contain)
BAD_CONSTRUCTOR = {
    "max_bytes_zero": (ValueError, "max_bytes"),
    "max_bytes_negative": (ValueError, "max_bytes"),
    "max_bytes_differ": (ValueError, "max_bytes"),  # ranks pass different values: refused on every rank
    "timeout_zero": (ValueError, "timeout_s"),
    "timeout_negative": (ValueError, "timeout_s"),
    "timeout_inf": (ValueError, "timeout_s"),
    "algo_env": (ValueError, "TPCOMM_ALGO"),
    "max_bytes_float": (TypeError, "max_bytes"),
    "timeout_str": (TypeError, "timeout_s"),
    "group_str": (TypeError, "group"),  # every rank passes it: each refuses it before any exchange
}


@pytest.mark.parametrize("case", sorted(BAD_CONSTRUCTOR))
def test_bad_constructor_argument_raises(pool, case):
    """The documented ValueError naming the argument, on every rank, without a hang."""
    exc, word = BAD_CONSTRUCTOR[case]
    results = pool.run(ranks.constructor_error_case, case)
    check = Checks()
    for r, seen in enumerate(results):
        check.that(seen is not None and seen[0] == exc.__name__ and word in seen[1],
                   f"rank {r}: Communicator({case}) raised {seen}, expected {exc.__name__} naming {word}")
    check.done()


@pytest.mark.parametrize("case", sorted(ranks.SETTINGS))
def test_settings_the_ranks_must_agree_on_are_checked_at_creation(pool, case):
    """One rank changes one setting. Those the ranks must agree on (the algorithm, the versions, the
    workspace layout) are refused by every rank's constructor at once, naming the setting and each
    rank's value; those that may differ (PDL, timeout, grid cap, direct launch) give a working
    communicator whose results match the contract."""
    _, _, field = ranks.SETTINGS[case]
    check = Checks()
    for r, (error, took, right) in enumerate(pool.run(ranks.settings_case, case)):
        if field is None:
            check.that(error is None and right, f"rank {r}: {case} may differ, but: raised {error}, right={right}")
            continue
        check.that(error is not None and error[0] == "ValueError" and field in error[1]
                   and "rank 0:" in error[1] and "rank 1:" in error[1],
                   f"rank {r}: {case}: expected a ValueError naming {field!r} and each rank's value, got {error}")
        check.that(took < 5.0, f"rank {r}: {case}: refused after {took:.1f} s")
    check.done()


@pytest.mark.parametrize("dtype,H", [(torch.bfloat16, 64), (torch.float32, 7), (torch.float16, 8200)],
                         ids=["bfloat16-64", "float32-7", "float16-8200"])
def test_zero_tokens(pool, dtype, H):
    """Zero tokens: empty outputs of the right shapes on every rank, no hang, no epoch consumed (a
    call with no data must not advance it, DESIGN.md), and the next call is still right."""
    results = pool.run(ranks.zero_tokens_case, dtype, H)
    check = Checks()
    for r, res in enumerate(results):
        for name, shape in (("out", (0, H)), ("residual_out", (0, H)), ("out_nr", (0, H)), ("y", (0, H)),
                            ("y0", (0,))):
            t = res[name]
            check.that(isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == dtype,
                       f"rank {r}: {name} is {t if not isinstance(t, torch.Tensor) else (tuple(t.shape), t.dtype)}")
        check.that(res["ro_nr"] is None, f"rank {r}: residual_out without residual is not None")
        check.that(res["epoch"] == res["epoch_after"],
                   f"rank {r}: zero-token calls moved the epoch {res['epoch']} -> {res['epoch_after']}")
        check(assert_same_bits, res["after"], res["after_ref"], f"rank {r}: all_reduce after zero tokens")
    check.done()


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64], ids=dtype_name)
def test_integer_all_reduce_exact(pool, dtype):
    """Integer dtypes have no reduction kernel: every rank's input goes through the all-gather kernel and
    is summed here in int64, exactly; ``plan`` says so (``push``)."""
    results = pool.run(ranks.integer_all_reduce_case, dtype, (3, 5))
    check = Checks()
    for r, res in enumerate(results):
        check.that(res["plan"] == "push", f"rank {r}: plan {res['plan']!r} for {dtype}")
        check.that(res["y"].dtype == dtype and torch.equal(res["y"].to(torch.int64), res["exact"]),
                   f"rank {r}: {res['y'].tolist()} != {res['exact'].tolist()}")
    check.done()


# -- layouts and shapes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["strided", "transposed", "offset"])
@pytest.mark.parametrize("algo,dtype", ALGO_LAYOUT_DTYPES)
def test_non_contiguous_inputs(pool, algo, dtype, layout):
    """``x[:, ::2]``, ``x.t()`` and a contiguous x one element into its storage (residual likewise) give
    the result of their contiguous copies, and leave x as it was."""
    shape = (5, 24)
    fused = pool.run(collectives_ranks.fused_case, 900, shape, dtype, layout=layout, algo=algo)
    ar = pool.run(collectives_ranks.all_reduce_case, 901, shape, dtype, layout=layout, algo=algo)
    check = Checks()
    for r in range(pool.world_size):
        check(assert_same_bits, fused[r]["residual_out"], fused[r]["residual_out_ref"], f"rank {r} residual_out")
        check(assert_within_ulp, fused[r]["out"], fused[r]["out_ref"], out_ulp_tolerance(dtype, shape[-1]),
              f"rank {r} out")
        check(assert_same_bits, ar[r]["y"], ar[r]["ref"], f"rank {r} all_reduce")
        check.that(fused[r]["x_untouched"] and ar[r]["x_untouched"], f"rank {r}: x was modified")
    check.done()


@pytest.mark.parametrize("algo,dtype", ALGO_DTYPES)
def test_three_dimensional_input(pool, algo, dtype):
    """``(B, S, H)`` input: leading dimensions are flattened and the outputs keep the shape."""
    fused = pool.run(collectives_ranks.fused_case, 910, (2, 3, 40), dtype, algo=algo)
    ar = pool.run(collectives_ranks.all_reduce_case, 911, (2, 3, 5), dtype, algo=algo)
    check = Checks()
    for r in range(pool.world_size):
        check(assert_same_bits, fused[r]["residual_out"], fused[r]["residual_out_ref"], f"rank {r} residual_out")
        check(assert_within_ulp, fused[r]["out"], fused[r]["out_ref"], out_ulp_tolerance(dtype, 40),
              f"rank {r} out")
        check(assert_same_bits, ar[r]["y"], ar[r]["ref"], f"rank {r} all_reduce")
    check.done()


def test_scalar_and_one_dimensional_inputs(pool):
    """``all_reduce`` of a 0-dim tensor; ``fused_add_rmsnorm`` of a 1-D ``(H,)`` row."""
    results = pool.run(ranks.odd_shapes_case)
    check = Checks()
    for r, res in enumerate(results):
        check(assert_same_bits, res["y"], res["y_ref"], f"rank {r} 0-dim all_reduce")
        check(assert_same_bits, res["residual_out"], res["residual_out_ref"], f"rank {r} 1-D residual_out")
        check(assert_within_ulp, res["out"], res["out_ref"], 1, f"rank {r} 1-D out")
    check.done()


def test_subgroup(pool3):
    """A Communicator on ranks {1, 2} of 3: group ranks (0, 1) differ from global ones; rank 0 is not
    in it and never calls."""
    results = pool3.run(ranks.subgroup_case, [1, 2])
    check = Checks()
    check.that("not a member of group" in results[0], f"rank 0, not a member: {results[0]}")
    for r in (1, 2):
        res = results[r]
        check.that(res["group_rank"] == r - 1 and res["uses_kernels"],
                   f"rank {r}: group rank {res['group_rank']}, kernels {res['uses_kernels']}")
        check(assert_same_bits, res["y"], res["s_ref"], f"rank {r} all_reduce")
        check(assert_same_bits, res["residual_out"], res["residual_out_ref"], f"rank {r} residual_out")
        check(assert_within_ulp, res["out"], res["out_ref"], 1, f"rank {r} out")
    check.done()


def test_single_rank_group(pool2):
    """A group of one rank: no communication (fallback), and still the contract's bits."""
    results = pool2.run(ranks.single_rank_group_case)
    res = results[0]
    check = Checks()
    check.that(results[1] is None, "rank 1 is not a member")
    check.that(not res["uses_kernels"], f"a group of one uses kernels? {res['reason']}")
    check(assert_same_bits, res["y"], res["y_ref"], "all_reduce over one rank")
    check.that(int(bits(res["y"])[0]) == 0, f"-0.0 alone gave bits {int(bits(res['y'])[0]):#x}, not +0.0")
    check(assert_same_bits, res["residual_out"], res["residual_out_ref"], "residual_out over one rank")
    check.done()


#: Grid caps per rank (TPCOMM_MAX_PROGRAMS; None: the default of 4 on CPU), including ranks that ask for
#: different caps (set-up must agree on the smallest, or the ranks would wait for programs never run).
GRIDS = [(None, None, None), (1, 1, 1), (3, 3, 3), (1, 3, None)]


@pytest.mark.parametrize("algo,dtype", ALGO_LAYOUT_DTYPES)
def test_grid_size_never_changes_a_bit(pool, algo, dtype):
    """The contract holds for every grid: 9 rows under grid caps 4, 1, 3 and mixed give the same bits."""
    runs = [pool.run(ranks.grid_case, 1250, (9, 300), dtype, g[:pool.world_size], algo=algo) for g in GRIDS]
    check = Checks()
    for g, results in zip(GRIDS, runs):
        want = min(p if p is not None else 4 for p in g[:pool.world_size])
        for r, res in enumerate(results):
            check.that(res["max_programs"] == want, f"caps {g}: rank {r} runs {res['max_programs']} programs, "
                                                    f"expected the smallest cap {want}")
            check(assert_same_bits, res["s"], res["s_ref"], f"caps {g}: rank {r} all_reduce")
            for name in ("out", "residual_out"):
                check(assert_same_bits, res[name], runs[0][0][name], f"caps {g}: rank {r} {name} vs default grid")
    check.done()


def test_two_shot_doubled_grid_never_changes_a_bit(pool):
    """Two-shot on rows of one tile of 4096+ elements launches up to twice the grid cap (8-warp programs,
    ``dispatch.row_config``): 9 rows of 2500 bf16 under caps 4, 1, 3 and mixed give the bits of one-shot
    at the default cap (the all-reduce too: its flat rows are 4096 wide)."""
    shape, W = (9, 2500), pool.world_size
    ref = pool.run(ranks.grid_case, 1251, shape, torch.bfloat16, (None,) * W, algo="one_shot")[0]
    check = Checks()
    for g in GRIDS:
        for r, res in enumerate(pool.run(ranks.grid_case, 1251, shape, torch.bfloat16, g[:W], algo="two_shot")):
            check(assert_same_bits, res["s"], res["s_ref"], f"caps {g}: rank {r} all_reduce")
            for name in ("out", "residual_out"):
                check(assert_same_bits, res[name], ref[name], f"caps {g}: rank {r} {name} vs one-shot")
    check.done()


@pytest.mark.parametrize("env,max_bytes,words", [({"TPCOMM_ALGO": "bogus"}, None, "TPCOMM_ALGO"),
                                                  ({"TPCOMM_MAX_PROGRAMS": "0"}, None, "TPCOMM_MAX_PROGRAMS"),
                                                  ({"TPCOMM_MAX_PROGRAMS": "100000000"}, None, "TPCOMM_MAX_PROGRAMS"),
                                                  (None, -5, "max_bytes")],
                         ids=["algo", "programs", "programs_huge", "max_bytes"])
@pytest.mark.parametrize("first", [False, True], ids=["last_rank", "rank0"])
def test_a_rank_that_refuses_its_set_up_stops_every_rank(pool, env, max_bytes, words, first):
    """A bad variable or argument on one rank only (the last, or rank 0): that rank raises its own error,
    every other rank a ValueError naming it, at once (none waits in a set-up collective for it)."""
    bad = 0 if first else pool.world_size - 1
    results = pool.run(ranks.refused_setup_case, bad, env, max_bytes)
    check = Checks()
    for r, res in enumerate(results):
        check.that(res is not None, f"rank {r}: the Communicator was created")
        if res is None:
            continue
        kind, message, seconds = res
        check.that(words in message, f"rank {r}: {kind}: {message!r} does not name {words}")
        check.that(r == bad or f"rank {bad}" in message, f"rank {r}: {message!r} does not name rank {bad}")
        check.that(seconds < 20, f"rank {r}: raised after {seconds:.1f} s")
    check.done()


def test_use_algorithm_reads_names_as_the_environment_does(pool2):
    """``use_algorithm(" One_Shot ")`` forces one-shot, as ``TPCOMM_ALGO=" One_Shot "`` would."""
    results = pool2.run(ranks.use_algorithm_spelling_case, " One_Shot ")
    assert all(res == "one_shot" for res in results), results


@pytest.mark.parametrize("late_s", [None, 2.5], ids=["never", "late"])
def test_construction_is_bounded_by_timeout_s(pool2, late_s):
    """A rank that never creates the communicator, or creates it after its peer's ``timeout_s`` (1 s): rank 0
    raises ``SetupTimeoutError`` naming rank 1 within the timeout and a margin (not at torch.distributed's
    own timeout); the late rank raises it too (naming rank 1 when it joined the attempt rank 0 gave up on,
    rank 0 when it came after and waited for rank 0's next one); a new communicator on every rank then
    works."""
    results = pool2.run(ranks.setup_timeout_case, late_s)
    check = Checks()
    for r, res in enumerate(results):
        got = res["outcome"]
        if r == 1 and late_s is None:
            check.that(got == "no call", f"rank 1: {got}")
        else:
            check.that(isinstance(got, dict) and "did not create" in got["message"], f"rank {r}: {got}")
            check.that(r == 1 or got["missing"] == [1], f"rank {r}: {got}")
        check.that(res["after"] == [2.0] * 4, f"rank {r}: the next communicator's all-reduce gave {res['after']}")
    # 10 s: the 1 s timeout plus the store's round trips on 2 busy cores
    check.that(results[0]["seconds"] < 10, f"rank 0 raised after {results[0]['seconds']:.1f} s")
    check.done()


def test_use_algorithm_checks_the_name_at_the_call(pool2):
    """A bad name raises at ``use_algorithm(...)`` itself, not only when a ``with`` block is entered; a valid
    name outside a ``with`` forces nothing."""
    for r, res in enumerate(pool2.run(ranks.use_algorithm_checked_at_call_case)):
        assert res["raised"] and "warp_speed" in res["raised"] and "use_algorithm" in res["raised"], (r, res)
        assert res["after"] == "auto", (r, res)


def test_plan_of_the_qk_norm_and_the_moe_finalize(pool2):
    """``comm.plan`` answers for the two fused ops: the MoE finalize takes the fused norm's algorithm (the
    finalize in the prologue, or the standalone finalize first under two-shot), the QK norm its one kernel
    (one launch here) or the fallback when forced (no kernel but the signature checks)."""
    check = Checks()
    for r, res in enumerate(pool2.run(ranks.fused_op_plans_case)):
        for forced, got in res.items():
            check.that(got["moe"][0] == got["fused"], f"rank {r} {forced}: moe plan {got['moe']} vs {got['fused']}")
            want_qk = "fallback" if forced == "fallback" else "lamport"
            check.that(got["qk"][0] == want_qk, f"rank {r} {forced}: qk plan {got['qk']}")
        check.that("prologue" in res["auto"]["moe"][1], f"rank {r}: {res['auto']['moe']}")
        check.that("standalone finalize kernel" in res["two_shot"]["moe"][1], f"rank {r}: {res['two_shot']['moe']}")
        check.that("1 launch)" in res["auto"]["qk"][1], f"rank {r}: {res['auto']['qk']}")
        check.that(res["auto"]["qk launches"] == 1, f"rank {r}: {res['auto']['qk launches']} launches")
        check.that(res["two_shot"]["qk launches"] == 1 and "two_shot forced" in res["two_shot"]["qk"][1],
                   f"rank {r}: {res['two_shot']}")
        # the fallback: the call's signature launch, then the all-reduce of the (T, 2) partial sums, itself
        # a fallback call with its own signature launch
        check.that(res["fallback"]["qk launches"] == 2, f"rank {r}: {res['fallback']['qk launches']} launches")
    check.done()


def test_timeout_from_environment(pool2):
    """TPCOMM_TIMEOUT_S sets the kernels' timeout when timeout_s is not given."""
    results = pool2.run(ranks.env_timeout_case, "2.5")
    check = Checks()
    for r, res in enumerate(results):
        check.that(res["timeout_s"] == 2.5 and res["workspace_timeout_s"] == 2.5,
                   f"rank {r}: timeout_s {res['timeout_s']}, workspace's {res['workspace_timeout_s']}")
    check.done()


# -- chunking and batch invariance -------------------------------------------------------------------------------
#: (op, dtype, shape, max_bytes): messages several times larger than one launch can carry. H = 300 rows
#: take 608 bytes (bf16) or 1216 (fp32) in a slot, so 4096 bytes carry 6 or 3 rows; H = 2047 carries
#: exactly one bf16 row; a flat all_reduce row is 4096 elements (8 KiB bf16), so 16 KiB carries 2.
CHUNKED = [
    ("fused_add_rmsnorm", torch.bfloat16, (13, 300), 4096),
    ("fused_add_rmsnorm", torch.float16, (13, 300), 4096),
    ("fused_add_rmsnorm", torch.float32, (7, 300), 4096),
    ("fused_add_rmsnorm", torch.bfloat16, (3, 2047), 4096),
    ("all_reduce", torch.bfloat16, (5 * 4096 + 3,), 16384),
    ("all_reduce", torch.float32, (3 * 4096 + 3,), 16384),
]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("op,dtype,shape,max_bytes", CHUNKED,
                         ids=[f"{c[0]}-{dtype_name(c[1])}-{c[2]}" for c in CHUNKED])
def test_chunked_equals_whole(pool, algo, op, dtype, shape, max_bytes):
    """A communicator with a small ``max_bytes`` runs the call in several launches (counted by its
    epoch, which advances once per launch); the bits equal those of one launch and the reference."""
    results = pool.run(ranks.chunked_vs_whole, 1000 + shape[0], shape, dtype, max_bytes, op, algo=algo)
    check = Checks()
    for r, res in enumerate(results):
        per, rows = res["rows_per_launch"], res["rows"]
        check.that(res["plan_small"] != "fallback" and res["plan_whole"] != "fallback",
                   f"rank {r}: plans {res['plan_small']!r} / {res['plan_whole']!r}: the case does not run kernels")
        check.that(0 < per < rows and res["expected_launches"] > 1,
                   f"rank {r}: {per} rows per launch for {rows} rows: the case does not chunk")
        if per > 0:
            check.that(res["launches"] == res["expected_launches"],
                       f"rank {r}: {res['launches']} launches (epoch steps), expected {res['expected_launches']}")
        chunked, whole = res["chunked"], res["whole"]
        check(assert_same_bits, chunked[0], whole[0], f"rank {r} {op} output, chunked vs whole")
        if chunked[1] is not None:
            check(assert_same_bits, chunked[1], whole[1], f"rank {r} residual_out, chunked vs whole")
        if op == "all_reduce":
            check(assert_same_bits, chunked[0], res["ref"], f"rank {r} all_reduce vs reference")
    check(assert_ranks_identical, [res["chunked"][0] for res in results], "chunked output")
    check.done()


def test_fused_row_wider_than_max_bytes_is_still_right(pool2):
    """A row that does not fit one slot (2880 bf16 = 5760 bytes > 4096) cannot be chunked by rows; the
    call must still meet the contract (whatever path it takes)."""
    results = pool2.run(ranks.small_slot_case, "fused_add_rmsnorm", (2, 2880), torch.bfloat16, 4096)
    check = Checks()
    for r, res in enumerate(results):
        check(assert_same_bits, res["residual_out"], res["residual_out_ref"], f"rank {r} residual_out")
        check(assert_within_ulp, res["out"], res["out_ref"], 1, f"rank {r} out")
    check.done()


def test_all_reduce_chunks_with_a_small_max_bytes(pool2):
    """DESIGN.md, Chunking: messages larger than the workspace go through the same kernels in pieces,
    "no switch to another library within a node". A plain all_reduce is elementwise, so no row width
    forces it out of the kernels: with max_bytes = 4096, 5000 bf16 elements must still run a kernel."""
    results = pool2.run(ranks.small_slot_case, "all_reduce", (5000,), torch.bfloat16, 4096)
    check = Checks()
    for r, res in enumerate(results):
        check(assert_same_bits, res["y"], res["ref"], f"rank {r} all_reduce")
        check.that(res["plan"] != "fallback", f"rank {r}: all_reduce of 5000 bf16 with max_bytes=4096 "
                                              f"planned {res['plan']!r}: torch.distributed, not chunked kernels")
    check.done()


@pytest.mark.parametrize("max_bytes", [None, 4096], ids=["one_launch", "chunked"])
@pytest.mark.parametrize("algo,dtype", ALGO_LAYOUT_DTYPES)
def test_batch_invariance(pool, algo, dtype, max_bytes):
    """Rows 0..n-1 run alone give the bits they have inside the 9-row call (9 rows: the CPU grid of 4
    programs gives program 0 rows 0, 4 and 8; 5 rows alone give it rows 0 and 4), for fused out,
    residual_out and all_reduce."""
    full, prefixes = 9, [1, 5]
    results = pool.run(ranks.fused_rows, 1100, (full, 300), dtype, [full] + prefixes,
                       max_bytes=max_bytes, algo=algo)
    check = Checks()
    for r, runs in enumerate(results):
        for n in prefixes:
            for name in ("out", "residual_out", "s"):
                check(assert_same_bits, runs[n][name], runs[full][name][:n],
                      f"rank {r}: {name} of the first {n} rows alone vs inside {full} rows")
    check.done()


# -- fallback --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 123), (1, 2880)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=dtype_name)
def test_fallback_env_matches_kernels(pool, dtype, shape):
    """``TPCOMM_ALGO=fallback`` (torch.distributed) gives the kernels' bits for all_reduce and
    residual_out, and out within the ulp tolerance (the mean's summation order differs)."""
    results = pool.run(ranks.fallback_env_case, 1200, shape, dtype)
    check = Checks()
    for r, res in enumerate(results):
        check.that(res["fb_plan"] == "fallback", f"rank {r}: TPCOMM_ALGO=fallback planned {res['fb_plan']!r}")
        check.that(not res["fb_uses_kernels"] and res["kern_uses_kernels"],
                   f"rank {r}: uses_kernels {res['fb_uses_kernels']} with TPCOMM_ALGO=fallback, "
                   f"{res['kern_uses_kernels']} without")
        check.that("fallback (TPCOMM_ALGO=fallback" in res["fb_repr"], f"rank {r}: repr {res['fb_repr']}")
        check.that(res["kern_plan"] != "fallback", f"rank {r}: the kernel communicator planned a fallback")
        check(assert_same_bits, res["fb_ar"], res["kern_ar"], f"rank {r} all_reduce, fallback vs kernel")
        check(assert_same_bits, res["fb_fused"][1], res["kern_fused"][1], f"rank {r} residual_out, fallback vs kernel")
        check(assert_within_ulp, res["fb_fused"][0], res["kern_fused"][0], out_ulp_tolerance(dtype, shape[-1]),
              f"rank {r} out, fallback vs kernel")
    check.done()


@pytest.mark.parametrize("algo", ["fallback", "auto"])
def test_inputs_that_require_grad(pool2, algo):
    """Inputs that require grad give the same bits through the fallback as through the kernels, and no
    output requires grad (docs/api.md); an all-reduce into a strided view of a parameter, or of a tensor
    made in inference mode, works on both paths."""
    got = {a: pool2.run(ranks.requires_grad_case, 1300, (4, 96), torch.bfloat16, a) for a in {algo, "auto"}}
    check = Checks()
    for r, res in enumerate(got[algo]):
        check.that((res["plan"] == "fallback") == (algo == "fallback"), f"rank {r}: planned {res['plan']!r}")
        for op, flags in res["grad"].items():
            check.that(not any(flags), f"rank {r} {op}: an output requires grad")
            for i, (a, b) in enumerate(zip(res["values"][op], got["auto"][r]["values"][op])):
                if op == "fused" and i == 0:  # out: the mean's summation order differs (fallback test above)
                    check(assert_within_ulp, a, b, out_ulp_tolerance(torch.bfloat16, 96), f"rank {r} fused out")
                else:
                    check(assert_same_bits, a, b, f"rank {r} {op}: {algo} against the kernels")
    check.done()


# -- repeated calls, skew --------------------------------------------------------------------------------------
#: Back-to-back calls: enough to cycle SOAK_STEPS three times, so every parity of the signal pad and of the
#: Lamport buffers is reused many times with different shapes and grids.
SOAK_CALLS = 21


def _check_soak(results, check):
    for r, report in enumerate(results):
        bad = [step[:4] for step in report if not step[4]]
        check.that(not bad, f"rank {r}: wrong result at steps {bad}")
    for i in range(len(results[0])):
        digests = [report[i][5] for report in results]
        check.that(len(set(digests)) == 1, f"step {results[0][i][:4]}: ranks disagree")


@pytest.mark.parametrize("algo", ["auto", "one_shot"])
def test_repeated_calls(pool, algo):
    """21 calls back to back, alternating ops, sizes and dtypes (under auto: Lamport for 16-bit and
    one-shot for fp32, interleaved on one epoch counter); every result right and identical on every
    rank."""
    results = pool.run(ranks.soak, 1300, SOAK_CALLS, algo=None if algo == "auto" else algo)
    check = Checks()
    check.that(all(len(rep) == SOAK_CALLS for rep in results), "a rank reported fewer steps")
    _check_soak(results, check)
    check.done()


#: Largest per-call delay of a rank: several times a call's own duration under the interpreter
#: (10-60 ms), so ranks arrive in every order.
MAX_SKEW_S = 0.08


def test_rank_skew(pool):
    """Each rank sleeps a different random time before every call: late and early peers alike (both
    algorithms, interleaved, under auto)."""
    results = pool.run(ranks.soak, 1400, SOAK_CALLS, max_skew_s=MAX_SKEW_S)
    check = Checks()
    _check_soak(results, check)
    check.done()


# -- life cycle ------------------------------------------------------------------------------------------------
def test_close_is_idempotent_and_final(pool):
    """close() twice is fine; any call afterwards raises RuntimeError naming the op; the context
    manager closes too."""
    results = pool.run(ranks.life_cycle_case)
    check = Checks()
    expected = torch.full((8,), float(pool.world_size))
    for r, res in enumerate(results):
        check.that(res["uses_kernels"], f"rank {r}: the communicator fell back")
        check(assert_same_bits, res["y"], expected, f"rank {r}: all_reduce before close")
        check(assert_same_bits, res["y2"], expected, f"rank {r}: all_reduce in the with block")
        for key, op in (("all_reduce_after_close", "all_reduce"), ("fused_after_close", "fused_add_rmsnorm"),
                        ("ctx_closed", "all_reduce")):
            seen = res[key]
            check.that(seen is not None and seen[0] == "RuntimeError" and op in seen[1],
                       f"rank {r}: {key}: {seen}, expected RuntimeError naming {op}")
    check.done()


def test_plan_refuses_bad_arguments(pool2):
    """``Communicator.plan`` names the argument: ValueError for an unknown op or a negative size,
    TypeError for a size that is not an int or a dtype that is not a torch.dtype."""
    want = {"op": ("ValueError", "op"), "negative nbytes": ("ValueError", "nbytes"),
            "float nbytes": ("TypeError", "nbytes"), "bool hidden": ("TypeError", "hidden"),
            "dtype name": ("TypeError", "dtype")}
    for r, seen in enumerate(pool2.run(ranks.plan_arguments_case)):
        assert seen["good"] == "lamport", f"rank {r}: {seen['good']}"
        for name, (kind, arg) in want.items():
            got = seen[name]
            assert got is not None and got[0] == kind and got[1].startswith(f"plan: {arg}"), f"rank {r}: {name}: {got}"


def test_the_process_group_is_not_kept_alive():
    """A communicator holds its group weakly: ``destroy_process_group`` frees it even while the
    communicator is open (a gloo group freed only at interpreter exit could abort the process there), and
    a call that would use the destroyed group raises RuntimeError instead of using the default one."""
    from tpcomm.launch import launch

    for r, (freed, seen_group, seen_fallback) in enumerate(launch(ranks.launch_group_outlives_no_communicator, 2,
                                                                  "cpu", timeout_s=120)):
        assert freed, f"rank {r}: the destroyed group is still alive"
        for seen in (seen_group, seen_fallback):
            assert seen is not None and seen[0] == "RuntimeError" and "destroyed" in seen[1], f"rank {r}: {seen}"


# -- peer timeouts ---------------------------------------------------------------------------------------------
#: A short kernel timeout (wall-clock nanoseconds, the host's clock under the interpreter).
TIMEOUT_S = 0.15
#: How long the call may take to raise: the grace (at least 0.5 s under the interpreter, sync.grace_ns),
#: then 10x the timeout, room for the call's own work and a busy 2-core machine running 3 ranks; much more
#: and a CPU rank with the default 30 s timeout would hang for minutes before it says why.
TIMEOUT_BOUND_S = 0.5 + 10 * TIMEOUT_S


@pytest.mark.parametrize("op", ["all_reduce", "fused_add_rmsnorm"])
@pytest.mark.parametrize("algo", ALGOS)
def test_peer_timeout_names_the_missing_peer(pool, algo, op):
    """Rank 1 skips a call: every other rank's call raises PeerTimeoutError with ``peer == 1``, soon;
    the communicator stays unusable (the next call raises it again); a new communicator works."""
    results = pool.run(ranks.peer_timeout_case, TIMEOUT_S, op, (1, 64), torch.bfloat16, algo=algo)
    check = Checks()
    total = float(sum(range(1, pool.world_size + 1)))
    for r, res in enumerate(results):
        check.that(bool((res["after"] == total).all()), f"rank {r}: a new communicator's all_reduce is wrong")
        if r == 1:
            continue
        seen = res["seen"]
        check.that(seen is not None and seen["type"] == "PeerTimeoutError",
                   f"rank {r}: raised {seen}, expected PeerTimeoutError")
        if seen and seen["type"] == "PeerTimeoutError":
            check.that(seen["peer"] == 1 and seen["rank"] == r and seen["op"] == op,
                       f"rank {r}: peer={seen['peer']} rank={seen['rank']} op={seen['op']!r}")
            check.that("rank 1" in seen["message"], f"rank {r}: message does not name rank 1: {seen['message']}")
        check.that(res["elapsed"] < TIMEOUT_BOUND_S,
                   f"rank {r}: {algo} took {res['elapsed']:.2f} s to give up on a {TIMEOUT_S} s timeout "
                   f"(bound {TIMEOUT_BOUND_S} s)")
        check.that(res["again"] is not None and res["again"][0] == "PeerTimeoutError",
                   f"rank {r}: the call after a timeout raised {res['again']}")
    check.done()


#: Rows of the call in the test below: 4 rows per program on the CPU grid of 4 programs.
TIMEOUT_ROWS = 16
#: The timeout there: long against the rows' own work, so 15 extra waits (3.75 s) stand out.
ROWS_TIMEOUT_S = 0.25
#: Time allowed for the extra rows' own work under the interpreter, with room for a busy machine (0.55 s
#: was seen at the end of a full suite on 2 cores).
ROWS_WORK_S = 1.0


@pytest.mark.parametrize("algo", ALGOS)
def test_peer_timeout_does_not_add_up_per_row(pool2, algo):
    """A missing peer costs one timeout, not one per row: once a wait has expired the launch is lost,
    so later waits must not wait again. (The interpreter runs the grid's programs one after another;
    up to one timeout per program is allowed for that, on a GPU they overlap.)"""
    one = pool2.run(ranks.peer_timeout_case, ROWS_TIMEOUT_S, "fused_add_rmsnorm", (1, 64),
                    torch.bfloat16, algo=algo)
    many = pool2.run(ranks.peer_timeout_case, ROWS_TIMEOUT_S, "fused_add_rmsnorm", (TIMEOUT_ROWS, 64),
                     torch.bfloat16, algo=algo)
    grid = min(TIMEOUT_ROWS, many[0]["max_programs"])
    t1, tn = one[0]["elapsed"], many[0]["elapsed"]
    bound = t1 + grid * ROWS_TIMEOUT_S + ROWS_WORK_S
    check = Checks()
    for res in (one[0], many[0]):
        check.that(res["seen"] is not None and res["seen"].get("peer") == 1, f"rank 0 saw {res['seen']}")
    check.that(tn <= bound, f"{algo}: {TIMEOUT_ROWS} rows took {tn:.2f} s to time out, one row {t1:.2f} s: "
                            f"waits add up per row (bound {bound:.2f} s)")
    check.done()


def test_max_bytes_is_rounded_up_to_what_a_slot_holds(pool2):
    """max_bytes is rounded up to a multiple of 256 bytes at creation (docs/api.md): ranks that pass 300
    and 512 make the same workspace and are not refused, and a 512-byte row runs a kernel."""
    for r, res in enumerate(pool2.run(ranks.max_bytes_rounding_case)):
        assert res["max_bytes"] == 512 and res["plan"] != "fallback", (r, res)
