"""FP4 quantisation, MXFP4 and NVFP4: helpers on a tile held in registers, and the standalone kernels
built from them.

Problem: quantise rows of ``x`` (``(T, H)``, bf16/fp16/fp32) to E2M1 elements packed two to a byte,
with one scale per block of consecutive elements of a row: MXFP4 (OCP Microscaling v1.0), blocks of 32
and an E8M0 scale byte; NVFP4, blocks of 16, an e4m3fn block scale and a float32 global scale given as
a tensor. docs/numerics.md, "Quantised output forms", sections 3 and 4, defines both bit for bit;
``tpcomm.reference.mxfp4_quant_reference`` / ``nvfp4_quant_reference`` are the plain-torch oracles.

Algorithm: one program per row; a row of up to ``BLOCK_H`` elements is one tile (wider rows take
``NUM_TILES`` tiles, ``tpcomm.dispatch.row_config``). ``BLOCK_H`` is a power of two of at least 16 and
the block a power of two dividing ``H``, so every tile holds whole blocks and is quantised in one pass:
the block amax as an integer max over the magnitude bits (NaN above +Inf, as ``quant.abs_bits``), the
scale from it, the elements scaled, encoded and packed, the scales stored linear or at their 128x4
swizzled offsets.

Numerics on the bits, with integer and exactly rounded float operations only, so every backend (the
interpreter included, whose float-to-FP8 conversions are wrong: ``quant``'s module docstring) gives the
same bytes:
  MXFP4 scale: ``e = E - 129`` for a block whose amax has the biased float32 exponent ``E`` (the
      spec's ``floor(log2(amax)) - 2``), clamped to ``[-127, 127]``: amax below ``2^-126`` (subnormal,
      or zero) gives -127. ``"even"`` takes ``E`` of the amax bits plus ``0x200000`` (a significand of
      1.75 or more carries into the exponent); ``"rceil"`` the exponent of ``pow2_ceil(amax / 6)``.
      Elements ``x * 2^-e`` (exact: ``2^-e`` is a normal float32 for every ``e`` the rules give).
  NVFP4 block scale: ``s = e4m3(f32(f32(amax / 6) * g))`` (``div_rn``; the e4m3 byte by
      ``quant.fp8_encode_soft``, nearest-even with subnormals), clamped to ``[0, 448]`` first; elements
      ``x * f32(g / f32(s))`` (``div_rn``), or ``x * 0`` where ``s`` is 0.
  E2M1: the code of the nearest magnitude of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to the even code, from 6
      up code 7, the sign in bit 3 (so -0.0 gives 0x8): seven comparisons with the midpoints.
  NaN and Inf: a block whose amax is NaN or +Inf gets the scale byte 0xFF (MXFP4) or the e4m3fn NaN
      byte 0x7F (NVFP4) and zero codes.
  Packing: element ``2i`` of a row in the low nibble of byte ``i``, ``2i + 1`` in the high nibble.
  128x4 layout: block scale ``[m, k]`` at byte ``((m // 128) * (Cp // 4) + k // 4) * 512 + (m % 32) * 16
      + ((m % 128) // 32) * 4 + k % 4`` of a zeroed ``(Rp, Cp)`` buffer (``reference.swizzle_128x4``).

When it wins: these are the unfused path and the oracle of fused FP4 outputs; no timing is claimed.
"""

import triton
import triton.language as tl

from .quant import abs_bits, fp8_encode_soft, pow2_ceil, widen

#: ``RULE`` of the MXFP4 kernel: ``"floor"`` (the OCP MX spec's), ``"even"`` (aiter's), ``"rceil"``
#: (TensorRT-LLM's), docs/numerics.md section 3.
MX_FLOOR = tl.constexpr(0)
MX_EVEN = tl.constexpr(1)
MX_RCEIL = tl.constexpr(2)
MX_RULES = {"floor": 0, "even": 1, "rceil": 2}

_F32_INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)


@triton.jit
def block_amax_bits(v, mask, BLOCK: tl.constexpr):
    """int32 bits of ``max |v|`` of each ``BLOCK`` consecutive lanes of a 1-D float32 tile:
    ``(n // BLOCK,)``; NaN lies above +Inf (``quant.abs_bits``), masked lanes count as 0."""
    NB: tl.constexpr = v.shape[0] // BLOCK
    return tl.max(tl.reshape(abs_bits(v, mask), (NB, BLOCK)), axis=1)


