"""The quantised output forms of ``tpcomm/reference.py`` (docs/numerics.md, "Quantised output forms
(definitions)"): static per-tensor FP8, per-group FP8 with UE8M0 scales and their packed int32 layout,
MXFP4, NVFP4 and the 128x4 scale swizzle.

Each rule has a case computed by hand (bytes written out), each layout an index formula written out
independently of the reference's reshapes, each form a round-trip error bound derived from its element
format, and bad inputs raise. Where torchao is installed, its MX and NVFP4 quantisers (plain torch on the
CPU) must give the same bytes on inputs where the definitions agree (docs/numerics.md says where they
do not).
"""

import math
import sys

import pytest
import torch

from tests.support.numerics import dtype_name
from tpcomm.reference import (
    mxfp4_dequant_reference,
    mxfp4_quant_reference,
    nvfp4_dequant_reference,
    nvfp4_global_scale,
    nvfp4_quant_reference,
    pack_ue8m0_scales,
    per_group_ue8m0_quant_reference,
    static_fp8_quant_reference,
    swizzle_128x4,
    unswizzle_128x4,
)

QUANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
#: Per FP8 format: largest finite value, byte of +MAX, byte of every NaN.
_FP8 = {torch.float8_e4m3fn: (448.0, 0x7E, 0x7F), torch.float8_e4m3fnuz: (240.0, 0x7F, 0x80)}
#: E2M1 magnitudes by code.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
RULES = ("floor", "even", "rceil")
NAN = float("nan")
INF = float("inf")


def fp8_name(d):
    return str(d).replace("torch.float8_", "")


def _u8(t):
    return t.contiguous().view(torch.uint8)


def _fp8_byte(value: float, fp8_dtype) -> int:
    """Byte of a value that ``fp8_dtype`` holds exactly (torch's encoder, checked in tests/quant/test_quant.py)."""
    return torch.tensor([value]).to(fp8_dtype).view(torch.uint8).item()


def _codes(q: torch.Tensor) -> torch.Tensor:
    """Unpacked E2M1 codes, element 2i from the low nibble of byte i (written apart from the reference)."""
    out = torch.empty((q.shape[0], 2 * q.shape[1]), dtype=torch.uint8)
    out[:, 0::2] = q & 0x0F
    out[:, 1::2] = q >> 4
    return out


def _row(values, width, dtype=torch.float32):
    """One row of ``width`` elements: ``values`` first, zeros after."""
    r = torch.zeros(width, dtype=torch.float64)
    r[:len(values)] = torch.tensor(values, dtype=torch.float64)
    return r.to(dtype)


def _blocks(firsts, block, rest=()):
    """One row: block ``i`` starts with ``firsts[i]`` then ``rest``, zeros after."""
    return torch.cat([_row([a, *rest], block) for a in firsts]).unsqueeze(0)


def _random_rows(T, H, dtype, seed, spread=12):
    """Normal values, each row scaled by its own power of two in [2^-spread, 2^spread] (at most 2^12 for
    fp16, whose largest value is 65504)."""
    if dtype == torch.float16:
        spread = min(spread, 12)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((T, H), generator=g, dtype=torch.float64)
    k = torch.randint(-spread, spread + 1, (T, 1), generator=g).double()
    return (x * torch.exp2(k)).to(dtype)


# ---------------------------------------------------------------------------------------------------
# Static per-tensor FP8 (vLLM's static_scaled_fp8_quant).

@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=fp8_name)
def test_static_fp8_saturates_and_maps_nan(fp8_dtype):
    """scale 2: 2 * MAX and beyond saturate to +-MAX, +-Inf too, NaN gives the canonical NaN byte, 3
    gives 1.5 (exact)."""
    fmax, max_byte, nan_byte = _FP8[fp8_dtype]
    x = torch.tensor([[2 * fmax, 1000.0, -2000.0, 3.0, NAN, INF, -INF, -NAN]])
    q = static_fp8_quant_reference(x, torch.tensor(2.0), fp8_dtype)
    want = [max_byte, max_byte, max_byte | 0x80, _fp8_byte(1.5, fp8_dtype), nan_byte, max_byte,
            max_byte | 0x80, nan_byte]
    assert q.dtype == fp8_dtype and q.shape == x.shape
    assert _u8(q)[0].tolist() == want


