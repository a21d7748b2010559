"""Helpers of the GPU rank bodies (``tests/*/gpu_ranks.py``): every rank's inputs from a seed, generated
on its GPU, and the summaries the ranks return instead of tensors (mismatch counts, worst ulp, digests).
Importing this module touches no GPU.
"""

from __future__ import annotations

import hashlib

import torch

from tests.support.numerics import bits, ulp_distance


def _gen(seed: int, rank: int, role: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(1_000_003 * seed + 101 * rank + role)


def gpu_inputs(seed, world_size, shape, dtype, device):
    """Every rank's ``x``, the residual and the weight of case ``seed``, generated on ``device``."""
    xs = [torch.randn(shape, generator=_gen(seed, r, 1, device), device=device).to(dtype)
          for r in range(world_size)]
    res = torch.randn(shape, generator=_gen(seed, 0, 2, device), device=device).to(dtype)
    w = (1.0 + 0.5 * torch.randn(shape[-1], generator=_gen(seed, 0, 3, device), device=device)).to(dtype)
    return xs, res, w


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(bits(t).cpu().numpy().tobytes()).hexdigest()


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ."""
    return int((bits(a) != bits(b)).sum())


def _max_ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    """Worst ulp distance; NaN on one side only counts as a huge distance."""
    nan_a, nan_b = a.isnan(), b.isnan()
    if not torch.equal(nan_a, nan_b):
        return 1 << 30
    d = ulp_distance(a, b)[~nan_a]
    return int(d.max()) if d.numel() else 0
