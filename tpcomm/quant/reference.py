"""Quantisation in plain torch: the oracle of the standalone quantisation (:mod:`tpcomm.quant.standalone`)
and of the fused ops' quantised outputs, and the fill of their fallback (:mod:`tpcomm.quant.forms`).

Per-token and per-group FP8 (docs/numerics.md item 4), then the other quantised output forms: static
per-tensor FP8, per-group FP8 with UE8M0 scales, MXFP4 and NVFP4, and the 128x4 scale layout. Every
function is re-exported by :mod:`tpcomm.reference`, where the tests and the docs name them.
"""

from __future__ import annotations

import torch

#: FP8 NaN byte the quantisation gives for every NaN (torch keeps the sign: 0xFF for -NaN in e4m3fn).
_FP8_NAN_BYTE = {torch.float8_e4m3fn: 0x7F, torch.float8_e4m3fnuz: 0x80}
#: float32 NaN (0x7FC00000) the scale of a row or group holding a NaN has.
_F32_NAN = torch.tensor(0x7FC00000, dtype=torch.int32).view(torch.float32).item()


def _fp8_quantize_reference(v: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` for float32 ``v`` and its amax (broadcastable): contract item 4 with the
    saturation and NaN rules of :mod:`tpcomm.kernels.quant`."""
    if fp8_dtype not in _FP8_NAN_BYTE:
        raise ValueError(f"fp8_dtype={fp8_dtype}; expected torch.float8_e4m3fn or torch.float8_e4m3fnuz")
    fp8_max = torch.finfo(fp8_dtype).max  # 448 (e4m3fn), 240 (e4m3fnuz)
    # A tensor divisor: torch on CUDA turns division by a Python scalar into a multiplication by its
    # reciprocal (1/448 is inexact), which is not the contract's correctly rounded amax / MAX.
    scale = amax / torch.full_like(amax, fp8_max)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # amax 0 (or an underflowing quotient)
    scale = torch.where(scale.isnan(), _F32_NAN, scale)  # one NaN bit pattern, whatever the platform's
    return _fp8_bytes(v / scale, fp8_dtype), scale


def per_token_quant_reference(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 quantisation in plain torch (contract item 4), the oracle of
    :func:`tpcomm.quant.per_token_quant_fp8`: ``amax = max |f32(x)|`` per row (NaN propagates),
    ``scale = amax / MAX`` (448 e4m3fn, 240 e4m3fnuz; 1 where that is 0), ``q = fp8(clamp(f32(x) /
    scale, -MAX, MAX))``, every NaN as the canonical NaN byte (0x7F e4m3fn, 0x80 e4m3fnuz).

    Args:
        x: ``(T, H)`` float tensor, ``H >= 1``.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
    Returns:
        ``(q, scales)``: ``q`` ``(T, H)`` of ``fp8_dtype``; ``scales`` ``(T, 1)`` float32.
    Raises:
        ValueError: another ``fp8_dtype``.
    """
    v = x.to(torch.float32)
    q, scale = _fp8_quantize_reference(v, v.abs().amax(dim=-1, keepdim=True), fp8_dtype)
    return q, scale


def per_group_quant_reference(x: torch.Tensor, group_size: int = 128,
                              fp8_dtype: torch.dtype = torch.float8_e4m3fn, column_major_scales: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group FP8 quantisation in plain torch: :func:`per_token_quant_reference` applied to each
    ``group_size`` consecutive elements of a row; the oracle of :func:`tpcomm.quant.per_group_quant_fp8`.

    Args:
        x: ``(T, H)`` float tensor, ``H`` a multiple of ``group_size``.
        group_size: elements per scale (default 128, DeepSeek-V3's 1 x 128).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        column_major_scales: return ``scales`` as the transpose view of a contiguous
            ``(H // group_size, T)`` tensor instead of a contiguous ``(T, H // group_size)`` one.
    Returns:
        ``(q, scales)``: ``q`` ``(T, H)`` of ``fp8_dtype``; ``scales`` ``(T, H // group_size)`` float32.
    Raises:
        ValueError: ``H`` is not a multiple of ``group_size``; another ``fp8_dtype``.
    """
    T, H = x.shape
    if group_size < 1 or H % group_size:
        raise ValueError(f"per_group_quant_reference: H={H} is not a multiple of group_size={group_size}")
    v = x.to(torch.float32).reshape(T, H // group_size, group_size)
    q, scale = _fp8_quantize_reference(v, v.abs().amax(dim=-1, keepdim=True), fp8_dtype)
    scales = scale.reshape(T, H // group_size)
    if column_major_scales:
        scales = torch.empty((H // group_size, T), dtype=torch.float32, device=x.device).t().copy_(scales)
    return q.reshape(T, H), scales


# ---------------------------------------------------------------------------------------------------
# Quantised output forms: static per-tensor FP8, per-group FP8 with UE8M0 scales, MXFP4 and NVFP4.
# docs/numerics.md, "Quantised output forms (definitions)", says what each one is and where the sources
# (vLLM, DeepGEMM, TensorRT-LLM, torchao, aiter, the OCP MX v1.0 spec) differ.

_QUANT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: E2M1 magnitudes by code (sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: E8M0 scale byte that means NaN (the format's only special value).
_E8M0_NAN = 0xFF
_E4M3_MAX = 448.0
_E2M1_MAX = 6.0


def _check_rows(x: torch.Tensor, op: str, block: int, what: str) -> None:
    """``x`` is ``(T, H)`` bf16/fp16/fp32 with ``H`` a multiple of ``block``."""
    if x.dtype not in _QUANT_INPUT_DTYPES:
        raise ValueError(f"{op}: x has dtype {x.dtype}; expected torch.bfloat16, torch.float16 or "
                         "torch.float32")
    if x.dim() != 2:
        raise ValueError(f"{op}: x has shape {tuple(x.shape)}; expected (T, H)")
    if x.shape[1] % block:
        raise ValueError(f"{op}: H={x.shape[1]} is not a multiple of {what}={block}")


def _check_fp8_dtype(op: str, fp8_dtype: torch.dtype) -> None:
    if fp8_dtype not in _FP8_NAN_BYTE:
        raise ValueError(f"{op}: fp8_dtype={fp8_dtype}; expected torch.float8_e4m3fn or "
                         "torch.float8_e4m3fnuz")


def _one_float32(op: str, name: str, t) -> torch.Tensor:
    """A float32 tensor of one finite positive element (a calibrated or global scale), as shape ``()``."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise ValueError(f"{op}: {name} must be a float32 tensor; got "
                         f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}; expected one element")
    v = t.reshape(())
    if not (torch.isfinite(v) and v > 0):
        raise ValueError(f"{op}: {name}={v.item()!r}; expected a finite positive float32")
    return v


def _fp8_bytes(qf: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 of float32 ``qf``: saturated to +-MAX, rounded to nearest even, every NaN as the canonical NaN
    byte (the byte rules of every FP8 reference here)."""
    fp8_max = torch.finfo(fp8_dtype).max
    qf = qf.clamp(-fp8_max, fp8_max)  # saturate; clamp keeps NaN
    # In range, torch's conversion rounds to nearest-even. Out of range it depends on the version and
    # device (2.13 CPU saturates e4m3fn; 2.11 CUDA gives NaN above 464), hence the clamp first.
    # NaN keeps its sign in torch (0xFF); here every NaN gets the one byte.
    q = torch.where(qf.isnan(), _FP8_NAN_BYTE[fp8_dtype], qf.to(fp8_dtype).view(torch.uint8))
    return q.to(torch.uint8).view(fp8_dtype)


def _pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` as float32 for integer ``e`` in ``[-127, 127]``, built from its bits (2^-127 is the
    subnormal 0x00400000)."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=1) << 23
    return torch.where(e == -127, 0x00400000, normal).to(torch.int32).view(torch.float32)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """``floor(log2(a))`` for finite positive float32 ``a`` (subnormals included), exactly, as int32."""
    m, p = torch.frexp(a)  # a = m * 2^p, 0.5 <= m < 1
    return (p - 1).to(torch.int32)


def _ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(a))`` for finite positive float32 ``a``, exactly: ``floor`` plus one unless ``a`` is a
    power of two."""
    m, p = torch.frexp(a)
    return torch.where(m == 0.5, p - 1, p).to(torch.int32)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of float32 ``y``: round to nearest, ties to the even code, magnitudes
    from 6 up saturate to 6 (code 7), the sign kept in bit 3 (so -0.0 and negatives that round to 0 give
    0x8). ``y`` must hold no NaN."""
    a = y.abs()
    # the seven midpoints between neighbouring magnitudes; at a tie (<= vs <) the even code wins:
    # 0.25 -> 0, 0.75 -> 1.0 (code 2), 1.25 -> 1.0, 1.75 -> 2.0 (code 4), 2.5 -> 2.0, 3.5 -> 4.0 (code 6),
    # 5 -> 4.0
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
            + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
            + (a > 5.0).to(torch.uint8))
    sign = (y.view(torch.int32) < 0).to(torch.uint8) << 3
    return code | sign


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8, 0..15)."""
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``(T, H)`` codes -> ``(T, H // 2)`` uint8: element ``2i`` in the low nibble, ``2i + 1`` in the high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_nibbles`: ``(T, H // 2)`` uint8 -> ``(T, H)`` codes."""
    return torch.stack([q & 0xF, q >> 4], dim=-1).reshape(q.shape[0], 2 * q.shape[1])