def test_static_fp8_negative_zero_and_e4m3fn_bytes():
    """e4m3fn bytes written out: 1.5 is 0x3C, 448 is 0x7E, -0.0 stays -0.0 (0x80)."""
    x = torch.tensor([[3.0, 896.0, -0.0, 0.0]], dtype=torch.bfloat16)
    assert _u8(static_fp8_quant_reference(x, torch.tensor([2.0])))[0].tolist() == [0x3C, 0x7E, 0x80, 0x00]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=dtype_name)
def test_static_fp8_multiplies_by_the_reciprocal(dtype):
    """vLLM computes ``x * f32(1 / scale)``, not ``x / scale``. With scale 7 and x = 10.9375, x / 7 is
    1.5625 exactly, an e4m3 tie that rounds to even (1.5); f32(1/7) is a little above 1/7, so the
    product is 1.5625001 and rounds up to 1.625."""
    s = torch.tensor(7.0)
    x = torch.tensor([[10.9375]], dtype=dtype)
    inv = (1.0 / s.double()).float()
    assert x.double().item() / 7.0 == 1.5625 and (x.float() * inv).item() > 1.5625  # the case is a tie
    assert _u8(static_fp8_quant_reference(x, s)).item() == _fp8_byte(1.625, torch.float8_e4m3fn)
    assert _fp8_byte(1.5, torch.float8_e4m3fn) != _fp8_byte(1.625, torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=dtype_name)
def test_static_fp8_round_trip(dtype):
    """``|f32(q) * scale - x| <= (2^-4 + 2^-20) |x| + 2^-10 scale``: e4m3 keeps 3 mantissa bits (half
    an ulp is 2^-4 relative), its subnormals are 2^-9 apart (half: 2^-10), and the float32 reciprocal
    and products add a few 2^-24; with ``scale = amax / 448`` nothing saturates."""
    x = _random_rows(5, 123, dtype, seed=1, spread=4)
    scale = (x.float().abs().max() / 448.0).reshape(1)
    q = static_fp8_quant_reference(x, scale)
    err = (q.double() * scale.double() - x.double()).abs()
    bound = (2.0 ** -4 + 2.0 ** -20) * x.double().abs() + 2.0 ** -10 * scale.double()
    assert bool((err <= bound).all()), (err - bound).max()


@pytest.mark.parametrize("bad, match", [
    (torch.tensor(2.0, dtype=torch.float64), "float32"),
    (2.0, "float32"),
    (torch.tensor([1.0, 2.0]), "one element"),
    (torch.tensor(NAN), "finite positive"),
    (torch.tensor(INF), "finite positive"),
    (torch.tensor(0.0), "finite positive"),
    (torch.tensor(-1.0), "finite positive"),
])
def test_static_fp8_rejects_bad_scales(bad, match):
    with pytest.raises(ValueError, match=f"static_fp8_quant_reference: scale.*{match}"):
        static_fp8_quant_reference(torch.ones(2, 4), bad)


def test_static_fp8_rejects_bad_inputs():
    with pytest.raises(ValueError, match="x has shape"):
        static_fp8_quant_reference(torch.ones(4), torch.tensor(1.0))
    with pytest.raises(ValueError, match="x has dtype"):
        static_fp8_quant_reference(torch.ones(2, 4, dtype=torch.int32), torch.tensor(1.0))
    with pytest.raises(ValueError, match="fp8_dtype"):
        static_fp8_quant_reference(torch.ones(2, 4), torch.tensor(1.0), torch.float8_e5m2)


# ---------------------------------------------------------------------------------------------------
# Per-group FP8 with UE8M0 scales (DeepGEMM / vLLM use_ue8m0=True) and the packed int32 layout.

