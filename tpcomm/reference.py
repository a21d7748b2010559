"""The unfused torch path: the fallback of every op and the oracle of the tests.

It follows the numerics contract (docs/numerics.md) exactly, in the kernels' order of operations, so the
fallback returns the same bits as the kernels, ``out`` included:

    s = T(acc), acc = +0.0 + f32(x_0) + f32(x_1) + ... + f32(x_{W-1})   (rank order)
    residual_out = T(f32(s) + f32(residual))
    out = T((v * inv) * w'),  inv = 1 / sqrt(ss / H + eps),  v = f32(residual_out),  w' = f32(w) or 1 + f32(w)
          (16-bit outputs with 0 < inv <= FLT_MAX: T((v * w') * inv), within one ulp of it)

where ``ss`` is the sum of ``v^2`` in the kernels' fixed order (:func:`sum_of_squares`) and every step is
rounded to float32.

``torch.distributed.all_reduce`` alone cannot meet the first line: NCCL's summation order and precision
are unspecified (bf16 rings accumulate in bf16). So the collective fallback gathers every rank's input
(``all_gather_into_tensor``) and sums in float32 in rank order on each rank. Integer dtypes, whose sums
are exact in any order, use ``torch.distributed.all_reduce`` directly.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .quant.reference import (  # noqa: F401  (re-exported: tpcomm.reference names every oracle)
    mxfp4_dequant_reference,
    mxfp4_quant_reference,
    nvfp4_dequant_reference,
    nvfp4_global_scale,
    nvfp4_quant_reference,
    nvfp4_quant_unchecked,
    pack_ue8m0_scales,
    per_group_quant_reference,
    per_group_ue8m0_quant_reference,
    per_token_quant_reference,
    quant_form_reference,
    static_fp8_bytes,
    static_fp8_quant_reference,
    swizzle_128x4,
    unswizzle_128x4,
)

# torch 2.13 renamed all_gather_into_tensor (deprecated there); 2.11 has only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_in_rank_order(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``T(+0.0 + f32(xs[0]) + ... + f32(xs[-1]))``: the contract's sum of the ranks' inputs.

    Args:
        xs: one tensor per rank, in rank order, equal shapes and dtype ``T`` (float).
    Returns:
        A new tensor of that shape and dtype.
    """
    acc = torch.zeros(xs[0].shape, dtype=torch.float32, device=xs[0].device)
    for x in xs:
        acc = acc + x.to(torch.float32)
    return acc.to(xs[0].dtype)


def sum_of_squares(v: torch.Tensor) -> torch.Tensor:
    """The kernels' sum of squares of float32 rows ``v`` ``(..., H)``, bit for bit: rows are cut into
    ``num_tiles`` tiles of ``block_h`` lanes (:func:`tpcomm.dispatch.row_config`, zero-padded); lane ``i``
    accumulates ``v[t * block_h + i]**2`` over the tiles in order, from +0.0; the lanes are then added by
    pairs, ``((l0 + l1) + (l2 + l3)) + ...`` (``epilogue.tree_sum``). Returns ``(..., 1)`` float32."""
    from .dispatch import row_config

    H = v.shape[-1]
    cfg = row_config(H, 1)
    lanes = cfg.block_h
    padded = torch.nn.functional.pad(v, (0, cfg.num_tiles * lanes - H))
    tiles = padded.reshape(*v.shape[:-1], cfg.num_tiles, lanes)
    acc = torch.zeros((*v.shape[:-1], lanes), dtype=torch.float32, device=v.device)
    for t in range(cfg.num_tiles):
        sq = tiles[..., t, :]
        acc = acc + sq * sq
    return pairwise_sum(acc)


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """``epilogue.tree_sum`` over the last dimension of ``x`` (a power of two long):
    ``((x0 + x1) + (x2 + x3)) + ...``. Returns ``(..., 1)``."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x


def add_rmsnorm_reference(s: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                          eps: float, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Residual add + RMSNorm of an already reduced ``s`` (contract steps 2 and 3), with the kernels'
    order of operations, so the bits equal theirs: the sum of squares as :func:`sum_of_squares` adds
    them, ``inv = 1 / sqrt(sum / H + eps)`` with correctly rounded division and square root, each step
    rounded to float32, ``out = T((v * inv) * w')``, or ``T((v * w') * inv)`` for 16-bit outputs with a
    finite non-zero ``inv`` (the kernels' order: ``kernels/epilogue.py:weight_first``).

    Args:
        s: ``(T, H)`` reduced input, dtype bf16/fp16/fp32.
        residual: ``(T, H)``, dtype of ``s``, or None (then ``s`` itself is normalised).
        weight: ``(H,)`` any float dtype; ``1 + w`` when ``gemma``.
        eps: added to the mean square.
    Returns:
        ``(out, residual_out)``; ``residual_out`` is None without a residual.
    """
    if residual is not None:
        residual_out = (s.to(torch.float32) + residual.to(torch.float32)).to(s.dtype)
        v = residual_out.to(torch.float32)
    else:
        residual_out = None
        v = s.to(torch.float32)
    w = weight.to(torch.float32)
    if gemma:
        w = 1.0 + w
    if v.shape[-1] == 0:  # rows of no elements: nothing to normalise
        return torch.empty_like(s), residual_out
    ss = sum_of_squares(v)
    # Each step rounded to float32 as in the kernels; division and square root are taken in float64 and
    # rounded once, which is the correctly rounded float32 result (53 >= 2 * 24 + 2 bits), on every
    # device: torch's float32 sqrt on an AVX-512 CPU is not correctly rounded (off by an ulp), and on CUDA
    # a division by a Python scalar is a multiplication by its reciprocal.
    ms = (ss.double() / float(v.shape[-1])).float()
    rt = torch.sqrt((ms + torch.full_like(ms, eps)).double()).float()
    inv = (1.0 / rt.double()).float()
    # the kernels' order (kernels/epilogue.py:weight_first): the weight first for 16-bit outputs with a
    # finite non-zero inv, the written order (v * inv) * w' otherwise
    first = (inv > 0) & (inv <= torch.finfo(torch.float32).max) if s.dtype in (torch.bfloat16, torch.float16) \
        else torch.zeros_like(inv, dtype=torch.bool)
    out = torch.where(first, (v * w) * inv, (v * inv) * w).to(s.dtype)
    return out, residual_out


