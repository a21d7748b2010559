"""tpcomm itself, checked against the numerics contract bit for bit.

    fused            comm.fused_add_rmsnorm(x, residual, weight, eps)            -> (out, residual_out)
    fused_fp8        comm.fused_add_rmsnorm(x, residual, weight, eps, quant="fp8_per_token")  (issue 4)
    all_reduce       comm.all_reduce(x)
    all_gather       comm.all_gather(x, dim=0)        x (T/W, H) -> (T, H)
    reduce_scatter   comm.reduce_scatter(x, dim=0)    x (T, H) -> this rank's (T/W, H) share

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
    """Whether this tpcomm's ``fused_add_rmsnorm`` takes ``quant=`` (issue 4)."""
    try:
        return "quant" in inspect.signature(comm.fused_add_rmsnorm).parameters
    except (TypeError, ValueError):
        return False


def fp8_outputs(result, dtype: torch.dtype) -> dict:
    """Names the tensors of the FP8 fused call's result: the float8 tensor is ``q``, the float32 one
    ``scale``, and of the tensors in the input dtype the last is ``residual_out`` (a result of
    ``(q, scale, residual_out)`` or ``(q, scale, out, residual_out)``). A result object with attributes of
    those names is read directly."""
    if all(hasattr(result, a) for a in ("q", "scale", "residual_out")):
        return {"q": result.q, "scale": result.scale, "residual_out": result.residual_out}
    tensors = [t for t in result if isinstance(t, torch.Tensor)]
    named = {}
    for t in tensors:
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            named["q"] = t
        elif t.dtype == torch.float32 and dtype != torch.float32:
            named["scale"] = t
        elif t.dtype == dtype:
            named["residual_out"] = t
    return named


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
            raise NotApplicable("this tpcomm's fused_add_rmsnorm has no quant= (issue 4)")
        note = algorithm(comm, case)
        if op == "fused":
            return Bound(call=lambda k: comm.fused_add_rmsnorm(x[k], res, w, eps),
                         outputs=lambda r: {"out": r[0], "residual_out": r[1]}, note=note)
        if op == "fused_fp8":
            return Bound(call=lambda k: comm.fused_add_rmsnorm(x[k], res, w, eps, quant=FP8_QUANT),
                         outputs=lambda r: fp8_outputs(r, case.dtype), note=note)
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
