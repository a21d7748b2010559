"""Fused FP8 output of ``Communicator.fused_add_rmsnorm(..., quant=...)`` (docs/numerics.md numerics
contract item 4, and "Quantised output forms" for ``fp8_per_group_ue8m0`` and ``fp8_static``) on CPU ranks
(world sizes 2 and 3, Triton's interpreter).

For every case: the FP8 bytes and the scale bits equal the standalone Triton quant (``tpcomm.quant``) and
the plain-torch quant (``tpcomm.reference``) of the unquantised ``out`` (of the same call when it is
emitted, and of the same call without ``quant``); the emitted ``out`` and ``residual_out`` equal the
call without ``quant`` bit for bit; every rank holds the same bytes; dequantised values lie within one
FP8 step of the float32 reference; and the scale rules hold (zeros: scale 1; a NaN: scale NaN and NaN
bytes; the row's (group's) amax: byte +-MAX). The static form returns its input scale as the scales,
and its bytes equal ``static_quant_fp8`` and ``static_fp8_quant_reference`` of ``out``.

The interpreter is slow, so the dimensions (algorithm, dtype, format, per-token / per-group / column-major,
residual, Gemma, emit_unquantized, world size) are covered by a handful of combinations in which every
value of every dimension occurs with every algorithm, not by their product. Realistic shapes run on
GPUs: ``tests/quant/test_gpu_fused_fp8.py``.
"""

import re

import pytest
import torch

from tests.quant import ranks as fc
from tests.quant.ranks import Fp8Case
from tests.support.numerics import Checks, assert_same_bits, assert_same_values, dtype_name

#: NaN rows divide NaN by NaN, and the squares of huge rows overflow, in the interpreter's numpy on purpose.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
TOK, GRP, UE8, STATIC = "fp8_per_token", "fp8_per_group", "fp8_per_group_ue8m0", "fp8_static"


def _c(seed, algo, dtype, fp8, mode, residual, gemma, emit, shape, group=32, **kw):
    """A case from a row of the tables below; ``mode`` is ``tok``, ``row`` or ``col`` (per group),
    ``ue8`` or ``ue8col`` (per group, power-of-two scales), ``static`` (pass ``scale``)."""
    quant = (TOK if mode == "tok" else UE8 if mode.startswith("ue8") else STATIC if mode == "static"
             else GRP)
    return Fp8Case(seed=seed, shape=shape, dtype=dtype, algo=algo, quant=quant, fp8=fp8, group=group,
                   column_major=mode.endswith("col"), residual=residual, gemma=gemma, emit=emit, **kw)


# (world, case). Each algorithm meets both formats, both world sizes, with and without residual, Gemma and
# emit_unquantized; its dtypes (Lamport: 16-bit only); and each format meets every scale layout. Rows
# marked special carry zeros, a dominant element, a NaN and huge values (fc.special_inputs);
# a float32 norm weight with bf16 input once; 3-D inputs (B, S, H) three times.
MATRIX = [
    (2, _c(1, "lamport", BF16, FN, "tok", True, False, True, (5, 64), special=True)),
    (3, _c(2, "lamport", FP16, FNUZ, "row", False, True, False, (4, 96))),
    (3, _c(3, "lamport", BF16, FNUZ, "col", True, True, True, (4, 128), group=128, w_dtype=FP32)),
    (2, _c(4, "one_shot", FP32, FN, "col", False, False, True, (4, 96))),
    (3, _c(5, "one_shot", BF16, FNUZ, "tok", True, True, False, (5, 128), special=True)),
    (2, _c(6, "one_shot", FP16, FN, "row", True, False, True, (2, 3, 64), group=16)),
    (3, _c(7, "two_shot", FP32, FNUZ, "tok", True, False, True, (4, 64))),
    (2, _c(8, "two_shot", BF16, FN, "row", False, True, True, (3, 2, 128), group=64)),
    (3, _c(9, "two_shot", FP16, FNUZ, "col", True, True, False, (5, 96), special=True)),
    (3, _c(10, "fallback", FP16, FN, "tok", False, True, True, (5, 96), special=True)),
    (2, _c(11, "fallback", FP32, FNUZ, "row", True, False, False, (2, 2, 64))),
    (2, _c(12, "fallback", BF16, FN, "col", True, True, True, (4, 128))),
    # power-of-two (UE8M0) group scales in every algorithm
    (2, _c(13, "lamport", BF16, FN, "ue8", True, False, True, (5, 128), special=True)),
    (3, _c(14, "one_shot", FP32, FNUZ, "ue8col", True, True, False, (4, 96))),
    (2, _c(15, "two_shot", FP16, FN, "ue8", False, False, True, (5, 64), group=16, special=True)),
    (3, _c(16, "fallback", BF16, FN, "ue8col", True, False, False, (4, 128), group=128)),
]