@triton.jit
def expand_blocks(s, BLOCK: tl.constexpr):
    """``(NB,)`` per-block values repeated to one per lane: ``(NB * BLOCK,)``."""
    NB: tl.constexpr = s.shape[0]
    return tl.reshape(tl.broadcast_to(s[:, None], (NB, BLOCK)), (NB * BLOCK,))


@triton.jit
def e2m1_codes(y):
    """E2M1 codes (int32, 0..15) of float32 ``y`` (no NaN): nearest magnitude of 0, 0.5, 1, 1.5, 2, 3, 4,
    6 with ties to the even code, saturating at 6, the sign in bit 3 (from the sign bit: -0.0 gives 8)."""
    a = tl.abs(y)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    sign = (y.to(tl.int32, bitcast=True) >> 28) & 0x8  # arithmetic shift: bit 31 lands in bit 3
    return code | sign


@triton.jit
def store_packed(q_row_ptr, cols, codes, mask):
    """Store int32 E2M1 ``codes`` of the tile at element columns ``cols`` (``cols[0]`` even) as packed
    bytes: element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high one."""
    N: tl.constexpr = codes.shape[0]
    lo, hi = tl.split(tl.reshape(codes, (N // 2, 2)))
    c_lo, _ = tl.split(tl.reshape(cols, (N // 2, 2)))
    m_lo, _ = tl.split(tl.reshape(mask.to(tl.int32), (N // 2, 2)))
    tl.store(q_row_ptr + c_lo // 2, (lo | (hi << 4)).to(tl.uint8), mask=m_lo != 0)


@triton.jit
def swizzled_offset(m, k, n_col_tiles):
    """Byte offset of block scale ``[m, k]`` in the 128x4 layout with ``n_col_tiles = Cp // 4``."""
    return ((m // 128) * n_col_tiles + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


@triton.jit
def store_scales(s_ptr, row, blocks, scale_bytes, n_blocks, s_row_stride, n_col_tiles, SWIZZLED: tl.constexpr):
    """Store the uint8 scale bytes of ``blocks`` (block indices of one row, those ``< n_blocks``
    real): at ``row * s_row_stride + k`` (linear), or at :func:`swizzled_offset`."""
    if SWIZZLED:
        off = swizzled_offset(row, blocks.to(tl.int64), n_col_tiles)
    else:
        off = row * s_row_stride + blocks
    tl.store(s_ptr + off, scale_bytes, mask=blocks < n_blocks)


@triton.jit
def mx_exponent(amax_bits, RULE: tl.constexpr):
    """The MXFP4 shared exponent ``e`` (int32, in ``[-127, 127]``) of blocks of finite amax (int32 bits)."""
    if RULE == MX_RCEIL:
        d = tl.math.div_rn(amax_bits.to(tl.float32, bitcast=True), 6.0)
        e = ((pow2_ceil(d).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # 2^-127 (subnormal): -127
    else:
        b = amax_bits
        if RULE == MX_EVEN:
            b = b + 0x200000
        e = ((b >> 23) & 0xFF) - 129
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def mxfp4_tile(v, mask, q_row_ptr, s_ptr, row, cols, tile, H, s_row_stride, n_col_tiles,
               RULE: tl.constexpr, SWIZZLED: tl.constexpr):
    """MXFP4 of one tile of a row (float32 ``v``, whole blocks of 32): packed codes and E8M0 bytes."""
    NB: tl.constexpr = v.shape[0] // 32
    amax_bits = block_amax_bits(v, mask, 32)
    special = amax_bits >= _F32_INF_BITS  # NaN or +Inf
    e = mx_exponent(tl.where(special, 0, amax_bits), RULE)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e: normal for every e above
    y = v * expand_blocks(inv, 32)
    y = tl.where(expand_blocks(special, 32), 0.0, y)
    store_packed(q_row_ptr, cols, e2m1_codes(y), mask)
    scale = tl.where(special, 0xFF, e + 127).to(tl.uint8)
    store_scales(s_ptr, row, tl.arange(0, NB) + tile * NB, scale, H // 32, s_row_stride, n_col_tiles, SWIZZLED)


@triton.jit
def e4m3_value(code):
    """float32 value of non-negative e4m3fn codes (int32, 0..0x7E): ``m * 2^-9`` for exponent 0, else
    ``(1 + m / 8) * 2^(e - 7)``."""
    e = code >> 3
    m = code & 7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # 2^-9


@triton.jit
def nvfp4_tile(v, mask, g, q_row_ptr, s_ptr, row, cols, tile, H, s_row_stride, n_col_tiles,
               SWIZZLED: tl.constexpr):
    """NVFP4 of one tile of a row (float32 ``v``, whole blocks of 16; ``g`` the float32 global scale):
    packed codes and e4m3fn block-scale bytes."""
    NB: tl.constexpr = v.shape[0] // 16
    amax_bits = block_amax_bits(v, mask, 16)
    special = amax_bits >= _F32_INF_BITS
    amax = tl.where(special, 0, amax_bits).to(tl.float32, bitcast=True)
    sf = tl.math.div_rn(amax, 6.0) * g
    sf = tl.minimum(tl.maximum(sf, 0.0), 448.0)  # +Inf (a huge g) to 448
    code = fp8_encode_soft(sf, tl.float8e4nv).to(tl.int32)
    s32 = e4m3_value(code)
    factor = tl.where(s32 > 0.0, tl.math.div_rn(g + tl.zeros(s32.shape, tl.float32), tl.where(s32 > 0.0, s32, 1.0)),
                      0.0)
    y = v * expand_blocks(factor, 16)
    y = tl.where(expand_blocks(special, 16), 0.0, y)
    store_packed(q_row_ptr, cols, e2m1_codes(y), mask)
    scale = tl.where(special, 0x7F, code).to(tl.uint8)
    store_scales(s_ptr, row, tl.arange(0, NB) + tile * NB, scale, H // 16, s_row_stride, n_col_tiles, SWIZZLED)


@triton.jit
def _mxfp4_quant_kernel(x_ptr, q_ptr, s_ptr, H, x_row_stride, q_row_stride, s_row_stride, n_col_tiles,
                        RULE: tl.constexpr, SWIZZLED: tl.constexpr, BLOCK_H: tl.constexpr,
                        NUM_TILES: tl.constexpr):
    """One program per row: packed codes ``q[row]`` and the row's E8M0 scale bytes."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    for t in tl.static_range(NUM_TILES):
        cols = t * BLOCK_H + offs
        mask = cols < H
        v = widen(tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0))
        mxfp4_tile(v, mask, q_ptr + row * q_row_stride, s_ptr, row, cols, t, H, s_row_stride, n_col_tiles,
                   RULE, SWIZZLED)


@triton.jit
def _nvfp4_quant_kernel(x_ptr, g_ptr, q_ptr, s_ptr, H, x_row_stride, q_row_stride, s_row_stride, n_col_tiles,
                        SWIZZLED: tl.constexpr, BLOCK_H: tl.constexpr, NUM_TILES: tl.constexpr):
    """One program per row: packed codes ``q[row]`` and the row's e4m3fn block-scale bytes; the global
    scale read from ``g_ptr``."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(g_ptr)
    offs = tl.arange(0, BLOCK_H)
    for t in tl.static_range(NUM_TILES):
        cols = t * BLOCK_H + offs
        mask = cols < H
        v = widen(tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0))
        nvfp4_tile(v, mask, g, q_ptr + row * q_row_stride, s_ptr, row, cols, t, H, s_row_stride, n_col_tiles,
                   SWIZZLED)


def launch_mxfp4_quant(x, q, scales, rule: int, swizzled: bool, n_col_tiles: int, block_h: int, num_tiles: int,
                       num_warps: int) -> None:
    """Run the MXFP4 kernel: ``x`` ``(T, H)`` with unit column stride, ``q`` ``(T, H // 2)`` uint8 with unit
    column stride, ``scales`` uint8: ``(T, H // 32)`` with unit column stride, or with ``swizzled`` a zeroed
    contiguous 128x4 buffer of ``n_col_tiles * 4`` columns. No validation (see :mod:`tpcomm.quant`)."""
    T, H = x.shape
    if T == 0:
        return
    _mxfp4_quant_kernel[(T,)](x, q, scales, H, x.stride(0), q.stride(0), scales.stride(0), n_col_tiles, RULE=rule,
                              SWIZZLED=swizzled, BLOCK_H=block_h, NUM_TILES=num_tiles, num_warps=num_warps)


def launch_nvfp4_quant(x, global_scale, q, scales, swizzled: bool, n_col_tiles: int, block_h: int,
                       num_tiles: int, num_warps: int) -> None:
    """Run the NVFP4 kernel: as :func:`launch_mxfp4_quant`, ``scales`` a uint8 view of the e4m3fn block
    scales (``(T, H // 16)`` linear), ``global_scale`` one float32 element."""
    T, H = x.shape
    if T == 0:
        return
    _nvfp4_quant_kernel[(T,)](x, global_scale, q, scales, H, x.stride(0), q.stride(0), scales.stride(0),
                              n_col_tiles, SWIZZLED=swizzled, BLOCK_H=block_h, NUM_TILES=num_tiles,
                              num_warps=num_warps)