def static_fp8_quant_reference(x: torch.Tensor, scale: torch.Tensor,
                               fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Static per-tensor FP8 quantisation in plain torch (vLLM's FP8 checkpoints): with a calibrated
    float32 ``scale``, ``inv = f32(1 / scale)`` (correctly rounded) and
    ``q = fp8(clamp(f32(x) * inv, -MAX, MAX))``, rounded to nearest even; MAX is 448 (e4m3fn) or 240
    (e4m3fnuz); every NaN gives the canonical NaN byte (0x7F e4m3fn, 0x80 e4m3fnuz), +-Inf gives +-MAX.
    Dequantised: ``f32(q) * scale``.

    Args:
        x: ``(T, H)`` bf16/fp16/fp32.
        scale: float32 tensor of one element (shape ``()``, ``(1,)`` or ``(1, 1)``), finite and > 0.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
    Returns:
        ``q``: ``(T, H)`` of ``fp8_dtype``.
    Raises:
        ValueError: ``x`` not 2-D bf16/fp16/fp32; ``scale`` not float32, not one element, not finite or
            not positive; another ``fp8_dtype``.
    """
    op = "static_fp8_quant_reference"
    _check_rows(x, op, 1, "block")
    _check_fp8_dtype(op, fp8_dtype)
    return static_fp8_bytes(x, _one_float32(op, "scale", scale), fp8_dtype)


def static_fp8_bytes(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """:func:`static_fp8_quant_reference` without its checks, which read the scale on the host: the
    fused call's fallback path uses it (a scale on a GPU, perhaps during a CUDA-graph capture).
    ``x`` ``(T, H)``, ``scale`` one float32 element on any device; returns ``q`` ``(T, H)`` of
    ``fp8_dtype``."""
    s = scale.reshape(()).to(x.device)
    inv = (1.0 / s.double()).float()  # one correctly rounded float32 reciprocal, as vLLM's 1.0f / scale
    return _fp8_bytes(x.to(torch.float32) * inv, fp8_dtype)


def per_group_ue8m0_quant_reference(x: torch.Tensor, group_size: int = 128,
                                    fp8_dtype: torch.dtype = torch.float8_e4m3fn
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group FP8 quantisation with power-of-two (UE8M0) scales in plain torch (DeepGEMM's FP8 GEMMs
    on SM100, vLLM's ``per_token_group_quant_fp8(..., use_ue8m0=True)``): per group of ``group_size``
    consecutive elements of a row, ``amax = max |f32(x)|`` (NaN propagates), ``s = amax / MAX``
    (correctly rounded), ``scale`` = the smallest power of two >= ``s`` and >= 2^-127 (``s`` rounded up,
    never down), 1 where ``s`` is 0, +Inf where ``amax`` is +Inf, NaN where it is NaN;
    ``q = fp8(clamp(f32(x) / scale, -MAX, MAX))`` (an exact division: ``scale`` is a power of two), NaN as
    the canonical NaN byte. :func:`pack_ue8m0_scales` gives the packed layout DeepGEMM reads.

    Args:
        x: ``(T, H)`` bf16/fp16/fp32, ``H`` a multiple of ``group_size``.
        group_size: elements per scale (128: DeepSeek-V3's 1 x 128; 32 also occurs).
        fp8_dtype: ``torch.float8_e4m3fn`` (MAX 448) or ``torch.float8_e4m3fnuz`` (MAX 240).
    Returns:
        ``(q, scales)``: ``q`` ``(T, H)`` of ``fp8_dtype``; ``scales`` ``(T, H // group_size)`` float32, each
        a power of two in ``[2^-127, 2^127]``, +Inf or NaN.
    Raises:
        ValueError: ``x`` not 2-D bf16/fp16/fp32; ``H`` not a multiple of ``group_size``; another
            ``fp8_dtype``.
    """
    op = "per_group_ue8m0_quant_reference"
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{op}: group_size={group_size!r}; expected a positive int")
    _check_rows(x, op, group_size, "group_size")
    _check_fp8_dtype(op, fp8_dtype)
    T, H = x.shape
    v = x.to(torch.float32).reshape(T, H // group_size, group_size)
    amax = v.abs().amax(dim=-1, keepdim=True)
    s = amax / torch.full_like(amax, torch.finfo(fp8_dtype).max)  # tensor divisor: correctly rounded
    finite_pos = torch.isfinite(s) & (s > 0)
    safe = torch.where(finite_pos, s, torch.ones_like(s))
    scale = _pow2_f32(_ceil_log2(safe).clamp(-127, 127))
    scale = torch.where(s == 0, torch.ones_like(s), scale)  # amax 0 (or a quotient that underflows)
    scale = torch.where(torch.isinf(s), s, scale)
    scale = torch.where(s.isnan(), _F32_NAN, scale)
    q = _fp8_bytes(v / scale, fp8_dtype)
    return q.reshape(T, H), scale.reshape(T, H // group_size)


def _e8m0_bytes(scales: torch.Tensor, op: str) -> torch.Tensor:
    """E8M0 bytes (uint8) of float32 powers of two in ``[2^-127, 2^127]``; +-Inf and NaN give 0xFF."""
    special = ~torch.isfinite(scales)
    ok = special | ((scales > 0) & (scales >= 2.0 ** -127))
    safe = torch.where(ok & ~special, scales, torch.ones_like(scales))
    m, p = torch.frexp(safe)
    ok &= special | (m == 0.5)
    if not bool(ok.all()):
        bad = scales[~ok][:4].tolist()
        raise ValueError(f"{op}: scales holds values that are not powers of two in [2^-127, 2^127], "
                         f"Inf or NaN: {bad}")
    return torch.where(special, _E8M0_NAN, (p - 1 + 127)).to(torch.uint8)


def pack_ue8m0_scales(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``(T, G)`` in the packed, MN-major, TMA-aligned layout of DeepGEMM's
    SM100 FP8 GEMMs (``get_mn_major_tma_aligned_packed_ue8m0_tensor``; vLLM's
    ``per_token_group_quant_8bit_packed`` writes the same): each scale as its E8M0 byte (the biased
    exponent, ``log2(scale) + 127``; NaN and +-Inf as 0xFF), four consecutive groups of a row in one int32
    (group ``4k + j`` in bits ``8j .. 8j + 7``, so byte ``j`` in little-endian memory), and the int32s
    stored column by column: element ``[t, k]`` at ``k * Tp + t`` with ``Tp = ceil(T / 4) * 4`` (16 bytes).
    Groups past ``G`` in the last int32 and rows ``T .. Tp - 1`` hold zero bytes.

    Args:
        scales: ``(T, G)`` float32 (any strides), each a power of two in ``[2^-127, 2^127]``, Inf or NaN
            (as :func:`per_group_ue8m0_quant_reference` returns them).
    Returns:
        int32 ``(T, ceil(G / 4))`` with strides ``(1, Tp)``, a view of a zero-padded ``(ceil(G / 4), Tp)``
        buffer.
    Raises:
        ValueError: ``scales`` not a 2-D float32 tensor; a value that is no such power of two.
    """
    op = "pack_ue8m0_scales"
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.dim() != 2:
        raise ValueError(f"{op}: scales must be a 2-D float32 tensor; got "
                         f"{getattr(scales, 'dtype', type(scales).__name__)} "
                         f"{tuple(getattr(scales, 'shape', ()))}")
    T, G = scales.shape
    K, Tp = -(-G // 4), -(-T // 4) * 4
    padded = torch.zeros((Tp, 4 * K), dtype=torch.int64, device=scales.device)
    padded[:T, :G] = _e8m0_bytes(scales, op).to(torch.int64)
    b = padded.reshape(Tp, K, 4)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)  # two's complement
    buf = torch.zeros(K * Tp, dtype=torch.int32, device=scales.device)
    buf.view(K, Tp).copy_(word.t())
    return buf.as_strided((T, K), (1, Tp))  # explicit strides: torch keeps them even where K or T is 1


def mxfp4_quant_reference(x: torch.Tensor, scale_rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 quantisation (OCP Microscaling v1.0: blocks of 32 consecutive elements of a row, one shared
    E8M0 scale ``X = 2^e``, E2M1 elements) in plain torch. ``amax = max |f32(x)|`` over the block, and

    * ``"floor"`` (the spec's rule, torchao ``ScaleCalculationMode.FLOOR``):
      ``e = floor(log2(amax)) - 2`` (2 = the exponent of E2M1's largest normal, 6 = 1.5 * 2^2);
    * ``"even"`` (aiter's ``dynamic_mxfp4_quant`` default, torchao ``EVEN``): the same after rounding
      ``amax`` up to the next power of two when its significand is >= 1.75;
    * ``"rceil"`` (TensorRT-LLM's MXFP4 and torchao ``RCEIL``): ``e = ceil(log2(f32(amax / 6)))``;

    ``e`` clamped to ``[-127, 127]`` (a zero block gives ``e = -127``, byte 0). Elements:
    ``f32(x) / X`` (exact) rounded to E2M1, nearest with ties to even, magnitudes above 6 saturating to 6,
    the sign kept (-0.0 and negatives that round to zero give code 0x8). A block whose ``amax`` is NaN or
    Inf gets the NaN scale byte 0xFF and all-zero codes. Dequantised: ``e2m1 * 2^e``
    (:func:`mxfp4_dequant_reference`).

    Args:
        x: ``(T, H)`` bf16/fp16/fp32, ``H`` a multiple of 32.
        scale_rule: ``"floor"``, ``"even"`` or ``"rceil"``.
    Returns:
        ``(q, scales)``: ``q`` ``(T, H // 2)`` uint8, element ``2i`` of a row in the low nibble of byte ``i``
        and ``2i + 1`` in the high nibble; ``scales`` ``(T, H // 32)`` uint8, the E8M0 byte ``e + 127``
        (row-major; :func:`swizzle_128x4` gives the 128x4 layout).
    Raises:
        ValueError: ``x`` not 2-D bf16/fp16/fp32; ``H`` not a multiple of 32; another ``scale_rule``.
    """
    op = "mxfp4_quant_reference"
    if scale_rule not in ("floor", "even", "rceil"):
        raise ValueError(f"{op}: scale_rule={scale_rule!r}; expected 'floor', 'even' or 'rceil'")
    _check_rows(x, op, 32, "block")
    T, H = x.shape
    v = x.to(torch.float32).reshape(T, H // 32, 32)
    amax = v.abs().amax(dim=-1, keepdim=True)
    special = ~torch.isfinite(amax)
    positive = ~special & (amax > 0)
    a = torch.where(positive, amax, torch.ones_like(amax))
    if scale_rule == "rceil":
        d = a / torch.full_like(a, _E2M1_MAX)  # correctly rounded; > 0 for every positive float32 amax
        e = _ceil_log2(torch.where(d > 0, d, torch.full_like(d, 2.0 ** -149)))
    else:
        e = _floor_log2(a) - 2
        if scale_rule == "even":
            m, _ = torch.frexp(a)  # significand 2m in [1, 2)
            e = e + (m >= 0.875).to(torch.int32)
    e = torch.where(positive, e, torch.full_like(e, -127)).clamp(-127, 127)
    y = v / _pow2_f32(e)  # X is a power of two: exact (these blocks never overflow)
    y = torch.where(special, torch.zeros_like(y), y)
    codes = _e2m1_codes(y).reshape(T, H)
    scales = torch.where(special, _E8M0_NAN, e + 127).to(torch.uint8).reshape(T, H // 32)
    return _pack_nibbles(codes), scales


def mxfp4_dequant_reference(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of MXFP4 data: ``e2m1 * 2^(scale - 127)`` per block of 32, NaN where the scale
    byte is 0xFF.

    Args:
        q: ``(T, H // 2)`` uint8 packed E2M1 (:func:`mxfp4_quant_reference`).
        scales: ``(T, H // 32)`` uint8 E8M0 bytes, row-major.
    Returns:
        ``(T, H)`` float32.
    Raises:
        ValueError: dtypes other than uint8; shapes that do not match.
    """
    op = "mxfp4_dequant_reference"
    if q.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{op}: q and scales must be uint8; got {q.dtype} and {scales.dtype}")
    if q.dim() != 2 or scales.shape != (q.shape[0], q.shape[1] // 16) or q.shape[1] % 16:
        raise ValueError(f"{op}: q has shape {tuple(q.shape)} and scales {tuple(scales.shape)}; "
                         f"expected (T, H // 2) and (T, H // 32)")
    vals = _e2m1_values(_unpack_nibbles(q))
    e = scales.to(torch.int32) - 127
    x = _pow2_f32(e.clamp(max=127))
    x = torch.where(scales == _E8M0_NAN, _F32_NAN, x)
    return vals * x.repeat_interleave(32, dim=1)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM's NVFP4 global scale ``f32(448 * 6 / amax)`` (448: E4M3's largest value, 6: E2M1's)
    for a tensor's ``amax = max |x|``, so that the block holding ``amax`` gets the block scale 448.

    Args:
        amax: float32 tensor of one element, finite and > 0.
    Returns:
        float32 tensor of shape ``()``.
    Raises:
        ValueError: ``amax`` not one finite positive float32.
    """
    a = _one_float32("nvfp4_global_scale", "amax", amax)
    return (torch.full_like(a, _E4M3_MAX * _E2M1_MAX) / a)


def nvfp4_quant_reference(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 quantisation in plain torch (TensorRT-LLM's ``cvt_warp_fp16_to_fp4`` with E4M3 block scales,
    written with correctly rounded float32 operations where the kernel uses ``rcp.approx``): per block of
    16 consecutive elements of a row, ``amax = max |f32(x)|``,

        ``s = fp8_e4m3(clamp(f32(f32(amax / 6) * global_scale), 0, 448))`` (round to nearest even,
        subnormals kept; the block scale, stored),
        ``q = e2m1(f32(f32(x) * f32(global_scale / f32(s))))`` where ``s > 0``, ``e2m1(+-0)`` where
        ``s`` is 0,

    E2M1 rounding to nearest with ties to even, saturating at +-6, the sign kept. A block whose ``amax``
    is NaN or Inf gets the NaN block scale byte 0x7F and all-zero codes. Dequantised:
    ``e2m1 * f32(s) / global_scale`` (:func:`nvfp4_dequant_reference`).

    Args:
        x: ``(T, H)`` bf16/fp16/fp32, ``H`` a multiple of 16.
        global_scale: float32 tensor of one element, finite and > 0; TensorRT-LLM's
            ``448 * 6 / amax(tensor)`` (:func:`nvfp4_global_scale`), the reciprocal of torchao's
            ``per_tensor_scale``.
    Returns:
        ``(q, block_scales)``: ``q`` ``(T, H // 2)`` uint8, element ``2i`` of a row in the low nibble of
        byte ``i``; ``block_scales`` ``(T, H // 16)`` ``torch.float8_e4m3fn``, row-major (the linear
        layout; :func:`swizzle_128x4` gives the swizzled one).
    Raises:
        ValueError: ``x`` not 2-D bf16/fp16/fp32; ``H`` not a multiple of 16; ``global_scale`` not one
            finite positive float32.
    """
    op = "nvfp4_quant_reference"
    _check_rows(x, op, 16, "block")
    return nvfp4_quant_unchecked(x, _one_float32(op, "global_scale", global_scale))


def nvfp4_quant_unchecked(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nvfp4_quant_reference` without its checks, which read the global scale on the host: the fused
    call's fallback path uses it (a scale on a GPU, perhaps during a CUDA-graph capture). ``x`` ``(T, H)``,
    ``H`` a multiple of 16; ``global_scale`` one float32 element on any device."""
    g = global_scale.reshape(()).to(x.device)
    T, H = x.shape
    v = x.to(torch.float32).reshape(T, H // 16, 16)
    amax = v.abs().amax(dim=-1, keepdim=True)
    special = ~torch.isfinite(amax)
    sf = (amax / torch.full_like(amax, _E2M1_MAX)) * g  # each product rounded to float32
    sf = torch.where(special, torch.zeros_like(sf), sf).clamp(0.0, _E4M3_MAX)
    s8 = sf.to(torch.float8_e4m3fn)
    s32 = s8.to(torch.float32)
    factor = torch.where(s32 > 0, g / torch.where(s32 > 0, s32, torch.ones_like(s32)), torch.zeros_like(s32))
    y = v * factor
    y = torch.where(special, torch.zeros_like(y), y)
    codes = _e2m1_codes(y.clamp(-_E2M1_MAX, _E2M1_MAX)).reshape(T, H)
    s_bytes = torch.where(special, _FP8_NAN_BYTE[torch.float8_e4m3fn], s8.view(torch.uint8))
    return _pack_nibbles(codes), s_bytes.to(torch.uint8).view(torch.float8_e4m3fn).reshape(T, H // 16)


def nvfp4_dequant_reference(q: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor
                            ) -> torch.Tensor:
    """float32 values of NVFP4 data: ``e2m1 * f32(s) / global_scale`` per block of 16 (computed in float64
    and rounded once), NaN where the block scale is NaN.

    Args:
        q: ``(T, H // 2)`` uint8 packed E2M1 (:func:`nvfp4_quant_reference`).
        block_scales: ``(T, H // 16)`` ``torch.float8_e4m3fn``, row-major.
        global_scale: float32 tensor of one element, finite and > 0.
    Returns:
        ``(T, H)`` float32.
    Raises:
        ValueError: wrong dtypes or shapes; ``global_scale`` not one finite positive float32.
    """
    op = "nvfp4_dequant_reference"
    if q.dtype != torch.uint8 or block_scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{op}: q must be uint8 and block_scales torch.float8_e4m3fn; got {q.dtype} and "
                         f"{block_scales.dtype}")
    if q.dim() != 2 or q.shape[1] % 8 or block_scales.shape != (q.shape[0], q.shape[1] // 8):
        raise ValueError(f"{op}: q has shape {tuple(q.shape)} and block_scales {tuple(block_scales.shape)}; "
                         f"expected (T, H // 2) and (T, H // 16)")
    g = _one_float32(op, "global_scale", global_scale).to(q.device).double()
    vals = _e2m1_values(_unpack_nibbles(q)).double()
    s = block_scales.to(torch.float64).repeat_interleave(16, dim=1)
    return (vals * s / g).float()


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Block scales ``(R, C)`` (R rows of tokens, C scales per row) in the 128x4 swizzled layout of
    TensorRT-LLM's and CUTLASS's FP4 GEMMs on SM100 (``get_sf_out_offset_128x4``; cuBLAS's block-scaling
    layout): rows padded to ``Rp = ceil(R / 128) * 128`` and columns to ``Cp = ceil(C / 4) * 4`` with zero
    bytes; scale ``[m, k]`` at byte offset
    ``((m // 128) * (Cp // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4``,
    i.e. tiles of 128 rows x 4 columns (512 bytes) in row-of-tiles order, each tile as ``[32][4][4]``
    indexed by ``(m % 32, (m % 128) // 32, k % 4)``.

    Args:
        scales: ``(R, C)`` tensor of a 1-byte dtype (uint8 E8M0 bytes, ``torch.float8_e4m3fn``, ...).
    Returns:
        A contiguous ``(Rp, Cp)`` tensor of the same dtype whose row-major bytes are the swizzled buffer.
    Raises:
        ValueError: ``scales`` not 2-D or not of a 1-byte dtype.
    """
    op = "swizzle_128x4"
    if scales.dim() != 2 or scales.element_size() != 1:
        raise ValueError(f"{op}: scales has shape {tuple(scales.shape)} and dtype {scales.dtype}; expected "
                         f"(R, C) of a 1-byte dtype")
    R, C = scales.shape
    Rp, Cp = -(-R // 128) * 128, -(-C // 4) * 4
    padded = torch.zeros((Rp, Cp), dtype=torch.uint8, device=scales.device)
    padded[:R, :C] = scales.view(torch.uint8)
    # m = tile * 128 + inner * 32 + outer; stored as [tile][k // 4][outer][inner][k % 4]
    tiles = padded.reshape(Rp // 128, 4, 32, Cp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(Rp, Cp).view(scales.dtype)


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4`: the ``(rows, cols)`` row-major scales of a swizzled buffer.

    Args:
        swizzled: ``(ceil(rows / 128) * 128, ceil(cols / 4) * 4)`` contiguous, 1-byte dtype (or the same
            bytes flat).
        rows, cols: the unpadded shape.
    Returns:
        A contiguous ``(rows, cols)`` tensor of the dtype of ``swizzled``.
    Raises:
        ValueError: ``swizzled`` has a wrong number of elements or not a 1-byte dtype.
    """
    Rp, Cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    if swizzled.numel() != Rp * Cp or swizzled.element_size() != 1:
        raise ValueError(f"unswizzle_128x4: swizzled has {swizzled.numel()} elements of dtype "
                         f"{swizzled.dtype}; "
                         f"expected {Rp * Cp} bytes for ({rows}, {cols})")
    tiles = swizzled.contiguous().view(torch.uint8).reshape(Rp // 128, Cp // 4, 32, 4, 4)
    padded = tiles.permute(0, 3, 2, 1, 4).reshape(Rp, Cp)
    return padded[:rows, :cols].contiguous().view(swizzled.dtype)


def quant_form_reference(x: torch.Tensor, quant: str, *, group_size: int = 128,
                         fp8_dtype: torch.dtype = torch.float8_e4m3fn, scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """What a fused call with ``quant=quant`` returns as ``(q, scales)`` for its unquantised output ``x``,
    in plain torch (the default layouts: row-major scales, no swizzle): the reference of each form above.

    Args:
        x: ``(T, H)`` float tensor, the fused call's ``out``.
        quant: ``"fp8_per_token"``, ``"fp8_per_group"``, ``"fp8_per_group_ue8m0"``, ``"fp8_static"``,
            ``"mxfp4"`` or ``"nvfp4"``.
        group_size: the per-group forms' group size.
        fp8_dtype: the FP8 forms' format.
        scale: ``fp8_static``'s scale, ``nvfp4``'s global scale (one float32 element).
    Returns:
        ``(q, scales)``; for ``fp8_static`` ``scales`` is ``scale`` itself, as the fused call returns it.
    Raises:
        ValueError: another ``quant``; the form's own errors (``H`` not a multiple of its block).
    """
    if quant == "fp8_per_token":
        return per_token_quant_reference(x, fp8_dtype)
    if quant == "fp8_per_group":
        return per_group_quant_reference(x, group_size, fp8_dtype)
    if quant == "fp8_per_group_ue8m0":
        return per_group_ue8m0_quant_reference(x, group_size, fp8_dtype)
    if quant == "fp8_static":
        return static_fp8_quant_reference(x, scale, fp8_dtype), scale
    if quant == "mxfp4":
        return mxfp4_quant_reference(x)
    if quant == "nvfp4":
        return nvfp4_quant_reference(x, scale)
    raise ValueError(f"quant_form_reference: quant must be one of the fused ops' forms, got {quant!r}")
