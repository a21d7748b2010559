"""Standalone FP8 quantisation (``tpcomm/quant/standalone.py``, ``tpcomm/kernels/quant.py``) against the plain-torch
reference (``tpcomm/reference.py``), byte for byte, and the FP8 encoder against a decoder written out
by hand (so torch's own conversion is checked too).

CPU tests run the kernels under Triton's interpreter; the ``gpu`` tests (one CUDA GPU) also compare the
hardware e4m3fn conversion with the integer encoder over every float32 bit pattern.
"""
# tpcomm first: on CPU it turns Triton's interpreter on before triton is imported
# isort: skip_file

import math

import pytest
import torch

import tpcomm  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, before triton is imported below)
import triton
import triton.language as tl
from tests.support.numerics import FLOAT_DTYPES, assert_same_bits, dtype_name
from tpcomm.kernels import quant as kq
from tpcomm.quant import native_fp8, per_group_quant_fp8, per_token_quant_fp8
from tpcomm.reference import per_group_quant_reference, per_token_quant_reference

#: NaN and Inf rows divide Inf by Inf and NaN by NaN on purpose; the interpreter's numpy says so.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_TL = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e4m3fnuz: tl.float8e4b8}
#: Per format: largest finite value, exponent bias, byte of every NaN, byte of +MAX.
_FMT = {torch.float8_e4m3fn: (448.0, 7, 0x7F, 0x7E), torch.float8_e4m3fnuz: (240.0, 8, 0x80, 0x7F)}
_ON_GPU = torch.cuda.is_available()
_DEV = "cuda" if _ON_GPU else "cpu"


def fp8_name(d):
    return str(d).replace("torch.float8_", "")


def _u8(q):
    return q.view(torch.uint8)


def assert_same_quant(got, want, what):
    """Bytes of ``q`` and bits of ``scales`` equal (NaN payloads included), and the same layout."""
    (q, s), (rq, rs) = got, want
    assert q.dtype == rq.dtype and q.shape == rq.shape, f"{what}: q {q.dtype} {tuple(q.shape)}"
    diff = _u8(q) != _u8(rq)
    assert not diff.any(), (f"{what}: {int(diff.sum())} bytes differ, first at "
                            f"{diff.nonzero()[:4].tolist()}: {_u8(q)[diff][:4].tolist()} vs "
                            f"{_u8(rq)[diff][:4].tolist()}")
    assert s.stride() == rs.stride(), f"{what}: scales strides {s.stride()} != {rs.stride()}"
    assert_same_bits(s, rs, f"{what}: scales")


# ---------------------------------------------------------------------------------------------------
# The encoder: float32 -> FP8 bytes.

@triton.jit
def _encode_kernel(x_ptr, y_ptr, n, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, kq.fp8_encode(x, FP8, NATIVE_FP8), mask=mask)


def encode(x: torch.Tensor, fp8_dtype, native=False) -> torch.Tensor:
    """``kq.fp8_encode`` of float32 ``x`` (1-D): uint8 bytes."""
    y = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    block = 1 << 16 if x.device.type == "cpu" else 1024  # the interpreter is fastest with few, wide programs
    _encode_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), FP8=_TL[fp8_dtype], NATIVE_FP8=native,
                                                       BLOCK=block)
    return y


def decode_by_hand(code: int, fp8_dtype) -> float:
    """The value of an FP8 byte from the format's definition (not torch): 1 sign, 4 exponent, 3 mantissa
    bits; e4m3fn: bias 7, 0x7F/0xFF NaN; e4m3fnuz: bias 8, 0x80 the only NaN, no -0."""
    _, bias, nan, _ = _FMT[fp8_dtype]
    if code == nan or (fp8_dtype == torch.float8_e4m3fn and code == 0xFF):
        return math.nan
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 7
    mag = m * 2.0 ** (-2 - bias) if e == 0 else (1 + m / 8) * 2.0 ** (e - bias)
    return sign * mag


