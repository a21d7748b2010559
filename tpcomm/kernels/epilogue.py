"""The reduction and the residual + RMSNorm epilogue, shared by every algorithm.

Every algorithm calls these same functions with the same ``BLOCK_H`` and ``num_warps`` (both chosen
from the hidden size alone, :func:`tpcomm.dispatch.row_config`), so the reduction trees, and thus the
bits of every output, do not depend on the algorithm, the grid, the rank or the number of rows.

Numerics (DESIGN.md, "The numerics contract"):
  s = T(sum_r f32(x_r)) in rank order starting from +0.0;
  residual_out = T(f32(s) + f32(residual));
  out = T(f32(residual_out) * 1/sqrt(mean(f32(residual_out)^2) + eps) * w'), w' = f32(w) or 1 + f32(w).
The square root and the division are the correctly rounded ones (``sqrt_rn``, ``div_rn``), so float32
outputs differ from a float32 reference only through the order of the mean's sum.
"""

import triton
import triton.language as tl

from ..env import interpreter_enabled

# Triton's interpreter (3.9) truncates float32 -> bfloat16 (and mangles subnormals) whatever rounding
# is asked for; under it, bf16 outputs are rounded to nearest-even on the bits instead.
_SOFT_BF16: tl.constexpr = tl.constexpr(interpreter_enabled())


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
    """Sum one tile of a row over the ranks in rank order, in float32 from +0.0.

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
        acc += tl.where(mine, a, b).to(tl.float32)
    return acc


@triton.jit
def sum_tile(x_row_ptr, recv_row_ptr, slot_stride, cols, mask, rank, WORLD: tl.constexpr,
             PRE_REDUCED: tl.constexpr, DTYPE: tl.constexpr):
    """The contract's ``s`` for one tile, in ``DTYPE``: :func:`reduce_tile` rounded, or, with
    ``PRE_REDUCED``, ``s`` as another program already computed it, loaded from ``recv_row_ptr`` (two-shot's
    gathered rows)."""
    if PRE_REDUCED:
        return tl.load(recv_row_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        return round_to(reduce_tile(x_row_ptr, recv_row_ptr, slot_stride, cols, mask, rank, WORLD), DTYPE)


@triton.jit
def residual_tile(s, res_row_ptr, res_out_row_ptr, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """``residual_out = T(f32(s) + f32(residual))`` stored and returned as float32 (or ``s`` itself
    when there is no residual). ``s`` is already rounded to the input dtype."""
    if HAS_RESIDUAL:
        r = tl.load(res_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        ro = round_to(s.to(tl.float32) + r, s.dtype)
        tl.store(res_out_row_ptr + cols, ro, mask=mask)
        return ro.to(tl.float32)
    else:
        return s.to(tl.float32)


@triton.jit
def rms_inverse(sum_sq, H, eps):
    """``1 / sqrt(sum_sq / H + eps)`` with correctly rounded square root and divisions."""
    ms = tl.math.div_rn(sum_sq, H.to(tl.float32))
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))


@triton.jit
def norm_tile(v, inv, w_ptr, out_row_ptr, cols, mask, GEMMA: tl.constexpr):
    """``out = T(v * inv * w')`` for one tile; ``v`` is float32 ``residual_out`` (or ``s``)."""
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = 1.0 + w
    y = v * inv * w
    tl.store(out_row_ptr + cols, round_to(y, out_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reduce_norm_row(x_row_ptr, recv_row_ptr, slot_stride, res_row_ptr, res_out_row_ptr, w_ptr,
                    out_row_ptr, row_start, numel, H, eps, rank,
                    WORLD: tl.constexpr, BLOCK_H: tl.constexpr, NUM_TILES: tl.constexpr,
                    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
                    PRE_REDUCED: tl.constexpr = False):
    """Reduce one row over the ranks (or, with ``PRE_REDUCED``, load its sum ``s`` from
    ``recv_row_ptr``) and run the epilogue.

    Without ``NORM`` stores ``s`` to ``out``. With ``NORM`` stores ``residual_out`` (when
    ``HAS_RESIDUAL``) and ``out``. ``row_start`` is the row's first element in the flat tensor; elements
    at or beyond ``numel`` are masked (plain all-reduce of a tensor that is not a whole number of rows).
    A row wider than ``BLOCK_H`` is processed in ``NUM_TILES`` tiles: the first pass stores
    ``residual_out`` (or ``s`` into ``out``) and accumulates squares, the second re-reads and normalises.
    """
    offs = tl.arange(0, BLOCK_H)
    if NUM_TILES == 1:
        mask = (offs < H) & (row_start + offs < numel)
        s = sum_tile(x_row_ptr, recv_row_ptr, slot_stride, offs, mask, rank, WORLD, PRE_REDUCED,
                     out_row_ptr.dtype.element_ty)
        if NORM:
            v = residual_tile(s, res_row_ptr, res_out_row_ptr, offs, mask, HAS_RESIDUAL)
            inv = rms_inverse(tl.sum(v * v, axis=0), H, eps)
            norm_tile(v, inv, w_ptr, out_row_ptr, offs, mask, GEMMA)
        else:
            tl.store(out_row_ptr + offs, s, mask=mask)
    else:
        sq = tl.zeros([BLOCK_H], dtype=tl.float32)
        for t in tl.static_range(NUM_TILES):
            cols = t * BLOCK_H + offs
            mask = (cols < H) & (row_start + cols < numel)
            s = sum_tile(x_row_ptr, recv_row_ptr, slot_stride, cols, mask, rank, WORLD, PRE_REDUCED,
                         out_row_ptr.dtype.element_ty)
            if NORM:
                if HAS_RESIDUAL:
                    v = residual_tile(s, res_row_ptr, res_out_row_ptr, cols, mask, HAS_RESIDUAL)
                else:
                    tl.store(out_row_ptr + cols, s, mask=mask)
                    v = s.to(tl.float32)
                sq += v * v
            else:
                tl.store(out_row_ptr + cols, s, mask=mask)
        if NORM:
            inv = rms_inverse(tl.sum(sq, axis=0), H, eps)
            tl.debug_barrier()
            for t in tl.static_range(NUM_TILES):
                cols = t * BLOCK_H + offs
                mask = cols < H
                if HAS_RESIDUAL:
                    v = tl.load(res_out_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                else:
                    v = tl.load(out_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                tl.debug_barrier()
                norm_tile(v, inv, w_ptr, out_row_ptr, cols, mask, GEMMA)
