"""FP8 quantisation: helpers on a tile held in registers, and the standalone per-token and per-group
kernels built from them.

Problem: quantise rows of ``out`` (``(T, H)``, bf16/fp16/fp32) to FP8 with one float32 scale per row
(per-token) or per ``GROUP`` consecutive elements of a row (per-group, DeepSeek's 1 x 128), as in
docs/numerics.md, item 4. The fused all-reduce epilogues call the same helpers on the
float32 tile of ``out`` they hold (``T(y)`` widened back to float32), so their bytes and scales equal
those of the standalone kernels here applied to the unquantised output.

Numerics, with ``MAX`` = 448 (e4m3fn, ``tl.float8e4nv``) or 240 (e4m3fnuz, ``tl.float8e4b8``):
  amax  = max |v| over the row (or group); a NaN anywhere makes amax NaN; -0.0 counts as 0.
  scale = div_rn(amax, MAX), and 1.0 where that is 0 (amax is 0, or a float32 amax below about
          448 * 2^-150 whose quotient underflows to 0, which would otherwise divide by zero);
          a NaN scale is always the float32 NaN 0x7FC00000.
  q     = fp8(div_rn(v, scale)): the division correctly rounded, then rounded to nearest-even in FP8
          after saturating to [-MAX, MAX] (+-Inf gives +-MAX); every NaN gives the one canonical NaN
          byte (0x7F for e4m3fn, 0x80 for e4m3fnuz). e4m3fn keeps the sign of zero (-0.0 -> 0x80);
          e4m3fnuz has no negative zero (-0.0, and negatives that round to 0, give 0x00). Results
          below the smallest normal are FP8 subnormals, rounded to nearest-even.
So a NaN row gives scale NaN and every byte NaN; a row holding +-Inf gives scale Inf, q = NaN at the
infinities (Inf / Inf) and 0 elsewhere (IEEE arithmetic, docs/numerics.md item 5).

Why not a plain ``.to(tl.float8e4nv)``: Triton's interpreter (3.9) converts float32 to FP8 wrongly
(ties round up, a mantissa carry drops the exponent: 1.9375 -> 1.0, Inf -> 0x78, NaN -> 0x7C, out of
range -> the NaN byte), and Triton's NVIDIA backend has no e4m3fnuz at all (3.6 on an H200: a
``CompilationError``). So the encoder works on the float32 bits with integer operations, which give the
same bytes on every backend (:func:`fp8_encode_soft`); with ``NATIVE_FP8`` it uses the hardware
conversion for e4m3fn instead. Triton (3.6 on an H200, 3.9 for sm_90) emits
``cvt.rn.satfinite.e4m3x2.f32``: nearest-even, +-Inf and out-of-range values to +-448 (PTX's
``.satfinite``), so no clamp is needed around it; the NaN byte is made explicit (a NaN's sign bit could
otherwise give 0xFF). Both give the same byte for all 2^32 float32 inputs (``tests/quant/test_quant.py``, GPU),
and the native one is faster (docs/design.md, "The hardware conversion"). Bytes are returned as
``uint8``: launchers pass a ``uint8`` view of the FP8 output.

Tiling: a row of up to ``BLOCK_H`` elements is one tile; wider rows take ``NUM_TILES`` tiles
(:func:`tpcomm.dispatch.row_config`). Per-token: a first pass finds amax over every tile, a second
re-reads the row and stores the bytes. Per-group: ``GROUP`` divides ``BLOCK_H`` (both powers of two),
so each tile holds whole groups and is quantised in one pass.
"""

import triton
import triton.language as tl

from . import interpreted

# float32 bit patterns and FP8 codes of the two formats.
_F32_448: tl.constexpr = tl.constexpr(0x43E00000)    # 448.0 = 1.75 * 2^8, e4m3fn's largest finite
_F32_240: tl.constexpr = tl.constexpr(0x43700000)    # 240.0 = 1.875 * 2^7, e4m3fnuz's largest finite
_F32_2M6: tl.constexpr = tl.constexpr(0x3C800000)    # 2^-6, e4m3fn's smallest normal (bias 7)
_F32_2M7: tl.constexpr = tl.constexpr(0x3C000000)    # 2^-7, e4m3fnuz's smallest normal (bias 8)
_F32_INF: tl.constexpr = tl.constexpr(0x7F800000)
_F32_NAN: tl.constexpr = tl.constexpr(0x7FC00000)    # the scale of a row (group) holding a NaN
_FAST_MIN_SCALE: tl.constexpr = tl.constexpr(2.0 ** -90)  # see divide()
_F32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)          # (2 - 2^-23) * 2^127