def torch_fp8_bytes(x: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """torch's conversion after the clamp, with the canonical NaN byte: the reference's encoder."""
    mx, _, nan, _ = _FMT[fp8_dtype]
    return torch.where(x.isnan(), nan, _u8(x.clamp(-mx, mx).to(fp8_dtype)))


def _bit_sweep() -> torch.Tensor:
    """float32 values whose top 16 bits take every value and whose low 16 bits are one of 6 patterns:
    every sign, exponent and leading mantissa bits, so every rounding tie of every FP8 binade (the cut
    is at bit 20 or above), the values next to it, NaNs, infinities and float32 subnormals."""
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    b = (hi[:, None] | lows[None, :]).reshape(-1)
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
def test_encoder_matches_torch_on_bit_sweep(fp8_dtype):
    """Soft encoder == torch (clamp, convert, canonical NaN) on 393216 float32 bit patterns."""
    x = _bit_sweep()
    got, want = encode(x, fp8_dtype), torch_fp8_bytes(x, fp8_dtype)
    diff = got != want
    assert not diff.any(), f"{int(diff.sum())} differ, first x={x[diff][:4].tolist()}"


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
def test_encoder_rounds_to_nearest_even(fp8_dtype):
    """Against the hand decoder: every finite code is hit by its own value; the midpoint of two
    neighbours goes to the even code (ties to even); the floats either side of it to the nearer one.
    Checks torch's conversion the same way, since the reference relies on it."""
    mx, _, nan, max_code = _FMT[fp8_dtype]
    pos = [c for c in range(0x80) if c != nan and not math.isnan(decode_by_hand(c, fp8_dtype))]
    vals = [decode_by_hand(c, fp8_dtype) for c in pos]
    assert vals == sorted(vals) and vals[-1] == mx and pos[-1] == max_code
    # Midpoints of two FP8 values are exact in float32; their float32 neighbours lie either side.
    mids = torch.tensor([(a + b) / 2 for a, b in zip(vals, vals[1:])], dtype=torch.float32)
    below = torch.nextafter(mids, torch.tensor(-math.inf))
    above = torch.nextafter(mids, torch.tensor(math.inf))
    lo, hi = torch.tensor(pos[:-1]), torch.tensor(pos[1:])
    x = torch.cat([torch.tensor(vals, dtype=torch.float32), mids, below, above])
    exp = torch.cat([torch.tensor(pos), torch.where(lo % 2 == 0, lo, hi), lo, hi]).to(torch.uint8)
    x, exp = torch.cat([x, -x]), torch.cat([exp, exp | 0x80])
    if fp8_dtype == torch.float8_e4m3fnuz:
        exp = torch.where(exp == 0x80, 0, exp)  # no negative zero
    for name, got in (("tpcomm encoder", encode(x, fp8_dtype)), ("torch", torch_fp8_bytes(x, fp8_dtype))):
        diff = got != exp
        assert not diff.any(), f"{name}: x={x[diff][:4].tolist()} gave {got[diff][:4].tolist()}"


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
def test_encoder_special_values(fp8_dtype):
    """Saturation (past MAX, +-Inf -> +-MAX), canonical NaN for every NaN, signed zeros, float32
    subnormals -> zero, half the smallest FP8 subnormal -> zero (tie to even), just above it -> 1."""
    mx, bias, nan, max_code = _FMT[fp8_dtype]
    tiny = 2.0 ** (-2 - bias)  # smallest FP8 subnormal
    neg_nan = torch.tensor([-1], dtype=torch.int32).view(torch.float32).item()  # 0xFFFFFFFF
    x = torch.tensor([mx * 1.0001, -mx * 1.0001, 3e38, math.inf, -math.inf, math.nan, neg_nan, 0.0, -0.0,
                      1e-45, -1e-45, tiny / 2, tiny * 0.5000001, -tiny * 0.75], dtype=torch.float32)
    nz = 0x80 if fp8_dtype == torch.float8_e4m3fn else 0x00  # -0.0 and negatives rounding to zero
    want = [max_code, max_code | 0x80, max_code, max_code, max_code | 0x80, nan, nan, 0, nz, 0, nz, 0, 1, 0x81]
    assert encode(x, fp8_dtype).tolist() == want


# ---------------------------------------------------------------------------------------------------
# Standalone kernels against the reference.

def _rows_input(T: int, H: int, dtype, seed: int, special: bool = True) -> torch.Tensor:
    """Random rows of assorted magnitudes; with ``special``, row 0 zeros, row 1 -0.0, row 2 a NaN
    (last element), row 3 subnormals of ``dtype``, row 4 an Inf, row 5 values near ``dtype``'s max."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-12, 12, (T, 1), generator=g).float())
    x = (torch.randn(T, H, generator=g) * mag).to(dtype)
    if special:
        fi = torch.finfo(dtype)
        specials = {0: torch.zeros(H), 1: torch.full((H,), -0.0)}
        r2 = torch.randn(H, generator=g)
        r2[-1] = math.nan
        specials[2] = r2
        specials[3] = torch.randint(-3, 4, (H,), generator=g).float() * fi.smallest_normal / 8
        r4 = torch.randn(H, generator=g)
        r4[H // 2] = -math.inf
        specials[4] = r4
        specials[5] = torch.rand(H, generator=g) * fi.max * torch.sign(torch.randn(H, generator=g))
        for r, row in specials.items():
            if r < T:
                x[r] = row.to(dtype)
    return x.to(_DEV)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("T,H", [(7, 123), (2, 16400)], ids=["7x123", "2x16400-three-tiles"])
def test_per_token_matches_reference(T, H, dtype, fp8_dtype):
    """Bytes and scale bits equal the torch reference: random rows plus zeros, -0.0, a NaN, subnormals,
    an Inf and values near the dtype's max; H not a power of two, and a row of three 8192-wide tiles."""
    x = _rows_input(T, H, dtype, seed=T * H)
    q, s = per_token_quant_fp8(x, fp8_dtype)
    assert q.is_contiguous() and s.shape == (T, 1) and s.dtype == torch.float32
    assert_same_quant((q.cpu(), s.cpu()), per_token_quant_reference(x.cpu(), fp8_dtype), "per-token")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("column_major", [False, True], ids=["row-major", "column-major"])
@pytest.mark.parametrize("T,H,G", [(6, 384, 128), (3, 48, 16), (1, 16640, 128)],
                         ids=["6x384-g128", "3x48-g16", "1x16640-g128-three-tiles"])
def test_per_group_matches_reference(T, H, G, column_major, dtype, fp8_dtype):
    """Per-group bytes and scale bits equal the reference in both scale layouts; 384 leaves the tile
    of 512 a masked fourth group; 16640 spans three tiles. A NaN or Inf spoils only its own group."""
    x = _rows_input(T, H, dtype, seed=T + H + G)
    got = per_group_quant_fp8(x, G, fp8_dtype, column_major_scales=column_major)
    want = per_group_quant_reference(x.cpu(), G, fp8_dtype, column_major_scales=column_major)
    assert_same_quant((got[0].cpu(), got[1].cpu()), want, "per-group")
    s = got[1]
    assert s.shape == (T, H // G)
    assert s.stride() == ((1, T) if column_major else (H // G, 1))
    assert (s.t() if column_major else s).is_contiguous()
    if T > 2:  # row 2 holds one NaN, in its last group only
        assert s[2, :-1].isfinite().all() and s[2, -1].isnan()


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
@pytest.mark.parametrize("per_group", [False, True], ids=["per-token", "per-group"])
def test_small_forced_tiles(per_group, fp8_dtype):
    """The multi-tile path with 32-wide tiles (H = 100: four tiles, the last one part masked), amax and
    a NaN in the last tile, against the reference."""
    T, H, G, block = 4, 112, 16, 32
    x = _rows_input(T, H, torch.bfloat16, seed=5, special=False)
    x[0, -1] = 1e4  # amax in the last tile
    x[1, -3] = math.nan
    x[2, :] = 0.0
    q = torch.empty((T, H), dtype=fp8_dtype, device=x.device)
    tiles = -(-H // block)
    if per_group:
        s = torch.empty((T, H // G), dtype=torch.float32, device=x.device)
        kq.launch_per_group_quant(x, _u8(q), s, G, _TL[fp8_dtype], False, block, tiles, 4)
        want = per_group_quant_reference(x.cpu(), G, fp8_dtype)
    else:
        s = torch.empty((T, 1), dtype=torch.float32, device=x.device)
        kq.launch_per_token_quant(x, _u8(q), s, _TL[fp8_dtype], False, block, tiles, 4)
        want = per_token_quant_reference(x.cpu(), fp8_dtype)
    assert_same_quant((q.cpu(), s.cpu()), want, f"tiles of {block}")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
def test_zero_and_special_rows_by_hand(fp8_dtype):
    """Written-out expectations (not the reference): zeros -> scale 1, bytes 0; -0.0 -> scale 1, bytes
    0x80 (e4m3fn) or 0x00 (e4m3fnuz); a NaN -> scale NaN, every byte the NaN byte; an Inf -> scale Inf,
    NaN at the Inf (Inf / Inf), signed zeros elsewhere; [2 MAX, -2 MAX, 1] -> scale 2, +-MAX, 0.5."""
    mx, _, nan, max_code = _FMT[fp8_dtype]
    neg0 = 0x80 if fp8_dtype == torch.float8_e4m3fn else 0x00
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [-0.0, -0.0, -0.0, -0.0], [1.0, math.nan, -2.0, 0.0],
                      [1.0, -math.inf, -2.0, 0.0], [2 * mx, -2 * mx, 1.0, 0.0]], dtype=torch.float32).to(_DEV)
    q, s = per_token_quant_fp8(x, fp8_dtype)
    q, s = _u8(q).cpu().tolist(), s.cpu().reshape(-1).tolist()
    half = [c for c in range(0x80) if decode_by_hand(c, fp8_dtype) == 0.5][0]
    assert s[0] == 1.0 and q[0] == [0, 0, 0, 0]
    assert s[1] == 1.0 and q[1] == [neg0] * 4
    assert math.isnan(s[2]) and q[2] == [nan] * 4
    assert s[3] == math.inf and q[3] == [0, nan, neg0, 0]
    assert s[4] == 2.0 and q[4] == [max_code, max_code | 0x80, half, 0]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
def test_tiny_scales(fp8_dtype):
    """float32 rows whose amax / MAX is subnormal or underflows. amax 2^-140: the scale rounds to
    2^-149 (e4m3fn) or 2^-148 (e4m3fnuz), so amax / scale is 512 or 256, past MAX: saturated to +-MAX.
    amax 2^-149 (the smallest float32): amax / MAX rounds to 0, so the scale is 1 and the bytes 0."""
    _, _, _, max_code = _FMT[fp8_dtype]
    x = torch.tensor([[2.0 ** -140, -(2.0 ** -140), 0.0], [2.0 ** -149, -(2.0 ** -149), 0.0]]).to(_DEV)
    q, s = per_token_quant_fp8(x, fp8_dtype)
    assert_same_quant((q.cpu(), s.cpu()), per_token_quant_reference(x.cpu(), fp8_dtype), "tiny")
    want_s = 2.0 ** -149 if fp8_dtype == torch.float8_e4m3fn else 2.0 ** -148
    assert s[0, 0].item() == want_s and _u8(q)[0].tolist() == [max_code, max_code | 0x80, 0]
    neg0 = 0x80 if fp8_dtype == torch.float8_e4m3fn else 0x00
    assert s[1, 0].item() == 1.0 and _u8(q)[1].tolist() == [0, neg0, 0]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_dequantised_within_half_a_step(dtype, fp8_dtype):
    """``q * scale`` is within half an FP8 step (at the quantised magnitude, times the scale) of
    ``f32(x)``, plus 2^-22 |x| for the two float32 roundings (division, dequantising product)."""
    _, bias, _, _ = _FMT[fp8_dtype]
    x = _rows_input(8, 256, dtype, seed=11, special=False)
    for q, s in (per_token_quant_fp8(x, fp8_dtype), per_group_quant_fp8(x, 64, fp8_dtype)):
        v = x.cpu().float()
        s_el = s.cpu().repeat_interleave(v.shape[1] // s.shape[1], dim=1)
        y = (v / s_el).abs()
        exp = torch.floor(torch.log2(y.clamp_min(2.0 ** -30))).clamp_min(1 - bias)
        step = torch.exp2(exp - 3)
        err = (q.cpu().float() * s_el - v).abs()
        bound = 0.5 * step * s_el + 2.0 ** -22 * v.abs()
        assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
        assert (err <= step * s_el).all()  # within one FP8 step, as the issue asks


@pytest.mark.parametrize("layout", ["row-strided", "transposed"])
def test_strided_inputs(layout):
    """Rows with a stride (a column slice) and a transposed view (copied): same bytes as contiguous."""
    base = _rows_input(16, 80, torch.bfloat16, seed=3, special=False)
    x = base[:5, :64] if layout == "row-strided" else base[:16, :5].t()
    want = per_token_quant_reference(x.cpu().contiguous())
    q, s = per_token_quant_fp8(x)
    assert_same_quant((q.cpu(), s.cpu()), want, layout)
    want_g = per_group_quant_reference(x.cpu().contiguous(), 16, column_major_scales=True)
    q, s = per_group_quant_fp8(x, 16, column_major_scales=True)
    assert_same_quant((q.cpu(), s.cpu()), want_g, layout)


@pytest.mark.parametrize("column_major", [False, True])
def test_zero_tokens(column_major):
    """T = 0: empty outputs of the right shapes, no launch."""
    x = torch.empty((0, 256), dtype=torch.bfloat16, device=_DEV)
    q, s = per_token_quant_fp8(x)
    assert q.shape == (0, 256) and s.shape == (0, 1)
    q, s = per_group_quant_fp8(x, 128, column_major_scales=column_major)
    assert q.shape == (0, 256) and s.shape == (0, 2)


_BAD = [
    ("not a tensor", lambda: per_token_quant_fp8([[1.0]]), TypeError, "x must be a torch.Tensor"),
    ("int dtype", lambda: per_token_quant_fp8(torch.ones(2, 16, dtype=torch.int32, device=_DEV)), TypeError,
     "x has dtype torch.int32"),
    ("3-D", lambda: per_token_quant_fp8(torch.ones(2, 2, 16, device=_DEV)), ValueError, "x must be 2-D"),
    ("H=0", lambda: per_token_quant_fp8(torch.ones(2, 0, device=_DEV)), ValueError, "H >= 1"),
    ("e5m2", lambda: per_token_quant_fp8(torch.ones(2, 16, device=_DEV), torch.float8_e5m2), ValueError,
     "fp8_dtype=torch.float8_e5m2"),
    ("wrong device", lambda: per_token_quant_fp8(torch.ones(2, 16, device="meta")), ValueError,
     "x is on meta"),
    ("H % group", lambda: per_group_quant_fp8(torch.ones(2, 100, device=_DEV), 32), ValueError,
     "H=100 elements per row, not a multiple of group_size=32"),
    ("group 96", lambda: per_group_quant_fp8(torch.ones(2, 192, device=_DEV), 96), ValueError,
     "group_size=96; expected a power of two"),
    ("group 0", lambda: per_group_quant_fp8(torch.ones(2, 192, device=_DEV), 0), ValueError, "group_size=0"),
    ("group 16384", lambda: per_group_quant_fp8(torch.ones(2, 16384, device=_DEV), 16384), ValueError,
     "group_size=16384"),
    ("group float", lambda: per_group_quant_fp8(torch.ones(2, 256, device=_DEV), 128.0), TypeError,
     "group_size must be an int"),
    ("group bool", lambda: per_group_quant_fp8(torch.ones(2, 256, device=_DEV), True), TypeError,
     "group_size must be an int"),
    ("group fp8", lambda: per_group_quant_fp8(torch.ones(2, 256, device=_DEV), 128, torch.int8), ValueError,
     "fp8_dtype=torch.int8"),
]


@pytest.mark.parametrize("case", _BAD, ids=[c[0] for c in _BAD])
def test_bad_inputs_raise_naming_the_argument(case):
    _, call, exc, text = case
    with pytest.raises(exc) as info:
        call()
    assert text in str(info.value)
    assert str(info.value).startswith(("per_token_quant_fp8: ", "per_group_quant_fp8: "))


def test_reference_rejects_bad_groups():
    with pytest.raises(ValueError, match="H=100 is not a multiple of group_size=32"):
        per_group_quant_reference(torch.ones(2, 100), 32)
    with pytest.raises(ValueError, match="fp8_dtype"):
        per_token_quant_reference(torch.ones(2, 16), torch.float8_e5m2)


# ---------------------------------------------------------------------------------------------------
# The fast division (``kq.divide``): the same quotient as ``div_rn`` for every 16-bit value and scale.

@triton.jit
def _division_kernel(v_ptr, n_v, amax_ptr, counts_ptr, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One program per amax, over every ``v`` with ``|v| <= amax``: counts FP8 bytes of :func:`kq.divide`'s quotient
    that differ from those of ``div_rn``'s, bytes of :func:`kq.quantize` (the epilogues' encoder, native
    where ``NATIVE_FP8``) that differ from them too, quotients of at least 2^-12 whose bits differ, and
    whether the scale took the fast path."""
    amax = tl.load(amax_ptr + tl.program_id(0))
    scale = kq.fp8_scale(amax, FP8)
    recip, fast = kq.token_division(scale, True)
    bad_bytes = tl.zeros([BLOCK], dtype=tl.int32)
    bad_quant = tl.zeros([BLOCK], dtype=tl.int32)
    bad_bits = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, n_v, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        v = tl.load(v_ptr + offs, mask=offs < n_v, other=0.0)
        m = (offs < n_v) & (tl.abs(v) <= amax)  # the values a row (group) of this amax holds
        got = kq.divide(v, scale, recip, fast)
        want = tl.math.div_rn(v, scale)
        want_bytes = kq.fp8_encode_soft(want, FP8)
        bad_bytes += (m & (kq.fp8_encode_soft(got, FP8) != want_bytes)).to(tl.int32)
        bad_quant += (m & (kq.quantize(v, scale, recip, fast, FP8, NATIVE_FP8) != want_bytes)).to(tl.int32)
        differ = got.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True)
        bad_bits += (m & differ & (tl.abs(want) >= 2.0 ** -12)).to(tl.int32)
    tl.atomic_add(counts_ptr, tl.sum(bad_bytes, axis=0) + tl.sum(bad_quant, axis=0))
    tl.atomic_add(counts_ptr + 1, tl.sum(bad_bits, axis=0))
    tl.atomic_add(counts_ptr + 2, fast.to(tl.int32))


def _sixteen_bit_values(dtype) -> torch.Tensor:
    """Every finite value of a 16-bit ``dtype`` (both zeros and the subnormals), as float32."""
    v = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    return v[v.isfinite()]


def division_mismatches(dtype, fp8_dtype, amax_stride: int = 1, device: str = _DEV) -> tuple[int, int, int]:
    """``(differing FP8 bytes, differing quotients >= 2^-12, scales that took the fast path)`` of
    :func:`kq.divide` and :func:`kq.quantize` (with the device's native conversion where it has one)
    against ``div_rn`` over every ``amax_stride``-th positive finite amax of ``dtype`` (each gives one
    scale) and every finite ``v`` of ``dtype`` with ``|v| <= amax``."""
    v = _sixteen_bit_values(dtype)
    amax = v[v > 0].unique()[::amax_stride].contiguous()
    counts = torch.zeros(3, dtype=torch.int32, device=device)
    _division_kernel[(amax.numel(),)](v.to(device), v.numel(), amax.to(device), counts, FP8=_TL[fp8_dtype],
                                      NATIVE_FP8=native_fp8(torch.device(device), fp8_dtype), BLOCK=4096)
    return tuple(int(c) for c in counts.cpu())


#: (16-bit dtype, FP8 format) pairs of the sampled division test: all four on a GPU; on CPU (each pair
#: is about 15 s under the interpreter) each dtype and each format once.
DIVISION_PAIRS = ([(d, f) for d in (torch.bfloat16, torch.float16) for f in FP8_DTYPES] if _ON_GPU
                  else [(torch.bfloat16, FP8_DTYPES[0]), (torch.float16, FP8_DTYPES[1])])


@pytest.mark.parametrize("dtype,fp8_dtype", DIVISION_PAIRS,
                         ids=[f"{dtype_name(d)}-{fp8_name(f)}" for d, f in DIVISION_PAIRS])
def test_fast_division_sampled(dtype, fp8_dtype):
    """Every 16-bit value against every 1024th scale: :func:`kq.divide` gives ``div_rn``'s bytes."""
    bad_bytes, bad_bits, fast = division_mismatches(dtype, fp8_dtype, amax_stride=1024)
    assert fast > 20, f"only {fast} scales took the fast path: the test would not test it"
    assert (bad_bytes, bad_bits) == (0, 0), f"{bad_bytes} bytes and {bad_bits} quotients differ from div_rn's"


# ---------------------------------------------------------------------------------------------------
# GPU: the hardware conversion and the kernels on real shapes.

gpu = [pytest.mark.gpu, pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
def test_gpu_encoder_every_float32(fp8_dtype):
    """All 2^32 float32 bit patterns: the integer encoder == torch (clamp, convert, canonical NaN) on
    the GPU, and, for e4m3fn where the device converts natively, the hardware path == both."""
    native = native_fp8(torch.device("cuda"), fp8_dtype)
    chunk = 1 << 28
    for start in range(-(1 << 31), 1 << 31, chunk):
        x = torch.arange(start, start + chunk, dtype=torch.int64, device="cuda").to(torch.int32).view(torch.float32)
        want = torch_fp8_bytes(x, fp8_dtype)
        soft = encode(x, fp8_dtype, native=False)
        assert torch.equal(soft, want), f"soft encoder differs from torch in chunk {start:#x}"
        if native:
            assert torch.equal(encode(x, fp8_dtype, native=True), want), f"native differs in chunk {start:#x}"


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("T,H", [(1, 7168), (4096, 6144), (512, 16384), (33, 2880)])
@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
def test_gpu_kernels_match_reference(T, H, dtype, fp8_dtype):
    """Per-token and per-group (128, both layouts) on the GPU == the reference on the CPU."""
    x = _rows_input(T, H, dtype, seed=T + H)
    assert_same_quant(tuple(t.cpu() for t in per_token_quant_fp8(x, fp8_dtype)),
                      per_token_quant_reference(x.cpu(), fp8_dtype), "per-token")
    G = 64 if H % 128 else 128
    for cm in (False, True):
        assert_same_quant(tuple(t.cpu() for t in per_group_quant_fp8(x, G, fp8_dtype, cm)),
                          per_group_quant_reference(x.cpu(), G, fp8_dtype, cm), f"per-group cm={cm}")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=dtype_name)
@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
def test_gpu_fast_division_every_pair(dtype, fp8_dtype):
    """All (value, amax) pairs of a 16-bit dtype with ``|value| <= amax`` (about 2^30): ``kq.divide`` gives
    ``div_rn``'s FP8 bytes and, from 2^-12 up, its quotient bits (what lets the FP8 epilogues skip the
    per-element correctly rounded division)."""
    bad_bytes, bad_bits, fast = division_mismatches(dtype, fp8_dtype)
    assert (bad_bytes, bad_bits) == (0, 0), f"{bad_bytes} bytes and {bad_bits} quotients differ from div_rn's"
    assert fast > 20000, f"only {fast} scales took the fast path"  # bf16: 26,784 (amax >= 448 * 2^-90)
