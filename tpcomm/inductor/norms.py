"""The RMSNorm styles the fusion pass knows, each written as the models write it.

Inductor's post-grad graph holds a norm as the aten ops its source decomposes into, and two norms that
compute the same thing decompose differently (the order of the products, where the casts sit, a
positive or negative reduction dimension, eps rounded to float32 or not). So each style here is the
plain-torch source of one family of models; :mod:`tpcomm.inductor.sites` traces it into a pattern per
dtype and the pattern matcher finds the same ops in the model's graph.

Each function computes ``norm(x, weight, eps)`` over the last dimension of ``x`` (any number of leading
dimensions); what the fused kernel computes instead is contract item 3 (docs/numerics.md): the same
function, rounded otherwise (within a unit in the last place of a 16-bit output, a few of a float32 one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def hf_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's hand-written RMSNorm (``LlamaRMSNorm``; Qwen2/3, Mistral, Phi-3 and most others copy
    it): float32 statistics, the normalised row rounded to the input dtype, then the weight."""
    dtype = x.dtype
    v = x.to(torch.float32)
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return weight * v.to(dtype)


def torch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.rms_norm`` / ``torch.nn.RMSNorm`` over the last dimension, written as Inductor's graph holds it:
    the decomposition of ``aten._fused_rms_norm`` (eps added with ``add.Scalar``, a positive reduction
    dimension, ``(v * inv) * weight`` in float32, one rounding to the input dtype). Tracing
    ``torch.rms_norm`` itself would not do: on CPU tensors it decomposes through ATen's C++ fallback, whose
    in-place ``add_`` the functionalised graph of a model never holds."""
    v = x.to(torch.float32)
    inv = torch.rsqrt(torch.ops.aten.add.Scalar(v.pow(2).mean(dim=[x.dim() - 1], keepdim=True), eps))
    return v.mul(inv).mul(weight).type_as(x)


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (``Gemma3RMSNorm``; Gemma 1, 2 and 3): everything in float32 with ``1 + weight``, one
    rounding to the input dtype."""
    v = x.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return (v * (1.0 + weight.float())).type_as(x)


@dataclass(frozen=True)
class NormStyle:
    """One RMSNorm style: its name in the pass's report, its source, and whether the fused op must use
    ``1 + weight`` (``gemma=True``)."""

    name: str
    fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    gemma: bool


#: Every style the pass matches, in the order it tries them.
NORM_STYLES = (NormStyle("hf", hf_rmsnorm, False), NormStyle("torch", torch_rmsnorm, False),
               NormStyle("gemma", gemma_rmsnorm, True))
