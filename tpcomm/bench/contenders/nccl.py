"""NCCL through ``torch.distributed`` (the default a user has), with the torch epilogue for fused ops.

    all_reduce       dist.all_reduce(x)                                   (in place)
    fused(_fp8)      dist.all_reduce(x); torch epilogue (torch_epilogue.py)
    all_gather       dist.all_gather_into_tensor(out, x)                  x (T/W, H) -> out (T, H)
    reduce_scatter   dist.reduce_scatter_tensor(out, x)                   x (T, H) -> out (T/W, H)
"""

from __future__ import annotations

import torch.distributed as dist

from .base import Bound, Contender, NotApplicable, new_outputs, poison
from .torch_epilogue import epilogue

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names are deprecated there);
# torch 2.11 has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Nccl(Contender):
    name = "nccl"
    label = "NCCL"
    library = "NCCL"
    ops = ("fused", "fused_fp8", "all_reduce", "all_gather", "reduce_scatter")

    def bind(self, case, slots, ctx) -> Bound:
        op, x, res, w, K = case.op, slots.x, slots.residual, slots.weight, len(slots.x)
        if op in ("all_reduce", "fused", "fused_fp8"):
            def call(k):
                dist.all_reduce(x[k])
                return epilogue(op, x[k], res, w, case.eps)
            return Bound(call=call, outputs=lambda r: r)
        if op == "all_gather":
            outs = new_outputs(K, (case.T, case.H), case.dtype, case.device)

            def gather(k):
                _all_gather(outs[k], x[k])
                return outs[k]
            return Bound(call=gather, outputs=lambda r: {"gathered": r}, poison=lambda: poison(outs), keep=outs)
        if op == "reduce_scatter":
            outs = new_outputs(K, (case.share[1], case.H), case.dtype, case.device)

            def scatter(k):
                _reduce_scatter(outs[k], x[k])
                return outs[k]
            return Bound(call=scatter, outputs=lambda r: {"share": r}, poison=lambda: poison(outs), keep=outs)
        raise NotApplicable(f"NCCL has no {op}")