def test_ue8m0_scale_is_rounded_up_to_a_power_of_two():
    """Group amax -> scale, by hand: 448 -> 1 (already a power of two: not raised), 449 -> 2 (rounding
    down would give 1 and saturate 449), 56 -> 2^-3, 57 -> 2^-2, 0 -> 1, 458752.03125 (amax / 448 just
    above 2^10) -> 2^11, 448 * 2^-130 (amax / 448 = 2^-130) -> 2^-127 (the smallest E8M0 value), 1e-45
    (amax / 448 underflows) -> 1, 3e38 -> 2^120, Inf -> Inf, NaN -> NaN."""
    amaxes = [448.0, 449.0, 56.0, 57.0, 0.0, 458752.03125, 448 * 2.0 ** -130, 1e-45, 3e38, INF, NAN]
    x = _blocks(amaxes, 32)
    q, scales = per_group_ue8m0_quant_reference(x, group_size=32)
    want = [1.0, 2.0, 2.0 ** -3, 2.0 ** -2, 1.0, 2.0 ** 11, 2.0 ** -127, 1.0, 2.0 ** 120, INF]
    assert scales.dtype == torch.float32 and scales.shape == (1, len(amaxes))
    assert scales[0, :-1].tolist() == want
    assert scales[0, -1].view(torch.int32).item() == 0x7FC00000  # the one NaN bit pattern
    # elements: 449 / 2 = 224.5 -> 224 (e4m3 spacing 16 there); 458752.03125 / 2^11 = 224.00002 -> 224
    got = _u8(q).reshape(len(amaxes), 32)[:, 0].tolist()
    assert got[0] == 0x7E and got[1] == _fp8_byte(224.0, torch.float8_e4m3fn) and got[5] == got[1]
    assert got[-2] == 0x7F and got[-1] == 0x7F  # Inf / Inf and NaN: NaN


def test_ue8m0_infinite_group_follows_ieee():
    """A group holding +-Inf has scale +Inf: Inf / Inf is NaN (0x7F), finite / Inf is 0."""
    x = _row([INF, 1.0, -INF, -2.0], 32).unsqueeze(0)
    q, scales = per_group_ue8m0_quant_reference(x, group_size=32)
    assert scales.item() == INF
    assert _u8(q)[0, :4].tolist() == [0x7F, 0x00, 0x7F, 0x80]


def test_ue8m0_e4m3fnuz_uses_240():
    x = _blocks([240.0, 241.0], 32)
    _, scales = per_group_ue8m0_quant_reference(x, 32, torch.float8_e4m3fnuz)
    assert scales[0].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("group_size", (32, 128))
@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=dtype_name)
def test_ue8m0_matches_independent_formulas(dtype, group_size):
    """Scales equal ``2^ceil(log2(f32(amax / 448)))`` in float64 and DeepGEMM's bit rule (biased exponent
    plus one when any mantissa bit is set); the elements are within half an e4m3 ulp (relative 2^-4,
    2^-10 of the scale for subnormals) and never saturate (``scale * 448 >= amax``)."""
    x = _random_rows(7, 4 * group_size, dtype, seed=2, spread=30)
    q, scales = per_group_ue8m0_quant_reference(x, group_size)
    amax = x.double().abs().reshape(7, 4, group_size).amax(-1)
    s = (amax / 448.0).float()  # float64 division rounded once: the correctly rounded float32 quotient
    assert torch.equal(scales.double(), torch.exp2(torch.ceil(torch.log2(s.double()))))
    b = s.view(torch.int32)
    deepgemm = (((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).int()) << 23
    assert torch.equal(scales.view(torch.int32), deepgemm)
    assert bool((scales.double() * 448.0 >= amax).all())
    sc = scales.double().repeat_interleave(group_size, 1)
    err = (q.double() * sc - x.double()).abs()
    assert bool((err <= 2.0 ** -4 * x.double().abs() + 2.0 ** -10 * sc).all())


def _packed_word(flat: torch.Tensor, index: int) -> int:
    return flat[index].item() & 0xFFFFFFFF


@pytest.mark.parametrize("T, G", [(5, 6), (8, 8), (1, 1), (3, 4), (0, 3)])
def test_pack_ue8m0_layout(T, G):
    """Byte ``j`` of int32 ``[t, k]`` (bits 8j..8j+7) is the E8M0 byte ``127 + log2(scale)`` of group
    ``4k + j``; int32 ``[t, k]`` sits at ``k * Tp + t`` with ``Tp`` = T rounded up to 4; padding groups and
    rows are zero bytes; NaN and Inf give 0xFF."""
    e = (torch.arange(T).reshape(T, 1) * 7 + torch.arange(G).reshape(1, G) * 3) % 60 - 30
    scales = torch.exp2(e.double()).float()
    if T * G >= 6:
        scales[0, 1], scales[T - 1, G - 1] = NAN, INF
    packed = pack_ue8m0_scales(scales)
    K, Tp = (G + 3) // 4, (T + 3) // 4 * 4
    assert packed.dtype == torch.int32 and packed.shape == (T, K) and packed.stride() == (1, Tp)
    flat = packed.as_strided((K * Tp,), (1,))  # the whole buffer, padding rows included
    for k in range(K):
        for t in range(Tp):
            word = _packed_word(flat, k * Tp + t)
            for j in range(4):
                g = 4 * k + j
                if t < T and g < G:
                    want = 0xFF if not math.isfinite(scales[t, g].item()) else 127 + int(e[t, g])
                else:
                    want = 0
                assert (word >> (8 * j)) & 0xFF == want, (t, k, j)
                if sys.byteorder == "little":  # what the GPU reads: byte j of the word at address 4 * index
                    assert flat.view(torch.uint8)[4 * (k * Tp + t) + j].item() == want
    # the same bytes from a column-major (transposed) scale tensor
    assert torch.equal(pack_ue8m0_scales(scales.t().contiguous().t()), packed)


def test_pack_ue8m0_round_trips_the_quantiser_scales():
    """The quantiser's scales (rows spread over 2^-40..2^40) come back from the packed bytes."""
    x = _random_rows(6, 7 * 128, torch.bfloat16, seed=3, spread=40)
    _, scales = per_group_ue8m0_quant_reference(x)
    words = pack_ue8m0_scales(scales).to(torch.int64) & 0xFFFFFFFF  # (6, 2)
    bytes_ = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1).reshape(6, 8)
    assert torch.equal(torch.exp2(bytes_[:, :7].double() - 127).float(), scales)
    assert not bool(bytes_[:, 7].any())  # the eighth group is padding


