"""MoE finalize: the routing-weighted sum of a token's expert outputs, as a device function and a kernel.

Problem: under tensor parallelism each rank holds, for every token ``t`` and each of its ``K`` routed
experts, its partial output row ``e[t, k]`` (``H`` elements). The layer's result needs
``x[t] = scaling * sum_k w[t, k] * e[t, k] + shared[t]`` on every rank, then the sum over the ranks.

Algorithm: :func:`finalize_tile` computes one tile of ``x[t]`` (docs/numerics.md, "MoE finalize"):
``acc = +0.0``; for ``k = 0 .. K - 1`` in slot order ``acc = acc + f32(f32(w[t, k]) * f32(e[t, k]))``;
``acc = acc * f32(scaling)``; ``acc = acc + f32(shared[t])`` when given; ``x = T(acc)``. Every product
and sum is rounded to float32 on its own: the launchers turn off FMA contraction
(``enable_fp_fusion=False``), Triton's interpreter (NumPy) and torch never contract, so the standalone
kernel here, the fused prologue of the one-shot and Lamport kernels (which call this same function)
and a plain-torch evaluation in that order give the same bits. ``e[t, k]`` is row ``t * K + k`` of a
``(T * K, H)`` tensor (token order), or row ``index[t, k]`` of a ``(M, H)`` tensor (the experts'
permuted order, TensorRT-LLM's ``expanded_idx_to_permuted_idx``); an index outside ``[0, M)`` is masked:
the slot adds nothing and no memory outside the tensor is read (the host checks indices of CPU
tensors and raises instead).

Sync protocol: none (a local op); the fused kernels call :func:`finalize_tile` where they would load
this rank's row of ``x``.

When it wins: always, against computing ``x`` in torch (one read of each expert row, one write of
``x``); the fused kernels also skip that write and the read of ``x`` (``benchmarks/moe_loopback.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .epilogue import round_to
from .launch import KernelCall
from .quant import widen


@triton.jit
def finalize_tile(e_ptr, idx_ptr, tw_ptr, sh_ptr, token, row_ok, K, n_expert_rows, scaling, H, cols, mask,
                  INDEXED: tl.constexpr, HAS_SHARED: tl.constexpr, DTYPE: tl.constexpr):
    """One tile (columns ``cols``, lanes ``mask``) of the finalized row of ``token``, rounded to ``DTYPE``
    (module docstring for the order of operations). ``row_ok``: the token exists (a scalar; where it
    does not, nothing is read and the tile is +0.0). ``K``: slots per token; ``n_expert_rows``: rows of
    ``e_ptr`` (``M``, used with ``INDEXED`` only); ``scaling``: float32."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    t64 = tl.full([], 0, tl.int64) + token  # token may be a Python int under the interpreter
    live = mask & ((cols * 0 + tl.where(row_ok, 1, 0)) != 0)  # a block: the interpreter's masks are blocks
    for k in range(K):
        w = widen(tl.load(tw_ptr + t64 * K + k, mask=row_ok, other=0.0))
        if INDEXED:
            r = tl.load(idx_ptr + t64 * K + k, mask=row_ok, other=0).to(tl.int64)
            inside = (r >= 0) & (r < n_expert_rows)
            use = live & ((cols * 0 + tl.where(inside, 1, 0)) != 0)
            r = tl.where(inside, r, 0)
        else:
            r = t64 * K + k
            use = live
        e = widen(tl.load(e_ptr + r * H + cols, mask=use, other=0.0))
        acc += tl.where(use, w * e, 0.0)  # +0.0 where masked: acc is never -0.0, so it is unchanged
    acc = acc * scaling
    if HAS_SHARED:
        acc += widen(tl.load(sh_ptr + t64 * H + cols, mask=live, other=0.0))
    return round_to(acc, DTYPE)