if interpreted.HOST_TWINS:  # under the interpreter only
    @triton.jit
    def widen(x):
        """``x`` (bf16, fp16 or fp32) as float32, exactly; bf16 by :func:`interpreted.widen_bf16`, the
        shift below in one NumPy step."""
        if x.dtype == tl.bfloat16:
            return interpreted.widen_bf16(x)
        else:
            return x.to(tl.float32)
else:
    @triton.jit
    def widen(x):
        """``x`` (bf16, fp16 or fp32) as float32, exactly. bf16 is widened on the bits (a 16-bit shift):
        Triton's interpreter (3.9) flushes or mangles bf16 subnormals in ``.to(tl.float32)``."""
        if x.dtype == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)


@triton.jit
def fp8_max(FP8: tl.constexpr):
    """The largest finite value of ``FP8`` (``tl.float8e4nv``: 448.0, ``tl.float8e4b8``: 240.0)."""
    if FP8 == tl.float8e4nv:
        return 448.0
    else:
        return 240.0


@triton.jit
def abs_bits(v, mask):
    """int32 bits of ``|v|`` (float32), 0 where ``mask`` is False.

    For non-negative floats the integer order is the magnitude order and every NaN lies above +Inf, so
    an integer ``tl.max`` / ``tl.maximum`` over these is a NaN-propagating amax that gives the same
    answer on every backend (float max reductions ignore NaN on NVIDIA but not in the interpreter).
    """
    return tl.where(mask, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)


@triton.jit
def amax_from_bits(b):
    """float32 amax from a tile of :func:`abs_bits` (or a running ``tl.maximum`` of several)."""
    return tl.max(b, axis=0).to(tl.float32, bitcast=True)


@triton.jit
def row_amax(v, mask):
    """``max |v|`` over a 1-D float32 tile (masked lanes ignored); NaN if any unmasked lane is NaN."""
    return amax_from_bits(abs_bits(v, mask))


@triton.jit
def group_amax(v, mask, GROUP: tl.constexpr):
    """``max |v|`` of each ``GROUP`` consecutive lanes of a 1-D float32 tile of ``BLOCK`` lanes:
    ``(BLOCK // GROUP,)`` float32. ``GROUP`` must divide ``BLOCK`` (both powers of two)."""
    NG: tl.constexpr = v.shape[0] // GROUP
    b = tl.reshape(abs_bits(v, mask), (NG, GROUP))
    return tl.max(b, axis=1).to(tl.float32, bitcast=True)


@triton.jit
def fp8_scale(amax, FP8: tl.constexpr):
    """``div_rn(amax, MAX)``, 1.0 where that is 0; Inf propagates, a NaN amax gives the float32 NaN
    0x7FC00000 (NaN payloads and signs from arithmetic differ between CPUs and GPUs). Any shape."""
    s = tl.math.div_rn(amax, fp8_max(FP8))
    s = tl.where(s == 0.0, 1.0, s)
    return tl.where(s != s, tl.full(s.shape, _F32_NAN, tl.int32).to(tl.float32, bitcast=True), s)


@triton.jit
def pow2_ceil(s):
    """The UE8M0 scale of a positive float32 ``s`` (any shape): the smallest power of two that is
    ``>= s`` and ``>= 2^-127`` (docs/numerics.md, "Per-group FP8 with UE8M0 scales"), computed on the
    bits: a set mantissa bit carries into the exponent. +Inf and NaN stay as they are."""
    bits = s.to(tl.int32, bitcast=True)
    up = (bits + 0x7FFFFF) & 0x7F800000
    up = tl.where(bits <= 0x400000, 0x400000, up)  # at most 2^-127 (subnormal): 2^-127
    return tl.where(s != s, s, up.to(tl.float32, bitcast=True))


@triton.jit
def expand_group_scales(scales, GROUP: tl.constexpr):
    """``(NG,)`` per-group scales repeated to one per lane: ``(NG * GROUP,)``, lane ``i`` gets
    ``scales[i // GROUP]``."""
    NG: tl.constexpr = scales.shape[0]
    return tl.reshape(tl.broadcast_to(scales[:, None], (NG, GROUP)), (NG * GROUP,))


