"""The reduction and the residual + RMSNorm epilogue, shared by every algorithm.

Every algorithm calls these same functions (Lamport sums its rows of one tile in its poll, with the same
additions as :func:`reduce_tile`) with the same ``BLOCK_H`` (chosen from the hidden size alone,
:func:`tpcomm.dispatch.row_config`) and reduces by pairs or by max, whatever the layout the compiler picks
for the ``num_warps`` of the launch (two-shot runs fewer warps than Lamport and one-shot), so the
reduction trees, and thus the bits of every output, do not depend on the algorithm, the warps, the grid,
the rank or the number of rows.

Numerics (docs/numerics.md):
  s = T(sum_r f32(x_r)) in rank order starting from +0.0;
  residual_out = T(f32(s) + f32(residual));
  out = T((f32(residual_out) * inv) * w'), inv = 1/sqrt(mean(f32(residual_out)^2) + eps), w' = f32(w) or
  1 + f32(w); for 16-bit outputs with a finite non-zero inv, T((f32(residual_out) * w') * inv) instead,
  within the contract's one ulp of it (:func:`weight_first`): the largest ``|out|`` of such a row comes from
  its largest ``|v * w'|``, which per-token FP8 reduces beside the sum of squares (:func:`out_amax`).
The square root and the division are the correctly rounded ones (``sqrt_rn``, ``div_rn``), so float32
outputs differ from a float32 reference only through the order of the mean's sum. That sum is taken by
pairs (:func:`tree_sum`), never with ``tl.sum`` over a tile, whose order follows the layout the compiler
picks and changed between kernel variants on an H200 (the FP8 variant's ``out`` differed from the plain
one's); the launchers also turn off FMA contraction (``enable_fp_fusion=False``), so ``a * b + c`` is
always two roundings, as in the reference.
"""

from dataclasses import dataclass, replace

import triton
import triton.language as tl

from ..env import interpreter_enabled
from . import interpreted
from .fp4 import mxfp4_tile, nvfp4_tile
from .quant import (
    _F32_MAX,
    abs_bits,
    amax_from_bits,
    fp8_encode,
    fp8_scale,
    group_amax,
    group_division,
    pow2_ceil,
    quantize,
    row_amax,
    static_inverse,
    store_fp8,
    token_division,
    widen,
)

#: ``QUANT`` of :func:`reduce_norm_row`: no FP8 output, one scale per row, one per group of a row.
QUANT_NONE = tl.constexpr(0)
QUANT_PER_TOKEN = tl.constexpr(1)
QUANT_PER_GROUP = tl.constexpr(2)
#: Per group with power-of-two (UE8M0) scales: each group's scale rounded up (``quant.pow2_ceil``).
QUANT_PER_GROUP_UE8M0 = tl.constexpr(3)
#: Static per tensor: one calibrated scale, an input read from ``in_scale_ptr`` (:func:`quant_static_tile`).
QUANT_STATIC = tl.constexpr(4)
#: FP4 (``fp4.py``): MXFP4 (blocks of 32, E8M0 scale bytes) and NVFP4 (blocks of 16, e4m3fn block scales,
#: the global scale read from ``in_scale_ptr``); ``q`` holds two codes a byte (:func:`quant_fp4_tile`).
QUANT_MXFP4 = tl.constexpr(5)
QUANT_NVFP4 = tl.constexpr(6)

#: ``SUM`` of :func:`reduce_norm_row`: where the row's sum ``s`` comes from: reduced from the ranks' rows
#: (:func:`reduce_tile`), loaded as another program computed it (two-shot's gathered rows), or given
#: (``s_pre``: Lamport, which sums the tiles as its poll loaded them).
SUM_REDUCE = tl.constexpr(0)
SUM_LOAD = tl.constexpr(1)
SUM_GIVEN = tl.constexpr(2)

# Triton's interpreter (3.9) truncates float32 -> bfloat16 (and mangles subnormals) whatever rounding
# is asked for; under it, bf16 outputs are rounded to nearest-even on the bits instead.
_SOFT_BF16: tl.constexpr = tl.constexpr(interpreter_enabled())