@triton.jit
def _moe_finalize_kernel(e_ptr, idx_ptr, tw_ptr, sh_ptr, out_ptr, K, n_expert_rows, scaling, H,
                         INDEXED: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr,
                         NUM_TILES: tl.constexpr):
    pid = tl.program_id(0)
    token = pid // NUM_TILES
    cols = (pid % NUM_TILES) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    x = finalize_tile(e_ptr, idx_ptr, tw_ptr, sh_ptr, token, token >= 0, K, n_expert_rows, scaling, H, cols,
                      mask, INDEXED, HAS_SHARED, out_ptr.dtype.element_ty)
    tl.store(out_ptr + token.to(tl.int64) * H + cols, x, mask=mask)


@dataclass(frozen=True)
class MoeIn:
    """The finalize's inputs as the kernels take them (host side; checked and made contiguous by the
    caller).

    Attributes:
        expert_out: ``(T * K, H)`` in token order, or ``(M, H)`` permuted (with ``index``), flat-addressed.
        index: ``(T, K)`` int32 / int64 row of each slot in ``expert_out``, or None (token order).
        weights: ``(T, K)`` routing weights, float32 / bf16 / fp16.
        shared: ``(T, H)`` shared-expert output, ``expert_out``'s dtype, or None.
        K: slots per token. M: rows of ``expert_out``. scaling: the routed scaling factor (used as float32).
    """

    expert_out: object
    index: object
    weights: object
    shared: object
    K: int
    M: int
    scaling: float

    def shifted(self, row0: int) -> "MoeIn":
        """The same inputs seen from token ``row0`` (a launch of a chunk of rows)."""
        if row0 == 0:
            return self
        H = self.expert_out.shape[-1]
        e = self.expert_out if self.index is not None else self.expert_out.view(-1)[row0 * self.K * H:]
        return MoeIn(e, None if self.index is None else self.index.view(-1)[row0 * self.K:],
                     self.weights.view(-1)[row0 * self.K:],
                     None if self.shared is None else self.shared.view(-1)[row0 * H:], self.K, self.M, self.scaling)

    def fields(self) -> tuple:
        """What a launch's signature carries of the finalize: ranks that differ in any compute another sum."""
        return ("moe", self.K, self.index is not None, self.shared is not None, self.scaling,
                str(self.weights.dtype))

    def kernel_args(self) -> dict:
        """The fused kernels' finalize parameters (by name)."""
        e = self.expert_out
        return dict(e_ptr=e, idx_ptr=self.index if self.index is not None else e, tw_ptr=self.weights,
                    sh_ptr=self.shared if self.shared is not None else e, K=self.K, n_expert_rows=self.M,
                    scaling=self.scaling, FINALIZE=True, INDEXED=self.index is not None,
                    HAS_SHARED=self.shared is not None)


#: The fused kernels' finalize parameters of a launch without the prologue: None pointers and sizes are
#: constexprs that Triton drops from the compiled signature, so those launches compile as without them.
NO_FINALIZE = dict(e_ptr=None, idx_ptr=None, tw_ptr=None, sh_ptr=None, K=None, n_expert_rows=None,
                   scaling=None, FINALIZE=False, INDEXED=False, HAS_SHARED=False)


def finalize_kwargs(moe: MoeIn | None) -> dict:
    """The fused kernels' finalize parameters: ``moe``'s, or :data:`NO_FINALIZE`."""
    return NO_FINALIZE if moe is None else moe.kernel_args()


def moe_finalize_call(moe: MoeIn, out, T: int, H: int, block_h: int, num_warps: int) -> KernelCall:
    """The launch of :func:`_moe_finalize_kernel` writing ``(T, H)`` ``out``: one program per token and
    tile of ``block_h`` columns."""
    e = moe.expert_out
    num_tiles = triton.cdiv(H, block_h)
    return KernelCall(_moe_finalize_kernel, T * num_tiles, (
        e, moe.index if moe.index is not None else e, moe.weights, moe.shared if moe.shared is not None else e,
        out, moe.K, moe.M, moe.scaling, H,
    ), dict(INDEXED=moe.index is not None, HAS_SHARED=moe.shared is not None, BLOCK_H=block_h,
            NUM_TILES=num_tiles, num_warps=num_warps, enable_fp_fusion=False))