#: Small max_bytes: 256 bytes carry 2 rows of 64 bf16 (1 of fp32) per one-shot or Lamport launch and 1
#: row of each share per two-shot launch, so 5 rows take 2 to 5 launches, and the scale pointer of each
#: launch starts at its first row (in the column-major layout too).
CHUNK_MAX_BYTES = 256
CHUNKED = [
    (2, _c(21, "lamport", BF16, FN, "col", True, False, True, (5, 64), group=16, max_bytes=CHUNK_MAX_BYTES)),
    (3, _c(22, "one_shot", FP32, FNUZ, "tok", False, False, False, (5, 64), max_bytes=CHUNK_MAX_BYTES)),
    (3, _c(23, "one_shot", BF16, FNUZ, "col", True, True, False, (5, 64), max_bytes=CHUNK_MAX_BYTES)),
    (2, _c(24, "two_shot", FP16, FN, "row", True, False, True, (5, 64), group=16, max_bytes=CHUNK_MAX_BYTES)),
    (3, _c(25, "two_shot", BF16, FNUZ, "col", False, False, False, (5, 64), max_bytes=CHUNK_MAX_BYTES)),
]

#: Rows wider than one tile (8320 > dispatch.MAX_BLOCK_H = 8192: two tiles). Per token, the scale needs
#: the whole row before any byte: the first pass finds the largest |v * w'| (``epilogue.out_amax``).
#: Without a residual the first pass parks ``s`` in ``out``. ``peak`` puts every row's amax in the second tile.
WIDE = [
    (2, _c(31, "lamport", BF16, FN, "tok", False, False, False, (2, 8320), peak=True)),
    (2, _c(32, "two_shot", FP32, FNUZ, "col", True, False, True, (2, 8320), group=128, peak=True)),
    (2, _c(33, "one_shot", BF16, FN, "tok", False, False, False, (2, 8320), tiny=True, eps=0.0)),
    (2, _c(36, "one_shot", FP32, FN, "tok", True, True, False, (2, 8320), peak=True)),
]

#: ``eps`` 0 and rows whose squares underflow (``Fp8Case.tiny``): the norm's inverse is +Inf, where the
#: epilogue finds the amax from ``out`` itself. Rows of one tile here; of two tiles in ``WIDE``.
TINY = [
    (2, _c(34, "lamport", BF16, FN, "tok", True, True, True, (3, 64), tiny=True, eps=0.0)),
    (3, _c(35, "two_shot", FP32, FNUZ, "tok", True, False, False, (3, 96), tiny=True, eps=0.0)),
]

#: Static per-tensor FP8 (``quant="fp8_static"``, one calibrated input scale): every algorithm at both
#: world sizes, both formats, each scale shape; scales of 0.002 to 0.01 saturate the larger elements of
#: ``out`` (|out| above 0.9 to 4.5 for e4m3fn) and give the small ones FP8 subnormals. Chunked calls
#: (Lamport, whose launches take the scale pointer of their first row, and two-shot), 3-D and two-tile
#: rows; ``repeat`` also checks repeated calls with a new scale tensor and a new value in it.
STATIC_CASES = [
    (3, _c(41, "lamport", BF16, FN, "static", True, False, True, (4, 64), special=True, scale=0.005, repeat=True)),
    (2, _c(42, "lamport", FP16, FNUZ, "static", False, True, False, (3, 64), scale=0.01, scale_shape=(1,),
           max_bytes=CHUNK_MAX_BYTES)),
    (3, _c(43, "one_shot", FP16, FNUZ, "static", True, True, True, (4, 96), special=True, scale=0.004,
           scale_shape=(1, 1))),
    (2, _c(44, "one_shot", BF16, FN, "static", False, False, False, (2, 8320), peak=True, scale=0.002,
           repeat=True)),
    (2, _c(45, "two_shot", FP32, FN, "static", True, False, True, (3, 2, 64), scale=0.008, scale_shape=(1,),
           repeat=True)),
    (3, _c(46, "two_shot", BF16, FN, "static", False, False, True, (4, 64), scale=0.003,
           max_bytes=CHUNK_MAX_BYTES)),
    (2, _c(47, "fallback", BF16, FNUZ, "static", True, True, True, (5, 96), special=True, scale=0.006,
           repeat=True)),
    (3, _c(48, "fallback", FP32, FN, "static", True, False, False, (3, 64), scale=0.01, scale_shape=(1, 1))),
]