if interpreted.HOST_TWINS:  # under the interpreter only
    @triton.jit
    def _bf16_rne(v):
        return interpreted.bf16_rne(v)  # the operations below in one NumPy step
else:
    @triton.jit
    def _bf16_rne(v):
        b = v.to(tl.uint32, bitcast=True)
        r = b + 0x7FFF + ((b >> 16) & 1)
        r = tl.where(v != v, b | 0x400000, r)  # NaN stays a (quiet) NaN
        return (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_to(v, DTYPE: tl.constexpr):
    """float32 ``v`` rounded to nearest-even in ``DTYPE`` (the contract's ``T(...)``)."""
    if _SOFT_BF16 and DTYPE == tl.bfloat16:
        return _bf16_rne(v)
    else:
        return v.to(DTYPE)


@triton.jit
def reduce_tile(x_row_ptr, recv_row_ptr, slot_stride, cols, mask, rank, WORLD: tl.constexpr):
    """Sum one tile of a row over the ranks in rank order, in float32 from +0.0 (``lamport._poll_tile``
    makes the same additions from the tiles it polled: keep the two in step).

    ``x_row_ptr`` is this rank's own input row (read in place); ``recv_row_ptr + q * slot_stride`` is the
    row that rank ``q`` pushed into this rank's receive buffer. Returns the float32 accumulator.
    """
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    ranks = tl.full(cols.shape, rank, tl.int32)  # a block, so masks stay blocks under the interpreter
    for q in tl.static_range(WORLD):
        mine = ranks == q
        a = tl.load(x_row_ptr + cols, mask=mask & mine, other=0.0)
        b = tl.load(recv_row_ptr + q * slot_stride + cols, mask=mask & (ranks != q), other=0.0,
                    cache_modifier=".cg")
        acc += widen(tl.where(mine, a, b))
    return acc


@triton.jit
def sum_tile(x_row_ptr, recv_row_ptr, slot_stride, cols, mask, rank, WORLD: tl.constexpr,
             SUM: tl.constexpr, DTYPE: tl.constexpr):
    """The contract's ``s`` for one tile, in ``DTYPE``: :func:`reduce_tile` rounded (``SUM_REDUCE``), or
    ``s`` as another program already computed it, loaded from ``recv_row_ptr`` (``SUM_LOAD``: two-shot's
    gathered rows)."""
    if SUM == SUM_LOAD:
        return tl.load(recv_row_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        return round_to(reduce_tile(x_row_ptr, recv_row_ptr, slot_stride, cols, mask, rank, WORLD), DTYPE)


@triton.jit
def preload_row(res_row_ptr, w_ptr, row_start, numel, H, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The residual tile of one row and the norm weight's tile, ``(res_pre, w_pre)``, loaded before a
    program waits for its peers so that their latency hides under the wait (rows of one tile; without a
    residual ``res_pre`` is the weight again, unused). Pass them to :func:`reduce_norm_row` with
    ``PRELOAD``."""
    offs = tl.arange(0, BLOCK_H)
    w_pre = tl.load(w_ptr + offs, mask=offs < H, other=0.0)
    if HAS_RESIDUAL:
        res_pre = tl.load(res_row_ptr + offs, mask=(offs < H) & (row_start + offs < numel), other=0.0)
    else:
        res_pre = w_pre
    return res_pre, w_pre


@triton.jit
def residual_tile(s, res_row_ptr, res_out_row_ptr, cols, mask, res_pre, use_pre, HAS_RESIDUAL: tl.constexpr,
                  PRELOAD: tl.constexpr):
    """``residual_out = T(f32(s) + f32(residual))`` stored and returned as float32 (or ``s`` itself
    when there is no residual). ``s`` is already rounded to the input dtype. With ``PRELOAD`` the
    residual is ``res_pre`` where ``use_pre`` (:func:`preload_row` loaded this row), else loaded."""
    if HAS_RESIDUAL:
        if PRELOAD:
            r = tl.load(res_row_ptr + cols, mask=tl.where(use_pre, cols < 0, mask), other=0.0)  # no lane where use_pre
            r = widen(tl.where(use_pre, res_pre, r))
        else:
            r = widen(tl.load(res_row_ptr + cols, mask=mask, other=0.0))
        ro = round_to(widen(s) + r, s.dtype)
        tl.store(res_out_row_ptr + cols, ro, mask=mask)
        return widen(ro)
    else:
        return widen(s)


#: Lanes of a warp: :func:`tree_sum` gathers its last partial sums into one warp.
_WARP_LANES: tl.constexpr = tl.constexpr(32)


@triton.jit
def tree_sum(x):
    """Sum of a 1-D tile of a power-of-two size by pairs, ``((x0 + x1) + (x2 + x3)) + ...``: every
    addition has two operands, so the bits do not depend on how the compiler lays the tile out over
    threads (``tl.sum``'s order does, and it changes between kernel variants, e.g. with FP8 stores).

    Once 32 partial sums are left, an identity ``tl.gather`` moves them into the lanes of one warp (one
    exchange through shared memory), so the last levels are warp shuffles: summed where they lay, each
    level whose pairs sit in different warps would take its own exchange and barriers (7 barriers in
    all for 8192 lanes over 16 warps against 1 in a kernel of the sum alone, sm_90 build). Moving values
    changes no bit (docs/design.md, "The norm's sum")."""
    for _ in tl.static_range(14):  # up to 2**14 lanes (MAX_BLOCK_H is 8192)
        if x.shape[0] > _WARP_LANES:
            x = tl.sum(tl.reshape(x, (x.shape[0] // 2, 2)), axis=1)
    x = tl.gather(x, tl.arange(0, x.shape[0]), 0)
    for _ in tl.static_range(5):
        if x.shape[0] > 1:
            x = tl.sum(tl.reshape(x, (x.shape[0] // 2, 2)), axis=1)
    return tl.sum(x, axis=0)


@triton.jit
def rms_inverse(sum_sq, H, eps):
    """``1 / sqrt(sum_sq / H + eps)`` with correctly rounded square root and divisions."""
    ms = tl.math.div_rn(sum_sq, H.to(tl.float32))
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))


@triton.jit
def weight_tile(w_ptr, cols, mask, w_pre, GEMMA: tl.constexpr, PRELOAD: tl.constexpr):
    """The norm's ``w'`` for one tile, float32: ``f32(w)``, or ``1 + f32(w)`` with ``GEMMA``; the weight
    is ``w_pre`` with ``PRELOAD``, else loaded (0 in masked lanes)."""
    if PRELOAD:
        w = widen(w_pre)
    else:
        w = widen(tl.load(w_ptr + cols, mask=mask, other=0.0))
    if GEMMA:
        w = 1.0 + w
    return w


@triton.jit
def weight_first(inv, DTYPE: tl.constexpr):
    """Whether ``out`` is ``T((v * w') * inv)`` (True) or the contract's written order ``T((v * inv) * w')``
    (False), for a row of ``DTYPE`` output and norm inverse ``inv`` (a float32 scalar: the same in every
    thread). Weight first for 16-bit outputs with ``0 < inv <= FLT_MAX``: then the largest ``|out|`` of a
    row comes from its largest ``|v * w'|`` (:func:`out_amax`), found beside the sum of squares, so
    per-token FP8 needs no reduction over ``out`` after the norm.

    The two orders differ by a few float32 ulps, which a 16-bit rounding turns into at most one ulp of
    ``out`` (the contract's allowance, docs/numerics.md item 3), as long as ``v * w'`` does not overflow,
    which with ``inv > 0`` (every ``|v| < 2^64``) takes ``|w'| >= 2^64``. Elsewhere the written order: for
    float32 outputs (where the orders differ by up to 2 ulps), for ``inv`` 0 (the squares overflow:
    ``(v * 0) * w'`` is 0, where ``(v * w') * 0`` could be NaN) and for ``inv`` +Inf or NaN.
    ``tpcomm.reference`` applies the same rule."""
    if DTYPE.primitive_bitwidth == 16:
        first = (inv > 0.0) & (inv <= _F32_MAX)
    else:
        first = False  # a constant: the compiler drops the weight-first branches and their amax
    return first


@triton.jit
def norm_tile(v, w, inv, first, out_row_ptr, cols, mask, STORE_OUT: tl.constexpr):
    """``out`` for one tile: ``T((v * w') * inv)`` where ``first`` (:func:`weight_first`), else
    ``T((v * inv) * w')``; ``v`` is float32 ``residual_out`` (or ``s``), ``w`` float32 ``w'``
    (:func:`weight_tile`). Stored when ``STORE_OUT``. Returns ``out`` widened back to float32 (what FP8
    quantises)."""
    if first:
        y = (v * w) * inv
    else:
        y = (v * inv) * w
    o = round_to(y, out_row_ptr.dtype.element_ty)
    if STORE_OUT:
        tl.store(out_row_ptr + cols, o, mask=mask)
    return widen(o)


@triton.jit
def out_amax(p_max, inv, DTYPE: tl.constexpr):
    """``max |out|`` of a row whose ``out`` is ``T((v * w') * inv)`` (:func:`weight_first`), from
    ``p_max = max |v * w'|`` over it (float32, NaN if any is), without a reduction over ``out``:
    ``T(p_max * inv)``.

    Why it is exact: with ``0 < inv <= FLT_MAX``, ``p -> T(p * inv)`` is odd and, for ``p >= 0``,
    non-decreasing in the order that :func:`quant.abs_bits` gives (rounding to float32, then to
    ``DTYPE``, never reverses an order; Inf and NaN stay Inf and NaN, NaN above every number in that
    order), so the largest ``|out|`` is the image of the largest ``|p|``. The written order
    ``T((v * inv) * w')`` has no such property: two roundings, with a different weight in each element,
    can make another element than the largest ``|v * w'|`` give the largest ``|out|``."""
    return widen(round_to(p_max * inv, DTYPE))


@triton.jit
def tile_out_amax(p_max, inv, first, o, mask, DTYPE: tl.constexpr):
    """``max |out|`` of a row of one tile: :func:`out_amax` of ``p_max`` where ``first``
    (:func:`weight_first`), else a reduction over the tile ``o`` of ``out`` itself (float32, masked
    lanes ignored): the reduction stays off the path to the first byte where it can (docs/design.md,
    "The FP8 amax")."""
    if first:
        amax = out_amax(p_max, inv, DTYPE)
    else:
        amax = row_amax(o, mask)
    return amax


@triton.jit
def quant_group_tile(o, q_row_ptr, s_row_ptr, s_group_stride, cols, mask, tile, H,
                     FP8: tl.constexpr, NATIVE_FP8: tl.constexpr, GROUP: tl.constexpr, SRC_BITS: tl.constexpr,
                     UE8M0: tl.constexpr):
    """Per-group FP8 of one tile of ``out`` (float32 ``o``): the tile holds whole groups (``GROUP``
    divides ``BLOCK_H``), so bytes and scales are stored at once (docs/numerics.md item 4, per group).
    ``SRC_BITS``: the bits of ``out``'s dtype (16-bit ones may take ``quant.divide``'s fast path).
    ``UE8M0``: each scale rounded up to a power of two first (``quant.pow2_ceil``)."""
    NG: tl.constexpr = o.shape[0] // GROUP
    sc = fp8_scale(group_amax(o, mask, GROUP), FP8)
    if UE8M0:
        sc = pow2_ceil(sc)
    lane_scales, recip, fast = group_division(sc, SRC_BITS == 16, GROUP)
    store_fp8(q_row_ptr, cols, quantize(o, lane_scales, recip, fast, FP8, NATIVE_FP8), mask, SRC_BITS)
    g = tile * NG + tl.arange(0, NG)
    tl.store(s_row_ptr + g * s_group_stride, sc, mask=g * GROUP < H)


@triton.jit
def quant_static_tile(o, q_row_ptr, inv, cols, mask, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr,
                      SRC_BITS: tl.constexpr):
    """Static per-tensor FP8 of one tile of ``out`` (float32 ``o``): the bytes ``fp8(o * inv)`` with
    ``inv`` from :func:`quant.static_inverse`, saturating, nearest-even, NaN as the canonical NaN byte
    (docs/numerics.md, "Static per-tensor FP8"), as ``quant._static_quant_kernel`` stores them. No
    scale is stored: it is the caller's input."""
    store_fp8(q_row_ptr, cols, fp8_encode(o * inv, FP8, NATIVE_FP8), mask, SRC_BITS)


@triton.jit
def fp4_row(q_row_ptr, s_row_ptr, s_group_stride, row_start, H, BLOCK: tl.constexpr, SWIZZLED: tl.constexpr):
    """Where an FP4 row's bytes and scales go, from what the kernels pass every quant form: ``(q4, s4, m,
    n_col_tiles)``. The kernels address ``q`` like ``out`` (``q_row_ptr = q + row_start``), and FP4 rows
    are ``H / 2`` bytes: ``q4 = q + row_start / 2``. Linear scales: ``s_row_ptr`` is the row's (the
    launch's ``row_stride`` is ``H / BLOCK``), ``m`` 0. Swizzled: ``s_row_ptr`` is the buffer itself (row
    stride 0) and ``s_group_stride`` the launch's first row, so ``m = s_group_stride + row_start / H`` is
    the row's index in the call (``fp4.swizzled_offset``)."""
    q4 = q_row_ptr - (row_start - row_start // 2)
    if SWIZZLED:
        m = s_group_stride + row_start // H
    else:
        m = row_start * 0
    return q4, s_row_ptr, m, (H + 4 * BLOCK - 1) // (4 * BLOCK)


@triton.jit
def quant_fp4_tile(o, mask, q4, s4, m, n_col_tiles, in_scale_ptr, cols, tile, H, QUANT: tl.constexpr,
                   SWIZZLED: tl.constexpr):
    """MXFP4 or NVFP4 of one tile of ``out`` (float32 ``o``, whole blocks; :func:`fp4_row` gave the
    pointers): the packed codes and the block scales, as ``fp4._mxfp4_quant_kernel`` /
    ``_nvfp4_quant_kernel`` store them (docs/numerics.md, "MXFP4", "NVFP4")."""
    if QUANT == QUANT_MXFP4:
        mxfp4_tile(o, mask, q4, s4, m, cols, tile, H, 0, n_col_tiles, 0, SWIZZLED)
    else:
        nvfp4_tile(o, mask, tl.load(in_scale_ptr), q4, s4, m, cols, tile, H, 0, n_col_tiles, SWIZZLED)


@triton.jit
def _stored_row_tile(res_out_row_ptr, out_row_ptr, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """A tile of the row that a multi-tile epilogue's first pass stored, widened: ``residual_out``, or
    ``s`` (in ``out``) without a residual."""
    if HAS_RESIDUAL:
        v = tl.load(res_out_row_ptr + cols, mask=mask, other=0.0)
    else:
        v = tl.load(out_row_ptr + cols, mask=mask, other=0.0)
    return widen(v)


@triton.jit
def reduce_norm_row(x_row_ptr, recv_row_ptr, slot_stride, res_row_ptr, res_out_row_ptr, w_ptr,
                    out_row_ptr, q_row_ptr, s_row_ptr, s_group_stride, in_scale_ptr, row_start, numel, H, eps,
                    rank,
                    res_pre, w_pre, use_pre, s_pre,
                    WORLD: tl.constexpr, BLOCK_H: tl.constexpr, NUM_TILES: tl.constexpr,
                    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
                    SUM: tl.constexpr, QUANT: tl.constexpr, STORE_OUT: tl.constexpr,
                    FP8: tl.constexpr, NATIVE_FP8: tl.constexpr, GROUP: tl.constexpr, PRELOAD: tl.constexpr):
    """Reduce one row over the ranks (``SUM_REDUCE``; or, with ``SUM_LOAD``, load its sum ``s`` from
    ``recv_row_ptr``; or, with ``SUM_GIVEN``, a row of one tile only, take it from ``s_pre``, rounded to
    the input dtype) and run the epilogue.

    Without ``NORM`` stores ``s`` to ``out``. With ``NORM`` stores ``residual_out`` (when
    ``HAS_RESIDUAL``) and ``out`` (when ``STORE_OUT``), and with ``QUANT`` (``QUANT_PER_TOKEN``,
    ``QUANT_PER_GROUP`` or ``QUANT_PER_GROUP_UE8M0``) the FP8 bytes of ``out`` at ``q_row_ptr`` (uint8)
    and their float32 scales at ``s_row_ptr + g * s_group_stride`` (group ``g``; per token: one scale);
    with ``QUANT_STATIC`` the bytes only, from the one float32 scale at ``in_scale_ptr``; with
    ``QUANT_MXFP4`` / ``QUANT_NVFP4`` packed E2M1 codes and block scales (:func:`fp4_row` says where;
    ``GROUP`` 1 means linear scales, 0 swizzled; NVFP4's global scale at ``in_scale_ptr``).
    ``row_start`` is the row's first element in the flat tensor; elements at or beyond ``numel`` are
    masked (plain all-reduce of a tensor that is not a whole number of rows).
    A row wider than ``BLOCK_H`` is processed in ``NUM_TILES`` tiles: the first pass stores
    ``residual_out`` (or ``s`` into ``out``, whatever ``STORE_OUT``) and accumulates squares (and, for
    per-token FP8, the largest ``|v * w'|``, which gives the row's amax through :func:`out_amax` before
    any of ``out`` is computed), the second re-reads, normalises and quantises. Rows that do not take
    the weight first (:func:`weight_first`: float32 outputs, an inverse of 0, +Inf or NaN) find the
    per-token amax in a pass of their own over ``out`` between the two.
    ``PRELOAD`` (one-tile rows with ``NORM`` only): the weight is ``w_pre`` and, where ``use_pre``, the
    residual is ``res_pre`` (:func:`preload_row`); callers without it pass any tensors and False.
    """
    DTYPE: tl.constexpr = out_row_ptr.dtype.element_ty
    SRC_BITS: tl.constexpr = DTYPE.primitive_bitwidth
    SRC16: tl.constexpr = SRC_BITS == 16
    FP4_BLOCK: tl.constexpr = 32 if QUANT == QUANT_MXFP4 else 16
    offs = tl.arange(0, BLOCK_H)
    if NUM_TILES == 1:
        mask = (offs < H) & (row_start + offs < numel)
        if SUM == SUM_GIVEN:
            s = s_pre
        else:
            s = sum_tile(x_row_ptr, recv_row_ptr, slot_stride, offs, mask, rank, WORLD, SUM, DTYPE)
        if NORM:
            v = residual_tile(s, res_row_ptr, res_out_row_ptr, offs, mask, res_pre, use_pre, HAS_RESIDUAL,
                              PRELOAD)
            w = weight_tile(w_ptr, offs, mask, w_pre, GEMMA, PRELOAD)
            if QUANT == QUANT_PER_TOKEN:
                p_max = row_amax(v * w, mask)  # needs no inv: reduced beside the sum of squares, not after it
            if QUANT == QUANT_STATIC:
                q_inv = static_inverse(in_scale_ptr)
            inv = rms_inverse(tree_sum(v * v), H, eps)
            first = weight_first(inv, DTYPE)
            o = norm_tile(v, w, inv, first, out_row_ptr, offs, mask, STORE_OUT)
            if QUANT == QUANT_PER_TOKEN:
                scale = fp8_scale(tile_out_amax(p_max, inv, first, o, mask, DTYPE), FP8)
                recip, fast = token_division(scale, SRC16)
                store_fp8(q_row_ptr, offs, quantize(o, scale, recip, fast, FP8, NATIVE_FP8), mask, SRC_BITS)
                tl.store(s_row_ptr, scale)
            elif QUANT == QUANT_STATIC:
                quant_static_tile(o, q_row_ptr, q_inv, offs, mask, FP8, NATIVE_FP8, SRC_BITS)
            elif QUANT >= QUANT_MXFP4:
                q4, s4, m, n_col_tiles = fp4_row(q_row_ptr, s_row_ptr, s_group_stride, row_start, H, FP4_BLOCK,
                                                 GROUP == 0)
                quant_fp4_tile(o, mask, q4, s4, m, n_col_tiles, in_scale_ptr, offs, 0, H, QUANT, GROUP == 0)
            elif QUANT >= QUANT_PER_GROUP:
                quant_group_tile(o, q_row_ptr, s_row_ptr, s_group_stride, offs, mask, 0, H, FP8, NATIVE_FP8,
                                 GROUP, SRC_BITS, QUANT == QUANT_PER_GROUP_UE8M0)
        else:
            tl.store(out_row_ptr + offs, s, mask=mask)
    else:
        tl.static_assert(SUM != SUM_GIVEN, "a given sum is one tile")
        sq = tl.zeros([BLOCK_H], dtype=tl.float32)
        p_bits = tl.zeros([BLOCK_H], dtype=tl.int32)
        for t in tl.static_range(NUM_TILES):
            cols = t * BLOCK_H + offs
            mask = (cols < H) & (row_start + cols < numel)
            s = sum_tile(x_row_ptr, recv_row_ptr, slot_stride, cols, mask, rank, WORLD, SUM, DTYPE)
            if NORM:
                if HAS_RESIDUAL:
                    v = residual_tile(s, res_row_ptr, res_out_row_ptr, cols, mask, s, False, HAS_RESIDUAL, False)
                else:
                    tl.store(out_row_ptr + cols, s, mask=mask)
                    v = widen(s)
                sq += v * v
                if QUANT == QUANT_PER_TOKEN:
                    p = v * weight_tile(w_ptr, cols, mask, v, GEMMA, False)
                    p_bits = tl.maximum(p_bits, abs_bits(p, mask))
            else:
                tl.store(out_row_ptr + cols, s, mask=mask)
        if NORM:
            inv = rms_inverse(tree_sum(sq), H, eps)
            first = weight_first(inv, DTYPE)
            tl.debug_barrier()
            if QUANT == QUANT_PER_TOKEN:
                if first:
                    amax = out_amax(amax_from_bits(p_bits), inv, DTYPE)
                else:  # max |out| from a pass over every tile of out, before any byte
                    o_bits = tl.zeros([BLOCK_H], dtype=tl.int32)
                    for t in tl.static_range(NUM_TILES):
                        cols = t * BLOCK_H + offs
                        mask = cols < H
                        v = _stored_row_tile(res_out_row_ptr, out_row_ptr, cols, mask, HAS_RESIDUAL)
                        o = norm_tile(v, weight_tile(w_ptr, cols, mask, v, GEMMA, False), inv, first, out_row_ptr,
                                      cols, mask, False)
                        o_bits = tl.maximum(o_bits, abs_bits(o, mask))
                    amax = amax_from_bits(o_bits)
                scale = fp8_scale(amax, FP8)
                recip, fast = token_division(scale, SRC16)
            if QUANT == QUANT_STATIC:
                q_inv = static_inverse(in_scale_ptr)
            if QUANT >= QUANT_MXFP4:
                q4, s4, m, n_col_tiles = fp4_row(q_row_ptr, s_row_ptr, s_group_stride, row_start, H, FP4_BLOCK,
                                                 GROUP == 0)
            for t in tl.static_range(NUM_TILES):
                cols = t * BLOCK_H + offs
                mask = cols < H
                v = _stored_row_tile(res_out_row_ptr, out_row_ptr, cols, mask, HAS_RESIDUAL)
                if STORE_OUT and not HAS_RESIDUAL:
                    tl.debug_barrier()  # every thread has read its tile of out (s) before out is written
                o = norm_tile(v, weight_tile(w_ptr, cols, mask, v, GEMMA, False), inv, first, out_row_ptr, cols,
                              mask, STORE_OUT)
                if QUANT == QUANT_PER_TOKEN:
                    store_fp8(q_row_ptr, cols, quantize(o, scale, recip, fast, FP8, NATIVE_FP8), mask, SRC_BITS)
                elif QUANT == QUANT_STATIC:
                    quant_static_tile(o, q_row_ptr, q_inv, cols, mask, FP8, NATIVE_FP8, SRC_BITS)
                elif QUANT >= QUANT_MXFP4:
                    quant_fp4_tile(o, mask, q4, s4, m, n_col_tiles, in_scale_ptr, cols, t, H, QUANT, GROUP == 0)
                elif QUANT >= QUANT_PER_GROUP:
                    quant_group_tile(o, q_row_ptr, s_row_ptr, s_group_stride, cols, mask, t, H, FP8,
                                     NATIVE_FP8, GROUP, SRC_BITS, QUANT == QUANT_PER_GROUP_UE8M0)
            if QUANT == QUANT_PER_TOKEN:
                tl.store(s_row_ptr, scale)


@dataclass(frozen=True)
class QuantOut:
    """Where a fused launch writes its quantised output (host side; a launcher passes these to the
    kernel).

    Attributes:
        q: ``uint8`` view of the FP8 output, laid out like ``out`` (rows of ``H``, addressed flat); FP4:
            rows of ``H / 2`` bytes.
        scales: float32; the scale of group ``g`` of row ``i`` is at element
            ``i * row_stride + g * group_stride`` (per token: ``g`` is 0). FP4: uint8 block scales,
            linear (``row_stride`` the blocks of a row, ``group_stride`` 1) or the 128x4 swizzled buffer
            (``row_stride`` 0, ``group_stride`` the first row of the launch: :func:`fp4_row`).
        row_stride, group_stride: element strides of ``scales`` (row-major or column-major layouts).
        mode: ``QUANT_PER_TOKEN.value``, ``QUANT_PER_GROUP.value``, ``QUANT_PER_GROUP_UE8M0.value``,
            ``QUANT_STATIC.value`` (no output scales: ``scales`` is ``in_scale``, unused, strides 0),
            ``QUANT_MXFP4.value`` or ``QUANT_NVFP4.value``.
        fp8: ``tl.float8e4nv`` (e4m3fn) or ``tl.float8e4b8`` (e4m3fnuz).
        native: use the hardware conversion (:func:`tpcomm.quant.native_fp8`).
        group: elements per group (per-group mode); FP4: 1 for linear scales, 0 for swizzled ones; 1
            otherwise.
        store_out: also store the unquantised ``out`` (asked for).
        in_scale: the form's one-element float32 input (static FP8's scale, NVFP4's global scale), read
            by the kernel; None for the other forms.
    """

    q: object
    scales: object
    row_stride: int
    group_stride: int
    mode: int
    fp8: object
    native: bool
    group: int
    store_out: bool
    in_scale: object = None

    def shifted(self, row0: int, elem0: int) -> "QuantOut":
        """The same output seen from row ``row0`` (flat element ``elem0``) of the call: for a launch of
        a chunk of rows. The scales pointer moves on the storage, which serves both layouts; swizzled FP4
        scales keep the buffer and take ``row0`` as ``group_stride`` (:func:`fp4_row`)."""
        if row0 == 0 and elem0 == 0:
            return self
        fp4 = self.mode >= QUANT_MXFP4.value
        q = self.q.view(-1)[elem0 // 2 if fp4 else elem0:]
        if fp4 and self.group == 0:
            return replace(self, q=q, group_stride=row0)
        first = self.scales.as_strided((1,), (1,), self.scales.storage_offset() + row0 * self.row_stride)
        return replace(self, q=q, scales=first)

    def kernel_args(self) -> tuple:
        """``(q, scales, row_stride, group_stride, in_scale)``, the kernel's pointer arguments (``in_scale``
        is ``scales`` for forms without one: never read)."""
        return (self.q, self.scales, self.row_stride, self.group_stride,
                self.scales if self.in_scale is None else self.in_scale)

    def constexprs(self) -> dict:
        """The kernel's ``QUANT``, ``STORE_OUT``, ``FP8``, ``NATIVE_FP8`` and ``GROUP``."""
        return dict(QUANT=self.mode, STORE_OUT=self.store_out, FP8=self.fp8, NATIVE_FP8=self.native,
                    GROUP=self.group)


def no_quant_args(out) -> tuple:
    """Kernel arguments of a launch without FP8 output (unused pointers point at ``out``)."""
    return (out, out, 0, 0, out)


#: Constexprs of a launch without FP8 output.
NO_QUANT = dict(QUANT=0, STORE_OUT=True, FP8=tl.float8e4nv, NATIVE_FP8=False, GROUP=1)