@pytest.mark.parametrize("bad", [0.75, 0.0, -1.0, 2.0 ** -128, 3.0])
def test_pack_ue8m0_rejects_values_that_are_not_e8m0(bad):
    scales = torch.ones(2, 4)
    scales[1, 2] = bad
    with pytest.raises(ValueError, match="pack_ue8m0_scales: scales holds values"):
        pack_ue8m0_scales(scales)


def test_pack_ue8m0_rejects_bad_tensors():
    with pytest.raises(ValueError, match="2-D float32"):
        pack_ue8m0_scales(torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D float32"):
        pack_ue8m0_scales(torch.ones(4))


def test_ue8m0_rejects_bad_inputs():
    with pytest.raises(ValueError, match="H=100 is not a multiple of group_size=128"):
        per_group_ue8m0_quant_reference(torch.ones(2, 100))
    with pytest.raises(ValueError, match="group_size"):
        per_group_ue8m0_quant_reference(torch.ones(2, 128), group_size=0)
    with pytest.raises(ValueError, match="fp8_dtype"):
        per_group_ue8m0_quant_reference(torch.ones(2, 128), fp8_dtype=torch.float8_e5m2)


# ---------------------------------------------------------------------------------------------------
# MXFP4 (OCP MX v1.0: 32 elements, E8M0 scale, E2M1 elements).

def test_e2m1_rounds_to_nearest_even_and_saturates():
    """In a block whose amax is 7 (floor(log2 7) - 2 = 0: X = 1) the elements are E2M1 of themselves.
    The ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to the even code; 7 and -6.5 saturate to +-6; -0.25
    and -0.0 keep their sign (0x8)."""
    pairs = [(7.0, 7), (0.0, 0), (0.25, 0), (0.3, 1), (0.75, 2), (0.74, 1), (1.25, 2), (1.3, 3), (1.75, 4),
             (2.5, 4), (2.6, 5), (3.5, 6), (4.9, 6), (5.0, 6), (5.5, 7), (6.0, 7), (-0.25, 8), (-0.0, 8),
             (-6.5, 15), (-1.75, 12), (-3.5, 14), (1e-30, 0)]
    x = _row([v for v, _ in pairs], 32).unsqueeze(0)
    q, scales = mxfp4_quant_reference(x)
    assert q.dtype == torch.uint8 and q.shape == (1, 16) and scales.tolist() == [[127]]
    assert _codes(q)[0, :len(pairs)].tolist() == [c for _, c in pairs]


def test_mxfp4_nibble_order():
    """Element 2i goes in the low nibble of byte i: (1.0, 6.0) -> 0x72, (0.5, -2.0) -> 0xC1."""
    x = _row([1.0, 6.0, 0.5, -2.0], 32).unsqueeze(0)
    q, _ = mxfp4_quant_reference(x)
    assert q[0, :3].tolist() == [0x72, 0xC1, 0x00]


#: amax -> E8M0 byte per scale rule, by hand. 6144.00048828125 = 6 * 2^10 plus one float32 ulp, so its
#: amax / 6 is just above 2^10; 3e38 = 1.763 * 2^127.
_MX_SCALES = [
    (7.99, {"floor": 127, "even": 128, "rceil": 128}),
    (8.0, {"floor": 128, "even": 128, "rceil": 128}),
    (6.0, {"floor": 127, "even": 127, "rceil": 127}),
    (6.01, {"floor": 127, "even": 127, "rceil": 128}),
    (7.0, {"floor": 127, "even": 128, "rceil": 128}),
    (6.99, {"floor": 127, "even": 127, "rceil": 128}),
    (12.0, {"floor": 128, "even": 128, "rceil": 128}),
    (12.01, {"floor": 128, "even": 128, "rceil": 129}),
    (1.0, {"floor": 125, "even": 125, "rceil": 125}),
    (6144.00048828125, {"floor": 137, "even": 137, "rceil": 138}),
    (2.0 ** -130, {"floor": 0, "even": 0, "rceil": 0}),
    (3e38, {"floor": 252, "even": 253, "rceil": 253}),
    (0.0, {"floor": 0, "even": 0, "rceil": 0}),
]


@pytest.mark.parametrize("rule", RULES)
def test_mxfp4_scale_exponent_rules(rule):
    """floor: floor(log2 amax) - 2; even: the same after rounding amax up to a power of two when its
    significand is >= 1.75; rceil: ceil(log2(amax / 6)); clamped to [-127, 127] (a zero block: byte 0)."""
    x = _blocks([a for a, _ in _MX_SCALES], 32)
    _, scales = mxfp4_quant_reference(x, rule)
    assert scales[0].tolist() == [want[rule] for _, want in _MX_SCALES]


@pytest.mark.parametrize("rule", RULES)
def test_mxfp4_zero_nan_and_inf_blocks(rule):
    """A zero block: scale byte 0, codes 0 (a -0.0 keeps its sign: 0x8). A block holding NaN, +Inf or
    -Inf: scale byte 0xFF (E8M0 NaN) and all-zero codes."""
    zero = _row([0.0, -0.0], 32)
    nan, inf, ninf = _row([1.0, NAN, -3.0], 32), _row([INF, 2.0], 32), _row([-INF, 5.0], 32)
    q, scales = mxfp4_quant_reference(torch.stack([zero, nan, inf, ninf]), rule)
    assert scales[:, 0].tolist() == [0, 0xFF, 0xFF, 0xFF]
    codes = _codes(q)
    assert codes[0, :2].tolist() == [0, 8] and not bool(codes[0, 2:].any()) and not bool(codes[1:].any())
    deq = mxfp4_dequant_reference(q, scales)
    assert bool(deq[1:].isnan().all()) and bool((deq[0] == 0).all())


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=dtype_name)
def test_mxfp4_round_trip(dtype, rule):
    """``|x - e2m1 * X| <= max(|x|, X) / 4 + max(|x| - 6X, 0)``: E2M1 steps are 0.5 below 2 and half the
    magnitude's power of two above (half a step <= max(|y|, 1) / 4 for y = x / X <= 6), and larger
    magnitudes saturate to 6. floor puts amax / X in [4, 8); rceil keeps it <= 6."""
    x = _random_rows(5, 256, dtype, seed=4, spread=20)
    q, scales = mxfp4_quant_reference(x, rule)
    X = torch.exp2(scales.double() - 127).repeat_interleave(32, 1)
    xd = x.double()
    err = (mxfp4_dequant_reference(q, scales).double() - xd).abs()
    bound = torch.maximum(xd.abs(), X) / 4 + (xd.abs() - 6 * X).clamp(min=0)
    assert bool((err <= bound).all()), (err - bound).max()
    ratio = xd.abs().reshape(5, 8, 32).amax(-1) / X[:, ::32]
    if rule == "floor":
        assert bool(((ratio >= 4) & (ratio < 8)).all())
    if rule == "rceil":
        assert bool((ratio <= 6 * (1 + 2.0 ** -23)).all())


