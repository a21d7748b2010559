"""The custom ops of the MoE finalize, alone and fused with the all-reduce, the residual add and the
RMSNorm, and their wrappers (registered when :mod:`tpcomm.ops` is imported; conventions there: the
handle, fake implementations, :func:`tpcomm.capture.before_call`)::

    torch.ops.tpcomm.moe_finalize(expert_out, topk_weights, index?, shared_out?, scaling) -> Tensor
    torch.ops.tpcomm.fused_moe_finalize_add_rmsnorm(handle, expert_out, topk_weights, index?, shared_out?,
                                                   scaling, residual?, weight, eps, gemma, quant?, fp8_dtype,
                                                   group_size, column_major_scales, emit_unquantized, scale?,
                                                   swizzled_scales) -> Tensor[]
        # as fused_add_rmsnorm / fused_add_rmsnorm_fp8: [out] + [residual_out] without quant;
        # [q, scales] + [residual_out] + [out with emit_unquantized] with one (no scales for fp8_static)

Every output is a new tensor (no ``out=`` forms). In a model::

    import tpcomm.ops as tops
    out, residual = tops.fused_moe_finalize_add_rmsnorm(comm, expert_out, topk_weights, residual, weight,
                                                        index=index, eps=1e-6)
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import capture
from ..quant import DEFAULT_GROUP_SIZE
from .registry import handle_of, lookup, scale_sig, signature


@torch.library.custom_op("tpcomm::moe_finalize", mutates_args=(),
                         schema="(Tensor expert_out, Tensor topk_weights, Tensor? index, Tensor? shared_out, "
                                "float scaling) -> Tensor")
def _moe_finalize_op(expert_out, topk_weights, index, shared_out, scaling):
    from ..collectives.moe_finalize import moe_finalize as run

    return run(expert_out, topk_weights, index=index, shared_out=shared_out, scaling=scaling)


@_moe_finalize_op.register_fake
def _(expert_out, topk_weights, index, shared_out, scaling):
    return torch.empty((topk_weights.shape[0], expert_out.shape[-1]), dtype=expert_out.dtype,
                       device=expert_out.device)


@torch.library.custom_op("tpcomm::fused_moe_finalize_add_rmsnorm", mutates_args=(),
                         schema="(int handle, Tensor expert_out, Tensor topk_weights, Tensor? index, "
                                "Tensor? shared_out, float scaling, Tensor? residual, Tensor weight, float eps, "
                                "bool gemma, str? quant, ScalarType fp8_dtype, int group_size, "
                                "bool column_major_scales, bool emit_unquantized, Tensor? scale, "
                                "bool swizzled_scales) -> Tensor[]")
def _fused_op(handle, expert_out, topk_weights, index, shared_out, scaling, residual, weight, eps, gemma, quant,
              fp8_dtype, group_size, column_major_scales, emit_unquantized, scale, swizzled_scales):
    comm = lookup(handle)
    capture.before_call(comm, signature(f"fused_moe_finalize_add_rmsnorm(gemma={gemma}, quant={quant}, "
                                        f"fp8={fp8_dtype}, group={group_size}, column_major={column_major_scales}, "
                                        f"swizzled={swizzled_scales}, unquantized={emit_unquantized})",
                                        expert_out, topk_weights, index, shared_out, residual, weight)
                       + (scale_sig(scale),))
    kw = {} if quant is None else dict(fp8_dtype=fp8_dtype, group_size=group_size, scale=scale,
                                       column_major_scales=column_major_scales, emit_unquantized=emit_unquantized,
                                       swizzled_scales=swizzled_scales)
    outs = comm.fused_moe_finalize_add_rmsnorm(expert_out, topk_weights, residual, weight, eps, index=index,
                                               shared_out=shared_out, scaling=scaling, gemma=gemma, quant=quant,
                                               **kw)
    if quant == "fp8_static":
        outs = (outs[0], None) + tuple(outs[2:])  # the input scale itself: the wrapper returns it
    return [t for t in outs if t is not None]


@_fused_op.register_fake
def _(handle, expert_out, topk_weights, index, shared_out, scaling, residual, weight, eps, gemma, quant, fp8_dtype,
      group_size, column_major_scales, emit_unquantized, scale, swizzled_scales):
    from ..quant import fp8_outputs

    spec = torch.empty((topk_weights.shape[0], expert_out.shape[-1]), dtype=expert_out.dtype,
                       device=expert_out.device)
    extra = [torch.empty_like(spec)] if residual is not None else []
    if quant is None:
        return [torch.empty_like(spec)] + extra
    outs = fp8_outputs("fused_moe_finalize_add_rmsnorm", spec, quant, fp8_dtype, group_size, column_major_scales,
                       scale=scale, swizzled_scales=swizzled_scales)
    if emit_unquantized:
        extra.append(torch.empty_like(spec))
    return [outs.q_fp8] + ([] if quant == "fp8_static" else [outs.scales_view]) + extra


def moe_finalize(expert_out: torch.Tensor, topk_weights: torch.Tensor, *, index: torch.Tensor | None = None,
                 shared_out: torch.Tensor | None = None, scaling: float = 1.0) -> torch.Tensor:
    """:func:`tpcomm.moe_finalize` through the op ``tpcomm::moe_finalize`` (a new ``(T, H)`` tensor)."""
    return torch.ops.tpcomm.moe_finalize(expert_out, topk_weights, index, shared_out, float(scaling))


def fused_moe_finalize_add_rmsnorm(comm, expert_out: torch.Tensor, topk_weights: torch.Tensor,
                                   residual: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6, *,
                                   index: torch.Tensor | None = None, shared_out: torch.Tensor | None = None,
                                   scaling: float = 1.0, gemma: bool = False, quant: Optional[str] = None,
                                   fp8_dtype: torch.dtype = torch.float8_e4m3fn, group_size: int = DEFAULT_GROUP_SIZE,
                                   column_major_scales: bool = False, emit_unquantized: bool = False,
                                   scale: torch.Tensor | None = None, swizzled_scales: bool = False):
    """``comm.fused_moe_finalize_add_rmsnorm(...)`` through the op ``tpcomm::fused_moe_finalize_add_rmsnorm``:
    the same arguments (no given outputs) and returns, as a tuple: ``(out, residual_out)``, or ``(q, scales,
    residual_out, out)`` with ``quant`` (None where the method returns None; ``scales`` is ``scale`` itself
    for ``fp8_static``).

    Raises:
        TypeError, ValueError, PeerTimeoutError: as :meth:`tpcomm.Communicator.fused_moe_finalize_add_rmsnorm`.
        LookupError: an unknown handle.
    """
    outs = list(torch.ops.tpcomm.fused_moe_finalize_add_rmsnorm(
        handle_of(comm), expert_out, topk_weights, index, shared_out, float(scaling), residual, weight, eps, gemma,
        quant, fp8_dtype, group_size, column_major_scales, emit_unquantized, scale, swizzled_scales))
    if quant is None:
        return outs[0], (outs[1] if residual is not None else None)
    q = outs.pop(0)
    scales = scale if quant == "fp8_static" else outs.pop(0)
    residual_out = outs.pop(0) if residual is not None else None
    return q, scales, residual_out, (outs.pop(0) if emit_unquantized else None)