#: dtypes whose sum gloo and NCCL both have (the fallback's all-reduce hands them to the backend).
_BACKEND_SUMS = (torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64)


def all_reduce_reference(x: torch.Tensor, group=None) -> torch.Tensor:
    """Contract-exact all-reduce through ``torch.distributed`` (the fallback).

    Collective: every rank of ``group`` calls it with the same shape and dtype. Float inputs are
    gathered and summed in rank order in float32; int8, uint8, int32, int64, bool and complex go through
    ``dist.all_reduce``; other integers (gloo and NCCL have no int16, uint16, uint32 or uint64) are
    gathered as bytes and summed in int64, wrapping like a native sum (the same bits as the kernel path,
    ``tpcomm.collectives.all_gather.integer_sum``).
    Returns a new tensor shaped like ``x``.
    """
    if x.dtype in _BACKEND_SUMS or x.is_complex():
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y
    if not x.is_floating_point():
        world = dist.get_world_size(group)
        g = all_gather_reference(x.reshape(1, -1), group)
        return g.view(world, -1).to(torch.int64).sum(0).to(x.dtype).view(x.shape)
    world = dist.get_world_size(group)
    flat = x.contiguous().reshape(-1)
    gathered = torch.empty(world * flat.numel(), dtype=x.dtype, device=x.device)
    _all_gather_flat(gathered, flat, group=group)
    return reduce_in_rank_order(list(gathered.view(world, -1).unbind(0))).reshape(x.shape)


def fused_add_rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                                eps: float, gemma: bool = False, group=None):
    """``add_rmsnorm_reference(all_reduce_reference(x), residual, weight, eps, gemma)``: the unfused
    path. Collective. Returns ``(out, residual_out)``."""
    return add_rmsnorm_reference(all_reduce_reference(x, group), residual, weight, eps, gemma)


def share_bounds(n_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s share of ``n_rows`` rows, as ``torch.tensor_split`` cuts
    them: the first ``n_rows % world_size`` shares have one row more (shares may be empty)."""
    base, extra = divmod(n_rows, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def all_gather_reference(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0 in rank order (``(W * T, ...)``), through
    ``torch.distributed`` (the fallback). Collective: every rank passes the same shape and dtype. The
    bytes move as uint8, so every dtype works (gloo has no FP8, int16, uint16, uint32 or uint64)."""
    world = dist.get_world_size(group)
    flat = x.contiguous().reshape(-1).view(torch.uint8)
    gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=x.device)
    _all_gather_flat(gathered, flat, group=group)
    return gathered.view(x.dtype).view(world * x.shape[0], *x.shape[1:])