def test_mxfp4_zero_rows():
    q, scales = mxfp4_quant_reference(torch.zeros(0, 64))
    assert q.shape == (0, 32) and scales.shape == (0, 2)


def test_mxfp4_rejects_bad_inputs():
    with pytest.raises(ValueError, match="H=48 is not a multiple of block=32"):
        mxfp4_quant_reference(torch.ones(2, 48))
    with pytest.raises(ValueError, match="scale_rule"):
        mxfp4_quant_reference(torch.ones(2, 32), "nearest")
    with pytest.raises(ValueError, match="x has dtype"):
        mxfp4_quant_reference(torch.ones(2, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        mxfp4_dequant_reference(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------------
# NVFP4 (16 elements, E4M3 block scale, float32 global scale).

def test_nvfp4_block_scales_and_elements():
    """global_scale 1, one block per case:
    amax 6 -> s 1.0 (0x38), codes of 6, -6, 3, 1.5, 0.25 are 7, 15, 5, 3, 0;
    amax 7.125 -> 7.125 / 6 = 1.1875, an e4m3 tie -> 1.25 (0x3A); 7.125 * f32(1 / 1.25) = 5.7 -> 6;
    amax 2688 -> s 448 (0x7E); amax 3000 -> s 500 saturates to 448, 3000 / 448 = 6.7 saturates to 6;
    amax 6 * 2^-8 -> s 2^-8, an e4m3 subnormal (0x02); amax 6 * 2^-11 -> s below half the smallest
    subnormal -> 0 (0x00), its elements x * 0 (a negative one keeps its sign, 0x8);
    zero block -> 0x00; NaN, Inf -> 0x7F (NaN) with zero codes."""
    blocks = [[6.0, -6.0, 3.0, 1.5, 0.25], [7.125, 1.25], [2688.0], [3000.0, -3000.0], [6 * 2.0 ** -8],
              [6 * 2.0 ** -11, -3 * 2.0 ** -11], [0.0, -0.0], [NAN, 1.0], [INF, 1.0]]
    x = torch.cat([_row(b, 16) for b in blocks]).unsqueeze(0)
    q, s = nvfp4_quant_reference(x, torch.tensor(1.0))
    assert q.dtype == torch.uint8 and q.shape == (1, 72) and s.dtype == torch.float8_e4m3fn
    assert _u8(s)[0].tolist() == [0x38, 0x3A, 0x7E, 0x7E, 0x02, 0x00, 0x00, 0x7F, 0x7F]
    c = _codes(q).reshape(9, 16)
    assert c[0, :5].tolist() == [7, 15, 5, 3, 0]
    assert c[1, :2].tolist() == [7, 2] and c[2, 0] == 7 and c[3, :2].tolist() == [7, 15] and c[4, 0] == 7
    assert c[5, :2].tolist() == [0, 8] and c[6, :2].tolist() == [0, 8]
    assert not bool(c[7:].any())


def test_nvfp4_global_scale_multiplies_the_block_scale():
    """global 2: amax 6 -> s = 6 / 6 * 2 = 2.0 (0x40); the elements are x * (2 / 2) = x."""
    q, s = nvfp4_quant_reference(_row([6.0, 1.0], 16).unsqueeze(0), torch.tensor([2.0]))
    assert _u8(s).tolist() == [[0x40]] and _codes(q)[0, :2].tolist() == [7, 2]


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=dtype_name)
def test_nvfp4_tensor_amax_block_gets_448(dtype):
    """With TensorRT-LLM's global scale 448 * 6 / amax, the block holding the tensor's amax gets the
    block scale 448 (its product rounds to within a few float32 ulps of 448, far below e4m3's spacing
    of 32 there) and its largest element the code of 6; no block scale exceeds 448."""
    x = _random_rows(4, 160, dtype, seed=5, spread=6)
    g = nvfp4_global_scale(x.float().abs().max())
    assert g.item() == pytest.approx(2688.0 / x.float().abs().max().item(), rel=2.0 ** -23)
    q, s = nvfp4_quant_reference(x, g)
    flat = x.float().abs().reshape(-1)
    i = int(flat.argmax())
    t, blk = divmod(i, 160)
    assert s[t, blk // 16].float().item() == 448.0
    assert _codes(q)[t, blk].item() & 0x7 == 7
    assert bool((s.float() <= 448).all())


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=dtype_name)
def test_nvfp4_round_trip(dtype):
    """With ``d = s / global``: ``|x - e2m1 * d| <= max(|x|, d) / 4 + max(|x| - 6d, 0) + 2^-20 |x|``
    (half an E2M1 step, as for MXFP4, saturation above 6, and the two float32 roundings of
    ``x * f32(global / s)``, each 2^-24 relative, with room); blocks whose scale rounds to 0 dequantise to
    0 and had ``amax * global / 6 <= 2^-10`` (half the smallest e4m3 subnormal)."""
    x = _random_rows(6, 128, dtype, seed=6, spread=10)
    g = nvfp4_global_scale(x.float().abs().max())
    q, s = nvfp4_quant_reference(x, g)
    xd = x.double()
    d = (s.double() / g.double()).repeat_interleave(16, 1)
    err = (nvfp4_dequant_reference(q, s, g).double() - xd).abs()
    bound = torch.maximum(xd.abs(), d) / 4 + (xd.abs() - 6 * d).clamp(min=0) + 2.0 ** -20 * xd.abs()
    live = d > 0
    assert bool((err[live] <= bound[live]).all()), (err - bound)[live].max()
    assert bool((err[~live] == xd.abs()[~live]).all())
    assert bool((xd.abs()[~live] * g.double() / 6 <= 2.0 ** -10 * (1 + 2.0 ** -20)).all())


@pytest.mark.parametrize("bad", [torch.tensor(INF), torch.tensor(0.0), torch.tensor(-2.0), torch.tensor(NAN),
                                 torch.tensor(1.0, dtype=torch.float16), torch.ones(2)])
def test_nvfp4_rejects_bad_global_scales(bad):
    with pytest.raises(ValueError, match="nvfp4_quant_reference: global_scale"):
        nvfp4_quant_reference(torch.ones(2, 16), bad)


def test_nvfp4_rejects_bad_inputs():
    with pytest.raises(ValueError, match="H=24 is not a multiple of block=16"):
        nvfp4_quant_reference(torch.ones(2, 24), torch.tensor(1.0))
    with pytest.raises(ValueError, match="nvfp4_global_scale: amax"):
        nvfp4_global_scale(torch.tensor(0.0))
    with pytest.raises(ValueError, match="block_scales"):
        nvfp4_dequant_reference(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1), torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------------
# The 128x4 swizzled scale layout (TensorRT-LLM get_sf_out_offset_128x4, CUTLASS, cuBLAS).

def _offset_128x4(m: torch.Tensor, k: torch.Tensor, cols: int) -> torch.Tensor:
    """TensorRT-LLM's ``get_sf_out_offset_128x4``, stride by stride: layout
    [m tile][k tile][32 rows][4 rows][4 cols]."""
    inner_k, inner_k_stride = k % 4, 1
    inner_m, inner_m_stride = (m % 128) // 32, 4 * inner_k_stride
    outer_m, outer_m_stride = m % 32, 4 * inner_m_stride
    k_tile, k_tile_stride = k // 4, 32 * outer_m_stride
    num_k_tiles = (cols + 3) // 4
    m_tile, m_tile_stride = m // 128, num_k_tiles * k_tile_stride
    return (m_tile * m_tile_stride + k_tile * k_tile_stride + outer_m * outer_m_stride
            + inner_m * inner_m_stride + inner_k * inner_k_stride)


@pytest.mark.parametrize("R, C", [(1, 1), (128, 4), (130, 5), (300, 9), (0, 3)])
def test_swizzle_128x4_offsets(R, C):
    g = torch.Generator().manual_seed(R * 31 + C)
    scales = torch.randint(1, 256, (R, C), generator=g, dtype=torch.uint8)
    out = swizzle_128x4(scales)
    Rp, Cp = (R + 127) // 128 * 128, (C + 3) // 4 * 4
    assert out.shape == (Rp, Cp) and out.dtype == torch.uint8 and out.is_contiguous()
    m = torch.arange(R).reshape(R, 1).expand(R, C)
    k = torch.arange(C).reshape(1, C).expand(R, C)
    flat = out.reshape(-1)
    off = _offset_128x4(m, k, C).reshape(-1)
    assert torch.equal(flat[off], scales.reshape(-1))
    padding = torch.ones(Rp * Cp, dtype=torch.bool)
    padding[off] = False
    assert not bool(flat[padding].any())  # every other byte is a zero pad
    assert torch.equal(unswizzle_128x4(out, R, C), scales)


def test_swizzle_128x4_keeps_the_dtype():
    s = torch.tensor([[1.0, 2.0], [448.0, 0.5]]).to(torch.float8_e4m3fn)
    out = swizzle_128x4(s)
    assert out.dtype == torch.float8_e4m3fn
    assert _u8(out).reshape(-1)[[0, 1, 16, 17]].tolist() == _u8(s).reshape(-1).tolist()


def test_swizzle_128x4_rejects_bad_inputs():
    with pytest.raises(ValueError, match="1-byte dtype"):
        swizzle_128x4(torch.ones(4, 4))
    with pytest.raises(ValueError, match="1-byte dtype"):
        swizzle_128x4(torch.ones(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected 512 bytes"):
        unswizzle_128x4(torch.zeros(256, dtype=torch.uint8), 3, 4)


# ---------------------------------------------------------------------------------------------------
# torchao's MX and NVFP4 quantisers, where torchao is installed (plain torch on the CPU).

def _torchao(module):
    return pytest.importorskip(f"torchao.prototype.mx_formats.{module}")


def _mx_input(dtype, seed):
    """Rows of blocks with exponents spread over 2^-30..2^30 (far from E8M0's clamp, where torchao
    divides by 2^-126 instead of 2^-127), with exact E2M1 ties and saturating values mixed in."""
    x = _random_rows(8, 256, torch.float64, seed, spread=30)
    X = torch.exp2(torch.floor(torch.log2(x.abs().reshape(8, 8, 32).amax(-1))) - 2)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])
    x.reshape(8, 8, 32)[:, :, 1:9] = ties * X.unsqueeze(-1)
    return x.to(dtype)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=dtype_name)
def test_mxfp4_matches_torchao(dtype, rule):
    mx = _torchao("mx_tensor")
    config = _torchao("config")
    mode = {"floor": config.ScaleCalculationMode.FLOOR, "even": config.ScaleCalculationMode.EVEN,
            "rceil": config.ScaleCalculationMode.RCEIL}[rule]
    x = _mx_input(dtype, seed=7)
    want_scales, want_q = mx.to_mx(x, torch.float4_e2m1fn_x2, 32, mode)
    q, scales = mxfp4_quant_reference(x, rule)
    assert torch.equal(scales, _u8(want_scales).reshape(scales.shape))
    assert torch.equal(q, _u8(want_q).reshape(q.shape))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=dtype_name)
