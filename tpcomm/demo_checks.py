"""What every part of ``tpcomm demo`` checks with (:mod:`tpcomm.demo`, :mod:`tpcomm.demo_other_ops`): a table
row, bit and ulp comparisons, comparisons across ranks, seeded inputs every rank can compute, and the eager
timing on GPUs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Row:
    """One line of the demo's table, as one rank saw it (:func:`merge_rows` combines the ranks).

    Attributes:
        op, shape, dtype, algorithm: what ran.
        error: the largest error (``error_unit``: ``"ulp"`` against the contract's result, ``"rel"``, the
            relative Frobenius error against the unsharded float32 block, or ``"bytes"``, the quantised
            bytes and scales that differ from the form's reference).
        residual_exact: ``residual_out`` (or the all-reduce) bit-exact; None where there is none.
        ranks_identical: every output bit-identical on every rank; None where the outputs differ between
            ranks by design (a reduce-scatter's shares, the QK norm's columns).
        time_us: µs per call (GPU; None on CPU).
        ok: every check of this line passed.
        note: why a check failed.
    """

    op: str
    shape: str
    dtype: str
    algorithm: str
    error: float
    error_unit: str
    residual_exact: bool | None
    ranks_identical: bool | None
    time_us: float | None
    ok: bool
    note: str = ""


# -- numerics helpers ---------------------------------------------------------------------------------

_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between ``a`` and ``b`` (same dtype and shape) in units in the last place.

    Counts the representable values between them (+0.0 and -0.0 count as one), so 0 means bit-equal up
    to the sign of zero; a NaN against a number gives a huge distance. Returns 0 for empty tensors.
    """
    if a.numel() == 0:
        return 0
    bits = torch.finfo(a.dtype).bits
    ia = a.contiguous().view(_INT_VIEW[a.dtype]).to(torch.int64)
    ib = b.contiguous().view(_INT_VIEW[b.dtype]).to(torch.int64)
    mag_mask = (1 << (bits - 1)) - 1

    def key(i):
        mag = i & mag_mask
        return torch.where(i < 0, -mag, mag)

    return int((key(ia) - key(ib)).abs().max().item())


def out_ulp_tolerance(dtype: torch.dtype, hidden: int) -> int:
    """Units in the last place ``out`` may differ from :func:`tpcomm.add_rmsnorm_reference`: 0. The
    reference sums the row's squares in the kernels' order (pairwise, :func:`tpcomm.reference.sum_of_squares`)
    and rounds every step as they do, so ``out`` is bit-exact for every dtype."""
    return 0


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` hold the same bits (NaN payloads and signs of zero included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = _INT_VIEW.get(a.dtype)
    if view is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def all_gather_flat(t: torch.Tensor, group=None) -> torch.Tensor:
    """Collective: every rank's ``t`` (same shape on all), stacked: ``(world, *t.shape)``.

    Gathers flat 1-D tensors: gloo (torch 2.13) refuses an output shaped ``(world, n)``.
    """
    flat = t.contiguous().reshape(-1)
    world = dist.get_world_size(group)
    out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13
    gather(out, flat, group=group)
    return out.view(world, *t.shape)


def same_on_all_ranks(t: torch.Tensor, group=None) -> bool:
    """Collective: True on every rank when every rank's ``t`` holds the same bits."""
    bits = t.contiguous().reshape(-1).view(torch.uint8)  # raw bytes: gloo has no int16
    gathered = all_gather_flat(bits, group)
    return all(torch.equal(g, bits) for g in gathered)


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖a − ref‖ / ‖ref‖`` (Frobenius) in float64; inf when ``a`` holds a NaN or Inf."""
    a64, r64 = a.double(), ref.double()
    if not torch.isfinite(a64).all():
        return math.inf
    return float((a64 - r64).norm() / r64.norm().clamp_min(1e-300))


# -- seeded inputs ------------------------------------------------------------------------------------

def generator(device: torch.device, *key: int) -> torch.Generator:
    """A generator on ``device`` seeded from ``key`` (the same on every rank and every run)."""
    g = torch.Generator(device=device)
    seed = 0
    for k in key:  # a fixed mix of the key, the same on every rank and every run
        seed = (seed * 1_000_003 + int(k) + 1) % (1 << 62)
    g.manual_seed(seed)
    return g


def randn(shape, dtype, device, *key: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """``randn(shape) * scale + shift`` in ``dtype`` from :func:`generator` of ``key``: every rank can make
    every rank's input."""
    t = torch.randn(shape, generator=generator(device, *key), device=device, dtype=torch.float32)
    return (t * scale + shift).to(dtype)


# -- timing (GPU) -------------------------------------------------------------------------------------

def time_eager(fn, calls: int, warmup: int) -> float:
    """µs per call of ``fn`` on this rank: CUDA events around ``calls`` calls, after ``warmup`` calls and
    a barrier (so the ranks start together). Collective when ``fn`` is."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / calls