def reduce_scatter_reference(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's share (:func:`share_bounds`) of the rank-order sum of every rank's ``x`` along dim 0,
    through ``torch.distributed`` (the fallback): :func:`all_reduce_reference`, then this rank's rows.
    Collective."""
    start, length = share_bounds(x.shape[0], dist.get_world_size(group), dist.get_rank(group))
    return all_reduce_reference(x, group)[start:start + length].clone()


# -- the full-width QK norm (tpcomm.collectives.qk_norm): the fallback's arithmetic and the tests' oracle
def qk_partial_sums_reference(q, k):
    """This rank's sums of squares of each row of ``q`` ``(T, Hq)`` and ``k`` ``(T, Hk)`` (bf16, fp16 or
    fp32), in the kernel's order (:func:`sum_of_squares`): float32 ``(T, 2)``, column 0 for ``q``, 1 for
    ``k``; +0.0 for a tensor of no columns."""
    return torch.cat([_row_sums_of_squares(q), _row_sums_of_squares(k)], dim=1)


def _row_sums_of_squares(x):
    """:func:`sum_of_squares` of ``f32(x)`` ``(T, H)``, ``(T, 1)``; +0.0 where ``H = 0``."""
    return sum_of_squares(x.to(torch.float32)) if x.shape[1] else x.new_zeros((x.shape[0], 1), dtype=torch.float32)


def rms_norm_from_total_reference(x, weight, total, width: int, eps: float):
    """``x`` ``(T, H)`` normalised with the full-width sum of squares ``total`` ``(T, 1)`` float32 over
    ``width`` columns, the kernel's operations and order: ``inv = 1 / sqrt(total / width + eps)``, each
    step correctly rounded to float32; ``out = T((v * inv) * w')``, or ``T((v * w') * inv)`` for 16-bit
    outputs with ``0 < inv <= FLT_MAX`` (``epilogue.weight_first``). Returns a new ``(T, H)`` tensor of
    ``x``'s dtype."""
    v, w = x.to(torch.float32), weight.to(torch.float32)
    # division and square root in float64, rounded once: the correctly rounded float32 results (as
    # add_rmsnorm_reference, which says why)
    ms = (total.double() / float(width)).float()
    rt = torch.sqrt((ms + torch.full_like(ms, eps)).double()).float()
    inv = (1.0 / rt.double()).float()
    if x.dtype in (torch.bfloat16, torch.float16):
        first = (inv > 0) & (inv <= torch.finfo(torch.float32).max)
        return torch.where(first, (v * w) * inv, (v * inv) * w).to(x.dtype)
    return ((v * inv) * w).to(x.dtype)


def fused_qk_rmsnorm_reference(qs, ks, q_weights, k_weights, eps: float = 1e-6, *, kv_replicas: int = 1):
    """The full-width QK norm's outputs of every rank, in plain torch, from every rank's inputs: ``qs`` /
    ``ks`` the ranks' ``(T, Hq)`` / ``(T, Hk)`` columns and ``q_weights`` / ``k_weights`` their weight
    slices, lists in rank order. The contract (docs/numerics.md, "Full-width QK norm"): the partial
    sums (:func:`qk_partial_sums_reference`) summed in rank order in float32 from +0.0
    (:func:`reduce_in_rank_order`), then each rank's columns normalised over the full widths
    (:func:`rms_norm_from_total_reference`). ``kv_replicas`` ``R`` (dividing ``len(qs)``): ranks
    ``g * R .. g * R + R - 1`` hold the same ``k`` columns; the k total is the rank-order sum over the
    distinct shards ``ks[0], ks[R], ks[2R], ...`` alone, over ``len(qs) / R * Hk`` columns. Returns
    ``[(q_out, k_out)]`` per rank."""
    W = len(qs)
    if kv_replicas < 1 or W % kv_replicas:
        raise ValueError(f"fused_qk_rmsnorm_reference: kv_replicas must divide the {W} ranks, got {kv_replicas}")
    total_q = reduce_in_rank_order([_row_sums_of_squares(q) for q in qs])
    total_k = reduce_in_rank_order([_row_sums_of_squares(k) for k in ks[::kv_replicas]])
    return [(rms_norm_from_total_reference(q, wq, total_q, W * q.shape[1], eps),
             rms_norm_from_total_reference(k, wk, total_k, W // kv_replicas * k.shape[1], eps))
            for q, k, wq, wk in zip(qs, ks, q_weights, k_weights)]