@triton.jit
def fp8_encode_soft(x, FP8: tl.constexpr):
    """float32 ``x`` to FP8 bytes (``uint8``) with integer operations only: saturate to +-MAX,
    round to nearest-even (subnormals too), canonical NaN byte; see the module docstring."""
    if FP8 == tl.float8e4nv:
        BIAS: tl.constexpr = 7
        MAX_BITS: tl.constexpr = _F32_448
        MIN_NORMAL_BITS: tl.constexpr = _F32_2M6
        MAX_CODE: tl.constexpr = 0x7E
        NAN_CODE: tl.constexpr = 0x7F
    else:
        BIAS: tl.constexpr = 8
        MAX_BITS: tl.constexpr = _F32_240
        MIN_NORMAL_BITS: tl.constexpr = _F32_2M7
        MAX_CODE: tl.constexpr = 0x7F
        NAN_CODE: tl.constexpr = 0x80
    b = x.to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    # Normal range: round the 23-bit mantissa to 3 bits at bit 20 (ties to even); a carry moves into
    # the exponent by itself. Then re-bias the exponent from 127 to BIAS.
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (r >> 20) - ((127 - BIAS) << 3)
    # Subnormal range: the code is |x| / 2^(-2 - BIAS) rounded to an integer (0..8; 8 is the smallest
    # normal's code): the 24-bit significand shifted right by 148 - BIAS - exponent (>= 21 here),
    # ties to even. Shifts past 31 leave 0 (the significand is below 2^24 <= half); float32
    # subnormals (exponent 0) land there too.
    e = (a >> 23).to(tl.int32)
    shift = tl.minimum(tl.maximum(148 - BIAS - e, 1), 31).to(tl.uint32)
    mant = (a & 0x7FFFFF) | 0x800000
    m = mant >> shift
    rem = mant & ((tl.full(a.shape, 1, tl.uint32) << shift) - 1)
    half = tl.full(a.shape, 1, tl.uint32) << (shift - 1)
    m = m + ((rem > half) | ((rem == half) & ((m & 1) == 1))).to(tl.uint32)
    code = tl.where(a < MIN_NORMAL_BITS, m, normal)
    code = tl.where(a > MAX_BITS, MAX_CODE, code)  # saturate (+-Inf included)
    if FP8 == tl.float8e4nv:
        code = sign | code
    else:
        code = tl.where(code == 0, 0, sign | code)  # no negative zero
    code = tl.where(a > _F32_INF, NAN_CODE, code)
    return code.to(tl.uint8)