def test_nvfp4_matches_torchao(dtype):
    """torchao's ``per_tensor_scale`` is the reciprocal of the global scale; with a power-of-two global
    scale both are exact, and then torchao's ``(1 / per_tensor_scale) / s`` is ``global / s``. Every block
    holds an element of half the tensor's amax, so no block scale falls below 2^-6, where torchao clamps
    (tpcomm keeps e4m3 subnormals)."""
    nv = _torchao("nvfp4_tensor")
    x = _random_rows(8, 128, torch.float64, seed=8, spread=0)
    amax = x.abs().max()
    x[:, ::16] = torch.where(x[:, ::16] < 0, -amax / 2, amax / 2)
    x = x.to(dtype)
    g = torch.exp2(torch.floor(torch.log2(2688.0 / x.float().abs().max()))).reshape(())
    want_s, want_q = nv.nvfp4_quantize(x, 16, (1.0 / g).reshape(()))
    q, s = nvfp4_quant_reference(x, g)
    assert torch.equal(_u8(s), _u8(want_s).reshape(s.shape))
    assert torch.equal(q, _u8(want_q).reshape(q.shape))


@pytest.mark.parametrize("R, C", [(130, 5), (256, 8), (3, 2)])
def test_swizzle_128x4_matches_torchao(R, C):
    utils = _torchao("utils")
    s = torch.randint(0, 256, (R, C), generator=torch.Generator().manual_seed(9), dtype=torch.uint8)
    assert torch.equal(swizzle_128x4(s).reshape(-1), utils.to_blocked(s))