def case_id(world, case):
    shape = "x".join(map(str, case.shape))
    mode = ("tok" if case.quant == TOK else f"static{case.scale}" if case.quant == STATIC
            else ("col" if case.column_major else "row") + str(case.group))
    flags = "".join(f for f, on in (("-res", case.residual), ("-gemma", case.gemma), ("-emit", case.emit),
                                   ("-special", case.special), ("-peak", case.peak),
                                   ("-tiny", case.tiny), ("-wild", case.wild_weight),
                                   ("-tinygroup", case.tiny_group)) if on)
    return (f"w{world}-{case.algo}-{dtype_name(case.dtype)}-{str(case.fp8).replace('torch.float8_', '')}-"
            f"{mode}-{shape}{flags}")


def _u8_equal(check, got, want, what):
    """Bytes equal (uint8 views, same shape)."""
    if got.shape != want.shape:
        check.that(False, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    diff = got != want
    first = diff.nonzero()[:4].tolist()
    check.that(not diff.any(), f"{what}: {int(diff.sum())} bytes differ, first at {first}: "
                               f"{got[diff][:4].tolist()} vs {want[diff][:4].tolist()}")


def _scales_equal(check, got, want, what):
    check.that(got.stride() == want.stride(), f"{what}: strides {got.stride()} != {want.stride()}")
    check(assert_same_bits, got, want, what)


def expected_scales_shape(case):
    lead = case.shape[:-1]
    if case.quant == STATIC:
        return case.scale_shape
    return (*lead, 1) if case.quant == TOK else (*lead, case.shape[-1] // case.group)


def check_static(check, p, case, res, q2):
    """The static form's own checks: the returned scale is the input tensor; with ``repeat``, the bytes of
    repeated calls (another scale tensor, then the same one with a new value) follow the scale given; NaN
    bytes exactly where ``out`` is NaN and +-MAX wherever ``|out| / scale`` is past MAX; dequantised
    values within one FP8 step of the float32 reference clamped to the range the scale covers."""
    check.that(res["scale_is_input"], f"{p}: the returned scales are not the input scale tensor")
    for k, (got, want) in enumerate(zip(res.get("again", []), res.get("again_ref", []))):
        _u8_equal(check, got, want, f"{p}: repeated call {k + 1} (new scale value) vs the torch quant")
    H = case.shape[-1]
    for failure in fc.static_rule_failures(q2, res["plain_out"].reshape(-1, H), case.scale, case.fp8):
        check.that(False, f"{p}: {failure}")
    limit = torch.finfo(case.fp8).max * case.scale
    s2 = torch.full((q2.shape[0], 1), case.scale, dtype=torch.float32)
    failure = fc.dequantised_failure(q2, s2, res["y32"].reshape(-1, H).clamp(-limit, limit), case.fp8)
    check.that(failure is None, f"{p}: {failure}")


def check_fp8_case(case, results):
    check = Checks()
    H = case.shape[-1]
    algo = case.algo
    for r, res in enumerate(results):
        p = f"rank {r}"
        check.that(res["plan"] == algo, f"{p}: plan {res['plan']!r}, expected {algo!r}")
        check.that(res["q_dtype"] == case.fp8, f"{p}: q has dtype {res['q_dtype']}")
        check.that(tuple(res["q"].shape) == tuple(case.shape), f"{p}: q has shape {tuple(res['q'].shape)}")
        s = res["scales"]
        check.that(tuple(s.shape) == expected_scales_shape(case) and s.dtype == torch.float32,
                   f"{p}: scales {s.dtype} {tuple(s.shape)}, expected float32 {expected_scales_shape(case)}")
        if case.column_major:
            check.that(s.stride() == (1, case.shape[0]),
                       f"{p}: column-major scales have strides {s.stride()}")
        if case.emit:
            check.that(res["out"] is not None, f"{p}: emit_unquantized=True but out is None")
            if res["out"] is not None:
                check(assert_same_bits, res["out"], res["plain_out"], f"{p}: out vs the call without quant")
        else:
            check.that(res["out"] is None, f"{p}: out returned without emit_unquantized")
        if case.residual:
            check(assert_same_bits, res["ro"], res["plain_ro"],
                  f"{p}: residual_out vs the call without quant")
            check(assert_same_values, res["ro"], res["ro_ref"], f"{p}: residual_out vs the reference")
        else:
            check.that(res["ro"] is None, f"{p}: residual_out without a residual")
        q2 = res["q"].reshape(-1, H)
        if case.quant == STATIC:
            _u8_equal(check, q2, res["std_q"], f"{p}: bytes vs tpcomm.quant of out")
            _u8_equal(check, q2, res["ref_q"], f"{p}: bytes vs the torch quant of the unquantised call's out")
            check_static(check, p, case, res, q2)
        s2 = s if case.column_major or case.quant == STATIC else s.reshape(-1, s.shape[-1])
        if case.quant != STATIC:
            _u8_equal(check, q2, res["std_q"], f"{p}: bytes vs tpcomm.quant of out")
            _scales_equal(check, s2, res["std_s"], f"{p}: scales vs tpcomm.quant of out")
            _u8_equal(check, q2, res["ref_q"], f"{p}: bytes vs the torch quant of the unquantised call's out")
            _scales_equal(check, s2, res["ref_s"],
                          f"{p}: scales vs the torch quant of the unquantised call's out")
            for failure in fc.scale_rule_failures(q2, s2, res["plain_out"].reshape(-1, H), case.fp8,
                                                   pow2=case.quant == UE8):
                check.that(False, f"{p}: {failure}")
        # tiny: the reference's y is +-Inf where out and the bytes are NaN; wild: y's order differs past 2^128;
        # tiny_group: out is a 16-bit subnormal there, further from y than an FP8 step
        if not (case.tiny or case.wild_weight or case.tiny_group) and case.quant != STATIC:
            failure = fc.dequantised_failure(q2, s2, res["y32"], case.fp8)
            check.that(failure is None, f"{p}: {failure}")
        if "whole_q" in res:
            check.that(res["launches"] > 1, f"{p}: {res['launches']} launch(es) with max_bytes="
                                            f"{case.max_bytes}: not chunked")
            _u8_equal(check, res["q"], res["whole_q"], f"{p}: bytes, chunked vs one launch")
            _scales_equal(check, res["scales"], res["whole_s"], f"{p}: scales, chunked vs one launch")
    for r in range(1, len(results)):
        _u8_equal(check, results[r]["q"], results[0]["q"], f"rank {r} vs rank 0 bytes")
        check(assert_same_bits, results[r]["scales"], results[0]["scales"], f"rank {r} vs rank 0 scales")
    check.done()


#: A norm weight with a NaN and a huge element (``Fp8Case.wild_weight``): per-group scales of rows of one
#: tile come from the largest ``|v * w'|`` of each group, which is then NaN or Inf in some groups; or with
#: a group of tiny elements (``tiny_group``), whose scale is too small for the fast division.
WILD = [
    (2, _c(51, "lamport", BF16, FN, "row", True, False, True, (4, 64), wild_weight=True)),
    (3, _c(52, "one_shot", BF16, FNUZ, "ue8col", False, True, False, (3, 128), group=64, wild_weight=True)),
    (2, _c(53, "two_shot", FP32, FN, "row", True, False, False, (3, 64), group=16, wild_weight=True)),
    # the last group's weight 1e-38 (Fp8Case.tiny_group): its scale is below the fast division's bound
    (2, _c(54, "lamport", BF16, FN, "row", True, False, True, (3, 64), group=16, tiny_group=True)),
    (3, _c(55, "one_shot", BF16, FNUZ, "ue8", False, False, False, (3, 128), group=32, tiny_group=True)),
]

ALL_CASES = MATRIX + CHUNKED + WIDE + TINY + STATIC_CASES + WILD


@pytest.mark.parametrize("world,case", ALL_CASES, ids=[case_id(w, c) for w, c in ALL_CASES])
def test_fused_fp8_equals_standalone_quant_of_out(pools, world, case):
    """Bytes and scales of the fused call equal the standalone quant of its unquantised ``out``, and
    everything else in the module docstring; chunked calls equal one launch."""
    check_fp8_case(case, pools.get(world).run(fc.fp8_case, case))


# -- bad inputs, zero tokens ---------------------------------------------------------------------------------
#: name -> (argument the message must name, other words it must contain). ValueError but TYPE_ERRORS.
BAD = {
    "quant_unknown": ("quant", ["fp8_per_channel"]),
    "quant_upper_case": ("quant", ["FP8_PER_TOKEN"]),
    "fp8_dtype_e5m2": ("fp8_dtype", ["float8_e5m2"]),
    "fp8_dtype_bf16": ("fp8_dtype", ["bfloat16"]),
    "group_not_power_of_two": ("group_size", ["48"]),
    "group_not_dividing_h": ("group_size", ["64", "96"]),
    "group_default_not_dividing_h": ("group_size", ["128", "96"]),
    "group_zero": ("group_size", ["0"]),
    "group_float": ("group_size", ["32.0"]),
    "group_float_default_per_token": ("group_size", ["128.0", "int"]),
    "group_float_default_without_quant": ("group_size", ["128.0", "int"]),
    "column_major_per_token": ("column_major_scales", ["fp8_per_group"]),
    "column_major_3d": ("column_major_scales", ["(2, 2, 96)"]),
    "emit_without_quant": ("emit_unquantized", ["quant"]),
    "column_major_without_quant": ("column_major_scales", ["quant"]),
    "group_size_without_quant": ("group_size", ["quant", "ignored"]),
    "group_size_per_token": ("group_size=32", ["fp8_per_group"]),
    "fp8_dtype_without_quant": ("fp8_dtype", ["quant", "ignored"]),
    "emit_not_bool": ("emit_unquantized", ["bool", "str"]),
    "column_major_not_bool": ("column_major_scales", ["bool", "str"]),
    "static_without_scale": ("scale", ["fp8_static", "float32"]),
    "static_scale_float64": ("scale", ["torch.float64", "float32"]),
    "static_scale_bf16": ("scale", ["torch.bfloat16", "float32"]),
    "static_scale_python_float": ("scale", ["torch.Tensor", "float"]),
    "static_scale_two_elements": ("scale", ["one element", "(2,)"]),
    "static_scale_empty": ("scale", ["one element", "(0,)"]),
    "static_scale_meta": ("scale", ["meta", "cpu"]),
    "static_scale_nan": ("scale", ["nan", "finite positive"]),
    "static_scale_tiny": ("scale", ["reciprocal overflows"]),
    "static_scale_inf": ("scale", ["inf", "finite positive"]),
    "static_scale_zero": ("scale", ["0.0", "finite positive"]),
    "static_scale_negative": ("scale", ["-0.5", "finite positive"]),
    "static_fp8_dtype_e5m2": ("fp8_dtype", ["float8_e5m2"]),
    "static_group_size": ("group_size=32", ["fp8_static"]),
    "static_column_major": ("column_major_scales", ["fp8_per_group"]),
    "static_scales_out": ("scales_out", ["fp8_static", "input scale"]),
    "static_q_out_is_scale": ("q_out", ["scale"]),
    "scale_with_per_token": ("scale", ["fp8_static", "fp8_per_token"]),
    "scale_with_per_group": ("scale", ["fp8_static", "fp8_per_group"]),
    "scale_without_quant": ("scale", ["fp8_static", "ignored"]),
    "mxfp4_h_not_multiple": ("H=80", ["mxfp4", "block size 32"]),
    "nvfp4_h_not_multiple": ("H=40", ["nvfp4", "block size 16"]),
    "nvfp4_without_scale": ("scale", ["nvfp4", "global scale"]),
    "nvfp4_scale_float64": ("scale", ["torch.float64", "float32"]),
    "nvfp4_scale_nan": ("scale", ["nan", "finite positive"]),
    "mxfp4_with_scale": ("scale", ["nvfp4", "mxfp4"]),
    "fp4_fp8_dtype": ("fp8_dtype", ["FP8 forms", "mxfp4"]),
    "fp4_group_size": ("group_size", ["FP8 forms", "nvfp4"]),
    "fp4_column_major": ("column_major_scales", ["FP8 forms", "mxfp4"]),
    "swizzled_with_fp8": ("swizzled_scales", ["FP4 forms"]),
    "swizzled_without_quant": ("swizzled_scales", ["mxfp4", "ignored"]),
    "swizzled_not_bool": ("swizzled_scales", ["bool", "int"]),
    "swizzled_3d": ("swizzled_scales", ["(2, 2, 96)"]),
    "fp4_q_out_shape": ("q_out", ["(4, 48)", "torch.uint8"]),
    "fp4_scales_out_dtype": ("scales_out", ["(4, 6)", "torch.float8_e4m3fn"]),
}
#: The names of BAD that raise TypeError (a flag that is not a bool, a group size that is not an int, a static
#: scale of another type or dtype); the rest raise ValueError.
TYPE_ERRORS = {"emit_not_bool", "column_major_not_bool", "static_scale_float64", "static_scale_bf16",
               "static_scale_python_float", "nvfp4_scale_float64", "swizzled_not_bool", "group_float",
               "group_float_default_per_token", "group_float_default_without_quant"}


@pytest.fixture(scope="module")
def bad_inputs(pools):
    return pools.get(2).run(fc.fp8_bad_inputs_case, sorted(BAD))


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_quant_arguments_raise_naming_the_argument(bad_inputs, name):
    """ValueError (TypeError for TYPE_ERRORS) prefixed with the op, naming the argument (and the offending
    numbers), on every rank; the ranks stay in step (quantised calls right after are right, one with a
    numpy integer as its group size)."""
    arg, words = BAD[name]
    check = Checks()
    for r, res in enumerate(bad_inputs):
        seen = res["errors"][name]
        check.that(seen is not None, f"rank {r}: {name} raised nothing")
        if seen is None:
            continue
        typ, msg = seen
        want = "TypeError" if name in TYPE_ERRORS else "ValueError"
        check.that(typ == want, f"rank {r}: {name} raised {typ}: {msg}")
        check.that(msg.startswith("fused_add_rmsnorm:"),
                   f"rank {r}: message not prefixed with the op: {msg!r}")
        check.that(re.search(rf"\b{arg}\b", msg) is not None,
                   f"rank {r}: message does not name {arg!r}: {msg!r}")
        for word in words:
            check.that(word in msg, f"rank {r}: message does not contain {word!r}: {msg!r}")
        (q, s), (rq, rs) = res["after"], res["after_ref"]
        _u8_equal(check, q, rq, f"rank {r}: the call after the bad ones, bytes")
        check(assert_same_bits, s, rs, f"rank {r}: the call after the bad ones, scales")
        (q, s), (rq, rs) = res["static"], res["static_ref"]
        _u8_equal(check, q, rq, f"rank {r}: the static call after the bad ones, bytes")
        check(assert_same_bits, s, rs, f"rank {r}: the static call after the bad ones, its scale")
        again = res["static_nan_again"]
        check.that(again is not None and again[0] == "ValueError" and "scale=nan" in again[1],
                   f"rank {r}: a repeated static call with a NaN scale raised {again}")
        (q, s), (rq, rs) = res["numpy_group"], res["numpy_group_ref"]
        _u8_equal(check, q, rq, f"rank {r}: group_size=np.int64(16), bytes")
        check(assert_same_bits, s, rs, f"rank {r}: group_size=np.int64(16), scales")
    check.done()


def test_zero_tokens(pool2):
    """T = 0: no launch; empty outputs of the right shapes, dtypes and layouts; a call after is right."""
    results = pool2.run(fc.fp8_zero_tokens_case)
    expected = {  # name -> (q shape, q dtype, scales shape, out returned)
        "per_token": ((0, 64), FN, (0, 1), True),
        "per_group": ((0, 64), FNUZ, (0, 4), False),
        "per_group_column_major": ((0, 64), FN, (0, 2), True),
        "per_group_3d": ((2, 0, 64), FN, (2, 0, 2), False),
        "static": ((0, 64), FN, (1,), True),
        "mxfp4": ((0, 32), torch.uint8, (0, 2), True),
        "nvfp4_swizzled": ((0, 32), torch.uint8, (0, 4), False),
    }
    x_shape = {name: shape for name, shape, _ in fc.ZERO_TOKEN_CALLS}
    check = Checks()
    for r, res in enumerate(results):
        check.that(res["epoch"] == res["epoch_after"], f"rank {r}: zero-token calls launched "
                                                       f"({res['epoch']} -> {res['epoch_after']})")
        for name, (qshape, qdtype, sshape, emitted) in expected.items():
            q, s, ro, out = res["calls"][name]
            check.that(q[:2] == (qshape, qdtype), f"rank {r}: {name}: q {q}")
            sdtype = {"mxfp4": torch.uint8, "nvfp4_swizzled": FN}.get(name, torch.float32)
            check.that(s[:2] == (sshape, sdtype), f"rank {r}: {name}: scales {s}")
            check.that(ro is not None and ro[0] == x_shape[name], f"rank {r}: {name}: residual_out {ro}")
            check.that((out is not None) == emitted and (out is None or out[0] == x_shape[name]),
                       f"rank {r}: {name}: out {out}")
        (q, s), (rq, rs) = res["after"], res["after_ref"]
        _u8_equal(check, q, rq, f"rank {r}: the call after, bytes")
        check(assert_same_bits, s, rs, f"rank {r}: the call after, scales")
    check.done()


def test_static_form_through_the_ops_and_torch_compile(pool2):
    """``quant="fp8_static"`` and the FP4 forms through ``tpcomm.ops`` (allocating and out forms),
    ``torch.library.opcheck``
    of the allocating op with a scale, and ``torch.compile(fullgraph=True)``: the method's bytes, the input
    scale returned as the scales, and a compiled call that reads the scale's current value (one frame).
    One world size: the ops wrap the method, whose numerics the tests above cover on both."""
    check = Checks()
    for r, got in enumerate(pool2.run(fc.static_ops_case)):
        for name in ("wrapper", "out_form", "fp4_wrapper", "fp4_out_form", "static_swizzled_refused",
                     "swizzled_padding_kept", "opcheck", "compiled", "compiled_new_value"):
            check.that(got[name] is True, f"rank {r}: {name}: {got[name]}")
        check.that(got["frames"] == 1, f"rank {r}: compiled {got['frames']} frames, expected 1")
    check.done()


# -- FP4 outputs ----------------------------------------------------------------------------------------------
def _f4(seed, algo, dtype, quant, swizzled, residual, gemma, emit, shape, **kw):
    return fc.Fp4Case(seed=seed, shape=shape, dtype=dtype, algo=algo, quant=quant, swizzled=swizzled,
                      residual=residual, gemma=gemma, emit=emit, **kw)


#: MXFP4 and NVFP4 in every algorithm at both world sizes, linear and swizzled scales, each input dtype;
#: special rows (zeros, a dominant element, a NaN, huge values) twice per form; chunked launches of
#: swizzled scales (each launch's rows land at their own offsets of the 128x4 layout), 3-D inputs, rows
#: of two tiles; ``repeat`` checks repeated calls (the call cache's replay: new swizzled buffers zeroed).
FP4_CASES = [
    (2, _f4(61, "lamport", BF16, "mxfp4", False, True, False, True, (4, 64), special=True, repeat=True)),
    (3, _f4(62, "lamport", FP16, "nvfp4", True, False, True, False, (3, 64))),
    (2, _f4(63, "lamport", BF16, "nvfp4", True, True, False, False, (5, 64), max_bytes=CHUNK_MAX_BYTES)),
    (3, _f4(64, "one_shot", BF16, "mxfp4", True, True, True, True, (4, 96), special=True)),
    (2, _f4(65, "one_shot", FP32, "nvfp4", False, False, False, False, (2, 8320), peak=True, repeat=True)),
    (2, _f4(66, "two_shot", FP16, "nvfp4", False, True, False, True, (3, 2, 64), special=True, repeat=True)),
    (3, _f4(67, "two_shot", BF16, "mxfp4", True, False, False, True, (4, 64), max_bytes=CHUNK_MAX_BYTES)),
    (2, _f4(68, "fallback", FP32, "mxfp4", True, True, True, False, (5, 96), repeat=True)),
    (3, _f4(69, "fallback", BF16, "nvfp4", False, True, False, True, (4, 64), special=True)),
    # a norm weight with a NaN and a huge element (Fp8Case.wild_weight): NaN and Inf blocks amax from v * w'
    (2, _f4(70, "lamport", BF16, "mxfp4", False, True, False, False, (3, 64), wild_weight=True)),
    (3, _f4(71, "one_shot", BF16, "nvfp4", True, False, False, True, (3, 64), wild_weight=True)),
]


def fp4_case_id(world, case):
    flags = "".join(f for f, on in (("-swz", case.swizzled), ("-res", case.residual), ("-gemma", case.gemma),
                                   ("-emit", case.emit), ("-special", case.special), ("-peak", case.peak),
                                   ("-chunked", case.max_bytes is not None), ("-wild", case.wild_weight)) if on)
    return f"w{world}-{case.algo}-{dtype_name(case.dtype)}-{case.quant}-{'x'.join(map(str, case.shape))}{flags}"


def check_fp4_case(case, results):
    check = Checks()
    H = case.shape[-1]
    block = 32 if case.quant == "mxfp4" else 16
    lead = case.shape[:-1]
    T = 1
    for n in lead:
        T *= n
    if case.swizzled:
        s_shape = (-(-T // 128) * 128, -(-(H // block) // 4) * 4)
    else:
        s_shape = (*lead, H // block)
    s_dtype = torch.uint8 if case.quant == "mxfp4" else FN
    for r, res in enumerate(results):
        p = f"rank {r}"
        check.that(res["plan"] == case.algo, f"{p}: plan {res['plan']!r}, expected {case.algo!r}")
        check.that(res["q"].dtype == torch.uint8 and tuple(res["q"].shape) == (*lead, H // 2),
                   f"{p}: q {res['q'].dtype} {tuple(res['q'].shape)}")
        check.that(res["scales_dtype"] == s_dtype and tuple(res["scales"].shape) == s_shape,
                   f"{p}: scales {res['scales_dtype']} {tuple(res['scales'].shape)}, expected {s_dtype} {s_shape}")
        if case.emit:
            check.that(res["out"] is not None, f"{p}: emit_unquantized=True but out is None")
            if res["out"] is not None:
                check(assert_same_bits, res["out"], res["plain_out"], f"{p}: out vs the call without quant")
        else:
            check.that(res["out"] is None, f"{p}: out returned without emit_unquantized")
        if case.residual:
            check(assert_same_bits, res["ro"], res["plain_ro"], f"{p}: residual_out vs the call without quant")
        q2 = res["q"].reshape(-1, H // 2)
        s2 = res["scales"].reshape(-1, res["scales"].shape[-1])
        _u8_equal(check, q2, res["std_q"], f"{p}: bytes vs tpcomm.quant of out")
        _u8_equal(check, s2, res["std_s"], f"{p}: scales vs tpcomm.quant of out")
        _u8_equal(check, q2, res["ref_q"], f"{p}: bytes vs the reference quant of the unquantised call's out")
        _u8_equal(check, s2, res["ref_s"], f"{p}: scales vs the reference quant of the unquantised call's out")
        if not case.wild_weight:  # the reference's y (written order) differs past 2^128
            failure = fc.fp4_bound_failure(q2, res["ref_linear"], res["y32"], case.quant, case.global_scale)
            check.that(failure is None, f"{p}: {failure}")
        for k, ((aq, as_), (rq, rs)) in enumerate(zip(res["again"], res["again_ref"])):
            _u8_equal(check, aq.reshape(-1, H // 2), rq, f"{p}: repeated call {k + 1}, bytes")
            _u8_equal(check, as_.reshape(-1, as_.shape[-1]), rs, f"{p}: repeated call {k + 1}, scales")
        check.that(len(res["again"]) == (2 if case.repeat else 0), f"{p}: {len(res['again'])} repeated calls")
        if "whole_q" in res:
            check.that(res["launches"] > 1, f"{p}: {res['launches']} launch(es) with max_bytes={case.max_bytes}")
            _u8_equal(check, res["q"], res["whole_q"], f"{p}: bytes, chunked vs one launch")
            _u8_equal(check, res["scales"], res["whole_s"], f"{p}: scales, chunked vs one launch")
    for r in range(1, len(results)):
        _u8_equal(check, results[r]["q"], results[0]["q"], f"rank {r} vs rank 0 bytes")
        _u8_equal(check, results[r]["scales"], results[0]["scales"], f"rank {r} vs rank 0 scales")
    check.done()


@pytest.mark.parametrize("world,case", FP4_CASES, ids=[fp4_case_id(w, c) for w, c in FP4_CASES])
def test_fused_fp4_equals_standalone_quant_of_out(pools, world, case):
    """MXFP4 / NVFP4 bytes and block scales of the fused call equal ``tpcomm.mxfp4_quant`` /
    ``nvfp4_quant`` of its ``out`` and the references of the unquantised call's ``out`` (linear or
    swizzled), on every rank alike; dequantised within the format's step of the float32 reference."""
    check_fp4_case(case, pools.get(world).run(fc.fp4_case, case))
