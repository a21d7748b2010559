"""The unfused epilogue a user would write in torch after an all-reduce, shared by every contender that
has no fused kernel (NCCL, symm_mem, FlashInfer's vLLM all-reduce), plus the reference row that times it
alone (no communication).

    residual_out = s + residual
    out = torch.nn.functional.rms_norm(residual_out, (H,), weight, eps)
    q, scale = per-token FP8 of out:  amax = |out|.amax(-1);  scale = max(amax / 448, tiny);
               q = (out / scale).clamp(-448, 448).to(float8_e4m3fn)          (fused_fp8 only)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Bound, Contender, NotApplicable

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def add_rmsnorm(s, residual, weight, eps):
    """``(out, residual_out)`` of the torch epilogue above; ``s`` and ``residual`` ``(T, H)``."""
    r = s + residual
    return F.rms_norm(r, (r.shape[-1],), weight, eps), r


def per_token_fp8(out):
    """``(q, scale)``: ``q`` ``(T, H)`` float8_e4m3fn, ``scale`` ``(T, 1)`` float32, as above."""
    v = out.float()
    scale = (v.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (v / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def epilogue(op: str, s, residual, weight, eps):
    """The torch epilogue of ``op`` applied to an all-reduced ``s``, as ``outputs`` names it."""
    if op == "all_reduce":
        return {"sum": s}
    out, r = add_rmsnorm(s, residual, weight, eps)
    if op == "fused":
        return {"out": out, "residual_out": r}
    q, scale = per_token_fp8(out)
    return {"q": q, "scale": scale, "residual_out": r}


class TorchAddRMSNorm(Contender):
    """``r = x + residual; rms_norm(r)`` (and the FP8 quant for ``fused_fp8``) on this rank's input, no
    communication: what the unfused layer spends besides the all-reduce."""

    name = "torch_epilogue"
    label = "torch epilogue alone (no comm)"
    library = "torch"
    ops = ("fused", "fused_fp8")
    reference = True

    def bind(self, case, slots, ctx) -> Bound:
        if case.op not in self.ops:
            raise NotApplicable(f"{case.op} has no epilogue")
        x, res, w = slots.x, slots.residual, slots.weight
        return Bound(call=lambda k: epilogue(case.op, x[k], res, w, case.eps), outputs=lambda r: r)

    def expected(self, case, inputs):
        from ...reference import add_rmsnorm_reference, per_token_quant_reference
        from ..checks import FP8_DTYPE

        out, res = add_rmsnorm_reference(inputs.xs[case.rank], inputs.residual, inputs.weight, case.eps)
        if case.op == "fused":
            return {"out": out, "residual_out": res}
        q, scale = per_token_quant_reference(out, FP8_DTYPE)
        return {"q": q, "scale": scale, "residual_out": res}
