"""The standalone Triton ops of the quantised forms beside item 4's (``tpcomm.static_quant_fp8``,
``tpcomm.per_group_quant_fp8(..., ue8m0=True)``, ``tpcomm.pack_ue8m0_scales``, ``tpcomm.mxfp4_quant``,
``tpcomm.nvfp4_quant``) against the plain-torch references of ``tpcomm/reference.py`` (docs/numerics.md,
"Quantised output forms"), byte for byte, on rows holding zero groups, subnormals, saturating values,
NaN and Inf. CPU tests run the kernels under
Triton's interpreter; on a machine with a GPU the same tests run there."""

import pytest
import torch

import tpcomm  # sets TRITON_INTERPRET=1 without CUDA
from tests.support.numerics import assert_same_bits, dtype_name
from tpcomm.reference import (
    mxfp4_quant_reference,
    nvfp4_global_scale,
    nvfp4_quant_reference,
    pack_ue8m0_scales as pack_reference,
    per_group_ue8m0_quant_reference,
    static_fp8_quant_reference,
    swizzle_128x4,
)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_name(d):
    return str(d).replace("torch.float8_", "")


def _rows(T, H, dtype, seed):
    """Random rows over many magnitudes, with the special values in fixed places: a zero group (the
    first 128 of row 0), subnormals of ``dtype``, values past FP8's range, -0.0, and in the last row
    NaN and +-Inf."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(T, H, generator=g) * torch.exp2(torch.randint(-20, 12, (T, H), generator=g).float())
    v[0, :128] = 0.0
    tiny = torch.finfo(dtype).tiny
    v[1 % T, 0:8] = torch.tensor([tiny / 2, -tiny / 4, tiny, 3e4, -1e5, -0.0, 1e-30, 448.0])
    if T > 2:
        v[-1, 5], v[-1, H // 2 + 3], v[-1, H - 7] = float("nan"), float("inf"), float("-inf")
    return v.to(dtype).to(DEV)


def _same_bytes(got, want, what):
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    diff = g != w
    assert not diff.any(), (f"{what}: {int(diff.sum())} bytes differ, first at {diff.nonzero()[:4].tolist()}: "
                            f"{g[diff][:4].tolist()} vs {w[diff][:4].tolist()}")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("scale", (1.0, 0.0625, 7.0, 3.1e-5))
def test_static_quant_matches_the_reference(dtype, fp8_dtype, scale):
    x = _rows(4, 384, dtype, seed=int(scale * 1000) + len(str(dtype)))
    s = torch.tensor([scale], dtype=torch.float32, device=DEV)
    _same_bytes(tpcomm.static_quant_fp8(x, s, fp8_dtype), static_fp8_quant_reference(x, s, fp8_dtype),
                f"static {dtype} {fp8_dtype} scale {scale}")


def test_static_quant_multiplies_by_the_rounded_reciprocal():
    """Scale 7, x = 10.9375: x / 7 is the e4m3 tie 1.5625 (-> 1.5), x * f32(1/7) rounds up to 1.625."""
    x = torch.full((1, 16), 10.9375, dtype=torch.float32, device=DEV)
    q = tpcomm.static_quant_fp8(x, torch.tensor(7.0, device=DEV))
    assert q.float().unique().tolist() == [1.625]


@pytest.mark.parametrize("bad, error, match", [
    (torch.tensor([1.0], dtype=torch.float64), TypeError, "float32"),
    (torch.tensor([1.0, 2.0]), ValueError, "one element"),
    (torch.tensor(float("nan")), ValueError, "finite positive"),
    (torch.tensor(float("inf")), ValueError, "finite positive"),
    (torch.tensor(0.0), ValueError, "finite positive"),
    (torch.tensor(-2.0), ValueError, "finite positive"),
    (torch.tensor(1e-42), ValueError, "reciprocal overflows"),
    (2.0, TypeError, "torch.Tensor"),
])
def test_static_quant_rejects_bad_scales(bad, error, match):
    x = torch.ones(2, 32, dtype=torch.bfloat16, device=DEV)
    if isinstance(bad, torch.Tensor):
        bad = bad.to(DEV)
    with pytest.raises(error, match=match):
        tpcomm.static_quant_fp8(x, bad)


def test_static_quant_rejects_bad_inputs():
    s = torch.tensor(1.0, device=DEV)
    with pytest.raises(TypeError, match="dtype"):
        tpcomm.static_quant_fp8(torch.ones(2, 32, dtype=torch.int32, device=DEV), s)
    with pytest.raises(ValueError, match="2-D"):
        tpcomm.static_quant_fp8(torch.ones(32, device=DEV), s)
    with pytest.raises(ValueError, match="fp8_dtype"):
        tpcomm.static_quant_fp8(torch.ones(2, 32, device=DEV), s, torch.float8_e5m2)


@pytest.mark.parametrize("group_size", (32, 128))
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_ue8m0_groups_match_the_reference(dtype, fp8_dtype, group_size):
    x = _rows(5, 512, dtype, seed=group_size + len(str(dtype)))
    q, scales = tpcomm.per_group_quant_fp8(x, group_size, fp8_dtype, ue8m0=True)
    rq, rs = per_group_ue8m0_quant_reference(x, group_size, fp8_dtype)
    _same_bytes(q, rq, f"ue8m0 q {dtype} {fp8_dtype} g{group_size}")
    assert_same_bits(scales, rs, f"ue8m0 scales {dtype} {fp8_dtype} g{group_size}")
    finite = torch.isfinite(scales)
    mantissa = scales[finite].contiguous().view(torch.int32) & 0x7FFFFF
    exponent = (scales[finite].contiguous().view(torch.int32) >> 23) & 0xFF
    assert bool(((mantissa == 0) | ((exponent == 0) & (mantissa == 0x400000))).all()), "a scale is no power of two"


def test_ue8m0_scale_rounds_up_and_subnormal_amax_gets_the_smallest_scales():
    """amax 448 gives scale 1 (exact); 449 gives 2; an amax whose quotient by 448 is subnormal gives
    2^-127 or 2^-126; a zero group gives 1."""
    tiny = 2.0 ** -126
    amaxes = [448.0, 449.0, 448.0 * tiny / 4, 448.0 * tiny * 0.75, 0.0]
    x = torch.zeros(1, 32 * len(amaxes), dtype=torch.float32, device=DEV)
    for i, a in enumerate(amaxes):
        x[0, 32 * i] = a
    _, scales = tpcomm.per_group_quant_fp8(x, 32, ue8m0=True)
    assert scales[0].tolist() == [1.0, 2.0, 2.0 ** -127, 2.0 ** -126, 1.0]


def test_ue8m0_column_major_scales_hold_the_same_values():
    x = _rows(6, 256, torch.bfloat16, seed=3)
    _, rows = tpcomm.per_group_quant_fp8(x, 128, ue8m0=True)
    _, cols = tpcomm.per_group_quant_fp8(x, 128, ue8m0=True, column_major_scales=True)
    assert cols.stride() == (1, 6)
    assert_same_bits(cols.contiguous(), rows, "column-major ue8m0 scales")


def test_ue8m0_must_be_a_bool():
    with pytest.raises(TypeError, match="ue8m0"):
        tpcomm.per_group_quant_fp8(torch.ones(2, 128, device=DEV), 128, ue8m0=1)


@pytest.mark.parametrize("value", ["no", 1])
def test_column_major_scales_must_be_a_bool(value):
    with pytest.raises(TypeError, match="column_major_scales must be a bool"):
        tpcomm.per_group_quant_fp8(torch.ones(2, 128, device=DEV), 128, column_major_scales=value)


@pytest.mark.parametrize("T, G", [(1, 1), (5, 4), (6, 7), (9, 48)])
def test_packed_ue8m0_scales_match_the_reference(T, G):
    x = _rows(T, 128 * G, torch.bfloat16, seed=T * 100 + G)
    _, scales = tpcomm.per_group_quant_fp8(x, 128, ue8m0=True)
    got, want = tpcomm.pack_ue8m0_scales(scales), pack_reference(scales)
    assert got.dtype == torch.int32 and got.shape == want.shape and got.stride() == want.stride(), \
        (got.shape, got.stride(), want.shape, want.stride())
    assert torch.equal(got, want)
    K, Tp = -(-G // 4), -(-T // 4) * 4
    assert got.stride() == (1, Tp) and got.untyped_storage().nbytes() == K * Tp * 4  # padded to Tp rows


def test_pack_ue8m0_rejects_bad_scales():
    with pytest.raises(TypeError, match="float32"):
        tpcomm.pack_ue8m0_scales(torch.ones(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D"):
        tpcomm.pack_ue8m0_scales(torch.ones(4))


# -- MXFP4 and NVFP4 ---------------------------------------------------------------------------------------
RULES = ("floor", "even", "rceil")
#: Block amaxes whose scale bytes the rules round differently (tests/quant/test_quant_formats.py's hand cases):
#: just below and at powers of two, significands 1.75 and above, amax / 6 one ulp above 2^10, float32
#: subnormal and near-largest values, zero.
_AMAXES = (7.99, 8.0, 6.0, 6.01, 7.0, 6.99, 12.01, 6144.00048828125, 2.0 ** -130, 3e38, 0.0)


def _fp4_rows(T, H, dtype, block, seed):
    """Random rows over many magnitudes, then special blocks in fixed places (each ``block`` long, where
    the shape has room): in row 0 a zero block, a block of ``dtype``'s subnormals (with -0.0 and negatives that round
    to -0), a
    block of E2M1 ties and values past 6 times the scale (saturating); in row 1 NaN, +Inf and -Inf blocks;
    in row 2 (T >= 3) one block per amax of ``_AMAXES`` (bf16 and fp16 round or overflow some: the
    kernels and the reference see the same inputs)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(T, H, generator=g) * torch.exp2(torch.randint(-12, 12, (T, H), generator=g).float())
    tiny = torch.finfo(dtype).tiny
    v[0, :block] = 0.0
    v[0, 1] = -0.0
    if H >= 2 * block:
        v[0, block:2 * block] = torch.linspace(-2.0, 2.0, block) * tiny
        v[0, block + 3] = -tiny / 64
    if H >= 3 * block:
        ties = torch.tensor([7.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25, 6.5, -7.5, 0.3, 4.9])
        v[0, 2 * block:2 * block + len(ties)] = ties
    if T >= 2 and H >= 3 * block:
        v[1, :3] = torch.tensor([1.0, float("nan"), -3.0])
        v[1, block + 2] = float("inf")
        v[1, 2 * block + 5] = float("-inf")
    if T >= 3:
        for i, a in enumerate(_AMAXES[:H // block]):
            v[2, i * block:(i + 1) * block] = torch.linspace(-1.0, 1.0, block) * a
            v[2, i * block] = a
    return v.to(dtype).to(DEV)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_mxfp4_quant_matches_the_reference(dtype, rule):
    x = _fp4_rows(4, 384, dtype, 32, seed=len(rule) + len(str(dtype)))
    q, scales = tpcomm.mxfp4_quant(x, rule)
    rq, rs = mxfp4_quant_reference(x, rule)
    _same_bytes(q, rq, f"mxfp4 q {dtype} {rule}")
    _same_bytes(scales, rs, f"mxfp4 scales {dtype} {rule}")
    assert scales[1, :3].tolist() == [0xFF] * 3 and scales[0, 0] == 0, "NaN / Inf / zero block scales"


#: Global scales: TensorRT-LLM's for the finite values of the random rows (row 2's amaxes of up to 3e38
#: then saturate at the block scale 448); one that saturates every block scale at 448; and one that leaves
#: the smaller block scales e4m3 subnormals or 0 (their codes +-0).
_GLOBAL = ("tensor", "huge", "tiny")


def _global_scale(x, which):
    rows = x.float()[[r for r in range(x.shape[0]) if r != 2]]
    finite = rows.abs().masked_fill(~torch.isfinite(rows), 0.0)
    g = nvfp4_global_scale(finite.amax().reshape(1)).reshape(1)
    return {"tensor": g, "huge": g * 2.0 ** 40, "tiny": g * 2.0 ** -12}[which].to(torch.float32).to(DEV)


@pytest.mark.parametrize("which", _GLOBAL)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_nvfp4_quant_matches_the_reference(dtype, which):
    x = _fp4_rows(4, 256, dtype, 16, seed=len(which) * 7 + len(str(dtype)))
    g = _global_scale(x, which)
    q, scales = tpcomm.nvfp4_quant(x, g)
    rq, rs = nvfp4_quant_reference(x, g)
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (4, 16)
    _same_bytes(q, rq, f"nvfp4 q {dtype} {which}")
    _same_bytes(scales, rs, f"nvfp4 block scales {dtype} {which}")
    assert scales.view(torch.uint8)[1, :3].tolist() == [0x7F] * 3, "NaN / Inf block scales"
    if which == "tiny":
        b = scales.view(torch.uint8)
        assert bool(((b > 0) & (b < 8)).any()) and bool((b == 0).any()), "no subnormal or zero block scale"


@pytest.mark.parametrize("T, H, nvfp4", [(1, 96, True), (129, 32, False), (5, 8320, True)])
def test_fp4_quant_rows_of_several_tiles_and_swizzled_scales(T, H, nvfp4):
    """Swizzled scales equal ``swizzle_128x4`` of the reference's (rows padded to 128, scales per row to
    4, zero padding; 129 rows: a second tile of rows, MXFP4 only, as both kernels store through the same
    offsets and the interpreter takes 30 ms a row); rows wider than one tile (8320 > 8192) give the
    reference's bytes."""
    x = _fp4_rows(T, H, torch.bfloat16, 32, seed=T + H)
    q, scales = tpcomm.mxfp4_quant(x, swizzled_scales=True)
    rq, rs = mxfp4_quant_reference(x)
    _same_bytes(q, rq, f"mxfp4 q {T}x{H}")
    _same_bytes(scales, swizzle_128x4(rs), f"mxfp4 swizzled scales {T}x{H}")
    assert scales.is_contiguous() and scales.shape == (-(-T // 128) * 128, -(-H // 128) * 4)
    if not nvfp4:
        return
    g = _global_scale(x, "tensor")
    q, scales = tpcomm.nvfp4_quant(x, g, swizzled_scales=True)
    rq, rs = nvfp4_quant_reference(x, g)
    _same_bytes(q, rq, f"nvfp4 q {T}x{H}")
    _same_bytes(scales, swizzle_128x4(rs), f"nvfp4 swizzled scales {T}x{H}")
    assert scales.is_contiguous() and scales.shape == (-(-T // 128) * 128, -(-H // 64) * 4)


def test_fp4_quant_zero_rows():
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=DEV)
    q, scales = tpcomm.mxfp4_quant(x)
    assert q.shape == (0, 32) and scales.shape == (0, 2) and scales.dtype == torch.uint8
    q, scales = tpcomm.nvfp4_quant(x, torch.ones(1, device=DEV), swizzled_scales=True)
    assert q.shape == (0, 32) and scales.shape == (0, 4) and scales.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("call, error, match", [
    (lambda x, g: tpcomm.mxfp4_quant(x[:, :48]), ValueError, "H=48 .* multiple of the block size 32"),
    (lambda x, g: tpcomm.nvfp4_quant(x[:, :40], g), ValueError, "H=40 .* multiple of the block size 16"),
    (lambda x, g: tpcomm.mxfp4_quant(x, "nearest"), ValueError, "scale_rule='nearest'"),
    (lambda x, g: tpcomm.mxfp4_quant(x, swizzled_scales=1), TypeError, "swizzled_scales must be a bool"),
    (lambda x, g: tpcomm.nvfp4_quant(x, g, swizzled_scales="yes"), TypeError, "swizzled_scales"),
    (lambda x, g: tpcomm.mxfp4_quant(x.to(torch.int32)), TypeError, "dtype torch.int32"),
    (lambda x, g: tpcomm.mxfp4_quant(x[0]), ValueError, "2-D"),
    (lambda x, g: tpcomm.nvfp4_quant(x, g.double()), TypeError, "global_scale has dtype torch.float64"),
    (lambda x, g: tpcomm.nvfp4_quant(x, 1.0), TypeError, "global_scale must be a torch.Tensor"),
    (lambda x, g: tpcomm.nvfp4_quant(x, g.repeat(2)), ValueError, "global_scale must hold one element"),
    (lambda x, g: tpcomm.nvfp4_quant(x, g * float("nan")), ValueError, "global_scale=nan"),
    (lambda x, g: tpcomm.nvfp4_quant(x, g * float("inf")), ValueError, "global_scale=inf"),
    (lambda x, g: tpcomm.nvfp4_quant(x, g * 0.0), ValueError, "global_scale=0.0"),
    (lambda x, g: tpcomm.nvfp4_quant(x, -g), ValueError, "global_scale=-1.0"),
], ids=["mx_h", "nv_h", "rule", "mx_swizzle_flag", "nv_swizzle_flag", "int_x", "1d_x", "g_float64", "g_float",
        "g_two", "g_nan", "g_inf", "g_zero", "g_negative"])
def test_fp4_quant_rejects_bad_inputs(call, error, match):
    x = torch.ones(2, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(error, match=match):
        call(x, torch.ones(1, device=DEV))