@triton.jit
def fp8_encode(x, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """float32 ``x`` to FP8 bytes (``uint8``): saturating, nearest-even, canonical NaN.

    ``NATIVE_FP8`` (e4m3fn only; set it only on NVIDIA GPUs with FP8 conversions, sm_89+) uses the
    hardware conversion, which saturates by itself (see the module docstring), and the canonical NaN
    byte; otherwise :func:`fp8_encode_soft`. Same bytes, with no clamp (docs/design.md, "No clamp
    before the conversion").
    """
    if NATIVE_FP8 and FP8 == tl.float8e4nv:
        code = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(x != x, 0x7F, code).to(tl.uint8)
    else:
        return fp8_encode_soft(x, FP8)


@triton.jit
def _fast_scale(scale, SRC16: tl.constexpr):
    """Whether :func:`divide` may use the reciprocal for ``scale`` (any shape): ``SRC16`` and ``scale``
    finite and at least 2^-90 (NaN, Inf, 0 and tiny scales take ``div_rn``)."""
    return (scale >= _FAST_MIN_SCALE) & (scale <= _F32_MAX) & SRC16


@triton.jit
def token_division(scale, SRC16: tl.constexpr):
    """``(recip, fast)`` for dividing a row by its scalar ``scale`` with :func:`quantize`:
    ``recip = div_rn(1, scale)`` and a scalar bool. ``SRC16``: the row's values are widened from a
    16-bit dtype (see :func:`divide`)."""
    return tl.math.div_rn(1.0, scale), _fast_scale(scale, SRC16)


@triton.jit
def group_division(scales, SRC16: tl.constexpr, GROUP: tl.constexpr):
    """``(scale, recip, fast)`` per lane for a tile of whole groups with ``(NG,)`` ``scales``: the
    scales and their ``div_rn`` reciprocals repeated to one per lane (one division per group, not per
    lane), and one scalar bool for the tile (all of its groups may take the fast division)."""
    recip = tl.math.div_rn(1.0, scales)
    fast = tl.min(_fast_scale(scales, SRC16).to(tl.int32), axis=0) != 0
    return expand_group_scales(scales, GROUP), expand_group_scales(recip, GROUP), fast


@triton.jit
def fast_divide(v, scale, recip):
    """:func:`divide`'s quotient on its fast path (see there): Markstein's correction of ``q0 = v * recip``,
    ``q0 + (q0 * scale - v) * (-recip)``, both steps fused multiply-adds. The remainder is taken as
    ``q0 * scale - v`` and multiplied by ``-recip`` (not ``v - q0 * scale`` by ``recip``): the same
    product, but a zero ``v`` then ends as ``-0 + -0 = -0`` or ``-0 + +0 = +0`` and keeps its sign with
    no select (the other way gives ``+0`` for both; the select it needed cost one instruction an
    element). The negations are products with -1.0, which are exact for zeros too and which the
    compiler folds into the FMAs' operands: Triton compiles a unary minus as ``0 - x``, which gives +0
    for +0 (on a GPU; the interpreter's numpy negates) and lost the sign of -0.0 here."""
    q0 = v * recip
    return tl.fma(tl.fma(q0, scale, v * -1.0), recip * -1.0, q0)


@triton.jit
def divide(v, scale, recip, fast):
    """``div_rn(v, scale)`` where FP8 can tell (float32, shape of ``v``; ``scale``/``recip`` scalars or
    per lane), for ``|v| <= amax`` of the row or group that gave ``scale`` (what every caller divides).

    A correctly rounded division is a long instruction sequence per element; it made the FP8 epilogue
    cost about half of the whole fused kernel (docs/design.md, "The fast division"). With ``fast`` (a
    scalar; see :func:`token_division`) the
    quotient is instead :func:`fast_divide`'s: one multiply and two FMAs per element. The remainder
    ``v - q0 * scale`` is exact unless it underflows, which the fast path's ``scale >= 2^-90`` rules
    out for every quotient of at least 2^-12; smaller quotients may be one float32 ulp off but are
    below half the smallest FP8 subnormal, so they give the same byte (+-0). ``tests/quant/test_quant.py``
    checks it on a GPU for every (value, amax) pair of each 16-bit dtype and format: the same FP8
    bytes as ``div_rn``, and the same quotient bits wherever it is at least 2^-12. 32-bit sources
    always take ``div_rn``.
    """
    if fast:
        q = fast_divide(v, scale, recip)
    else:
        q = tl.math.div_rn(v, scale)
    return q


@triton.jit
def e4m3_bytes(x):
    """e4m3fn bytes (``uint8``) of float32 ``x`` by the hardware conversion (sm_89+), for ``x`` with no
    NaN (a NaN's byte would be 0x7F or 0xFF, not always 0x7F): ``cvt.rn.satfinite.e4m3x2.f32`` on two
    elements at once, four a time packed into one 32-bit register, as they are stored.

    ``x.to(tl.float8e4nv)`` emits the same conversion, but Triton (3.6 and 3.9, sm_90 build) then
    unpacks every pair into single bytes and packs them again for the store: per 16 elements, the same 8
    conversions plus 26 instructions that unpack and repack, against 3 moves here. ``cvt ... d, a, b`` puts ``a`` in
    the upper half of ``d``, so the elements
    are given in reverse; the first element of four is the lowest byte, as Triton packs them
    (docs/design.md, "Packed conversions").
    """
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r", [x], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def quantize(v, scale, recip, fast, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """FP8 bytes of ``div_rn(v, scale)`` (``uint8``, shape of ``v``): :func:`divide`'s two paths, written out
    so that each takes its own encoder in one branch (:func:`divide` itself stays the quotient the tests
    check bit for bit).

    On the fast path (``fast``: a finite scale of at least 2^-90, see :func:`token_division`) every
    quotient is finite, since ``|v| <= amax`` and amax is finite, so the native conversion needs no
    NaN byte fixed up (:func:`e4m3_bytes`). NaN and Inf rows (and tiny scales) take ``div_rn`` and the
    full :func:`fp8_encode` (docs/design.md, "No selects on the fast path").
    """
    if fast:
        q = fast_divide(v, scale, recip)
        if NATIVE_FP8 and FP8 == tl.float8e4nv:
            code = e4m3_bytes(q)
        else:
            code = fp8_encode_soft(q, FP8)
    else:
        code = fp8_encode(tl.math.div_rn(v, scale), FP8, NATIVE_FP8)
    return code


@triton.jit
def store_fp8(q_ptr, cols, code, mask, SRC_BITS: tl.constexpr):
    """Store FP8 bytes ``code`` (uint8) at ``q_ptr + cols``, ``128 // SRC_BITS`` contiguous bytes a thread:
    as many as the thread holds elements of the 16-bit or 32-bit tile they were computed from.

    Left to itself, Triton gives the byte store 16 contiguous bytes a thread, its widest access, and
    therefore another layout than the 16-byte loads and stores of the source tile (8 bf16 elements a
    thread), so the compiler moves the tiles between the two layouts through shared memory: in the
    fused Lamport kernel at hidden 6144 bf16, four layout conversions and twelve more barriers
    (``benchmarks/compile_sm90.py``'s sm_90 build of it). The contiguity hint makes the byte store take
    the source's layout instead; it changes no byte (docs/design.md, "FP8 stores in the source's
    layout").
    """
    tl.store(tl.max_contiguous(q_ptr + cols, 128 // SRC_BITS), code, mask=mask)


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, H, x_row_stride, q_row_stride,
                            FP8: tl.constexpr, NATIVE_FP8: tl.constexpr,
                            BLOCK_H: tl.constexpr, NUM_TILES: tl.constexpr):
    """One program per row: ``q[row]`` (uint8 view of FP8) and ``s[row]`` (float32)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    q_row = q_ptr + row * q_row_stride
    SRC_BITS: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth
    SRC16: tl.constexpr = SRC_BITS == 16
    offs = tl.arange(0, BLOCK_H)
    if NUM_TILES == 1:
        mask = offs < H
        v = widen(tl.load(x_row + offs, mask=mask, other=0.0))
        scale = fp8_scale(row_amax(v, mask), FP8)
        recip, fast = token_division(scale, SRC16)
        store_fp8(q_row, offs, quantize(v, scale, recip, fast, FP8, NATIVE_FP8), mask, SRC_BITS)
    else:
        acc = tl.zeros([BLOCK_H], dtype=tl.int32)
        for t in tl.static_range(NUM_TILES):
            cols = t * BLOCK_H + offs
            mask = cols < H
            v = widen(tl.load(x_row + cols, mask=mask, other=0.0))
            acc = tl.maximum(acc, abs_bits(v, mask))
        scale = fp8_scale(amax_from_bits(acc), FP8)
        recip, fast = token_division(scale, SRC16)
        for t in tl.static_range(NUM_TILES):
            cols = t * BLOCK_H + offs
            mask = cols < H
            v = widen(tl.load(x_row + cols, mask=mask, other=0.0))
            store_fp8(q_row, cols, quantize(v, scale, recip, fast, FP8, NATIVE_FP8), mask, SRC_BITS)
    tl.store(s_ptr + row, scale)


@triton.jit
def _per_group_quant_kernel(x_ptr, q_ptr, s_ptr, H, x_row_stride, q_row_stride, s_row_stride,
                            s_group_stride,
                            FP8: tl.constexpr, NATIVE_FP8: tl.constexpr, GROUP: tl.constexpr,
                            BLOCK_H: tl.constexpr, NUM_TILES: tl.constexpr, UE8M0: tl.constexpr):
    """One program per row; scale of group ``g`` at ``s + row * s_row_stride + g * s_group_stride``
    (row-major: ``(H // GROUP, 1)``; column-major: ``(1, T)``). With ``UE8M0`` each scale is rounded up
    to a power of two (:func:`pow2_ceil`) before the division, which is then exact."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    q_row = q_ptr + row * q_row_stride
    s_row = s_ptr + row * s_row_stride
    SRC_BITS: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth
    SRC16: tl.constexpr = SRC_BITS == 16
    NG: tl.constexpr = BLOCK_H // GROUP
    offs = tl.arange(0, BLOCK_H)
    groups = tl.arange(0, NG)
    for t in tl.static_range(NUM_TILES):
        cols = t * BLOCK_H + offs
        mask = cols < H
        v = widen(tl.load(x_row + cols, mask=mask, other=0.0))
        scales = fp8_scale(group_amax(v, mask, GROUP), FP8)
        if UE8M0:
            scales = pow2_ceil(scales)
        lane_scales, recip, fast = group_division(scales, SRC16, GROUP)
        store_fp8(q_row, cols, quantize(v, lane_scales, recip, fast, FP8, NATIVE_FP8), mask, SRC_BITS)
        g = t * NG + groups
        tl.store(s_row + g * s_group_stride, scales, mask=g * GROUP < H)


def launch_per_token_quant(x, q_bits, scales, fp8, native_fp8: bool, block_h: int, num_tiles: int,
                           num_warps: int) -> None:
    """Run the per-token kernel: ``x`` ``(T, H)`` with unit column stride, ``q_bits`` ``(T, H)`` uint8
    with unit column stride, ``scales`` ``(T,)`` contiguous float32 (or a ``(T, 1)`` view of one);
    ``fp8`` is ``tl.float8e4nv`` or ``tl.float8e4b8``. No validation (see :mod:`tpcomm.quant`)."""
    T, H = x.shape
    if T == 0:
        return
    _per_token_quant_kernel[(T,)](x, q_bits, scales, H, x.stride(0), q_bits.stride(0),
                                  FP8=fp8, NATIVE_FP8=native_fp8, BLOCK_H=block_h, NUM_TILES=num_tiles,
                                  num_warps=num_warps)


def launch_per_group_quant(x, q_bits, scales, group_size: int, fp8, native_fp8: bool, block_h: int,
                           num_tiles: int, num_warps: int, ue8m0: bool = False) -> None:
    """Run the per-group kernel: as :func:`launch_per_token_quant`, with ``scales`` any ``(T, H //
    group_size)`` float32 tensor (its strides say the layout); ``group_size`` divides ``block_h``;
    ``ue8m0``: power-of-two scales."""
    T, H = x.shape
    if T == 0:
        return
    _per_group_quant_kernel[(T,)](x, q_bits, scales, H, x.stride(0), q_bits.stride(0), scales.stride(0),
                                  scales.stride(1), FP8=fp8, NATIVE_FP8=native_fp8, GROUP=group_size,
                                  BLOCK_H=block_h, NUM_TILES=num_tiles, UE8M0=ue8m0, num_warps=num_warps)


@triton.jit
def static_inverse(scale_ptr):
    """``div_rn(1, scale)`` of the float32 static scale at ``scale_ptr`` (a scalar): what static
    per-tensor FP8 multiplies by (the fused epilogues and :func:`_static_quant_kernel` alike)."""
    scale = tl.load(scale_ptr)
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _static_quant_kernel(x_ptr, scale_ptr, q_ptr, H, x_row_stride, q_row_stride,
                         FP8: tl.constexpr, NATIVE_FP8: tl.constexpr,
                         BLOCK_H: tl.constexpr, NUM_TILES: tl.constexpr):
    """One program per row: ``q[row] = fp8(f32(x[row]) * inv)`` with ``inv = div_rn(1, scale)``, the
    float32 ``scale`` read from ``scale_ptr`` (static per-tensor FP8; saturating, nearest-even, NaN as
    the canonical NaN byte)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    q_row = q_ptr + row * q_row_stride
    SRC_BITS: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth
    inv = static_inverse(scale_ptr)
    offs = tl.arange(0, BLOCK_H)
    for t in tl.static_range(NUM_TILES):
        cols = t * BLOCK_H + offs
        mask = cols < H
        v = widen(tl.load(x_row + cols, mask=mask, other=0.0))
        store_fp8(q_row, cols, fp8_encode(v * inv, FP8, NATIVE_FP8), mask, SRC_BITS)


def launch_static_quant(x, scale, q_bits, fp8, native_fp8: bool, block_h: int, num_tiles: int,
                        num_warps: int) -> None:
    """Run the static per-tensor kernel: ``x`` ``(T, H)`` with unit column stride, ``scale`` one
    float32 element, ``q_bits`` ``(T, H)`` uint8 with unit column stride. No validation."""
    T, H = x.shape
    if T == 0:
        return
    _static_quant_kernel[(T,)](x, scale, q_bits, H, x.stride(0), q_bits.stride(0), FP8=fp8,
                               NATIVE_FP8=native_fp8, BLOCK_H=block_h, NUM_TILES=num_tiles,
                               num_warps=num_warps)
