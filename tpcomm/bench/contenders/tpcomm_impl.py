"""tpcomm itself, checked against the numerics contract bit for bit.

    fused            comm.fused_add_rmsnorm(x, residual, weight, eps)            -> (out, residual_out)
    fused_fp8        comm.fused_add_rmsnorm(x, residual, weight, eps, quant="fp8_per_token")
    all_reduce       comm.all_reduce(x)
    all_gather       comm.all_gather(x, dim=0)        x (T/W, H) -> (T, H)
    reduce_scatter   comm.reduce_scatter(x, dim=0)    x (T, H) -> this rank's (T/W, H) share

``tpcomm_unfused`` (fused_fp8 only) is the fused FP8 output's baseline: the bf16 fused call, then the standalone
per-token quant kernel on its ``out`` (``tpcomm.per_token_quant_fp8``): the same bytes as the fused FP8
call, in two launches.

An op this tpcomm does not have yet (an older checkout) is reported as not applicable, not as a failure.
"""

from __future__ import annotations

import inspect

import torch

from .base import Bound, Contender, NotApplicable

_METHOD = {"fused": "fused_add_rmsnorm", "fused_fp8": "fused_add_rmsnorm", "all_reduce": "all_reduce",
           "all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}
FP8_QUANT = "fp8_per_token"


def has_fp8_quant(comm) -> bool:
    """Whether this tpcomm's ``fused_add_rmsnorm`` takes ``quant=`` (the fused FP8 output)."""
    try:
        return "quant" in inspect.signature(comm.fused_add_rmsnorm).parameters
    except (TypeError, ValueError):
        return False


def fp8_outputs(result) -> dict:
    """Names the result of ``fused_add_rmsnorm(..., quant="fp8_per_token")``: ``(q, scales, residual_out,
    out)`` (``out`` None without ``emit_unquantized``)."""
    q, scales, residual_out = result[0], result[1], result[2]
    return {"q": q, "scale": scales, "residual_out": residual_out}


class Tpcomm(Contender):
    name = "tpcomm"
    label = "tpcomm"
    library = "tpcomm"
    ops = ("fused", "fused_fp8", "all_reduce", "all_gather", "reduce_scatter")
    exact = True

    def bind(self, case, slots, ctx) -> Bound:
        comm, op, x, res, w, eps = ctx.comm, case.op, slots.x, slots.residual, slots.weight, case.eps
        if not hasattr(comm, _METHOD[op]):
            raise NotApplicable(f"this tpcomm has no {_METHOD[op]}")
        if op == "fused_fp8" and not has_fp8_quant(comm):
            raise NotApplicable("this tpcomm's fused_add_rmsnorm has no quant= (no fused FP8 output)")
        note = algorithm(comm, case)
        if op == "fused":
            return Bound(call=lambda k: comm.fused_add_rmsnorm(x[k], res, w, eps),
                         outputs=lambda r: {"out": r[0], "residual_out": r[1]}, note=note)
        if op == "fused_fp8":
            return Bound(call=lambda k: comm.fused_add_rmsnorm(x[k], res, w, eps, quant=FP8_QUANT),
                         outputs=fp8_outputs, note=note)
        if op == "all_reduce":
            return Bound(call=lambda k: comm.all_reduce(x[k]), outputs=lambda r: {"sum": r}, note=note)
        if op == "all_gather":
            return Bound(call=lambda k: comm.all_gather(x[k], dim=0), outputs=lambda r: {"gathered": r},
                         note=note)
        return Bound(call=lambda k: comm.reduce_scatter(x[k], dim=0), outputs=lambda r: {"share": r},
                     note=note)


def algorithm(comm, case) -> str:
    """The algorithm tpcomm's dispatch picks for ``case`` (shown beside its times), or ``""``."""
    op = {"fused": "fused_add_rmsnorm", "fused_fp8": "fused_add_rmsnorm"}.get(case.op, case.op)
    nbytes = case.input_rows * case.H * torch.empty((), dtype=case.dtype).element_size()
    try:
        return comm.plan(op, nbytes, case.H, case.dtype).algorithm
    except Exception:  # an op the dispatch of this checkout does not know
        return ""


class TpcommUnfused(Contender):
    """``fused_fp8`` as the bf16 fused call followed by the standalone quant (what fusing the quant
    saves)."""

    name = "tpcomm_unfused"
    label = "tpcomm fused + quant kernel"
    library = "tpcomm"
    ops = ("fused_fp8",)
    exact = True

    def bind(self, case, slots, ctx) -> Bound:
        comm, x, res, w, eps = ctx.comm, slots.x, slots.residual, slots.weight, case.eps
        if not has_fp8_quant(comm):
            raise NotApplicable("this tpcomm's fused_add_rmsnorm has no quant= (no fused FP8 output)")
        from ...quant import per_token_quant_fp8

        def call(k):
            out, residual_out = comm.fused_add_rmsnorm(x[k], res, w, eps)
            q, scales = per_token_quant_fp8(out.view(-1, out.shape[-1]))
            return q.view(out.shape), scales, residual_out

        return Bound(call=call, outputs=fp8_outputs, note=algorithm(comm, case))
