"""Inputs, expected results and the correctness check that every contender passes before it is timed.

Every rank's input comes from a seed that every rank knows, so each rank computes the expected result of
every op itself, from all ranks' inputs, with :mod:`tpcomm.reference` (the numerics contract,
docs/numerics.md). Each contender is checked on fresh inputs of its own (another seed), with its outputs
poisoned (NaN) where it lets the caller pass them.

Two strictnesses:

* ``exact`` (tpcomm: the contract): all-reduce, ``residual_out``, all-gather and reduce-scatter bit for
  bit; ``out`` within :func:`tpcomm.demo_checks.out_ulp_tolerance` units in the last place; FP8 as below.
* ``close`` (other libraries, whose summation order and precision are their own): the relative error
  ``||y - ref|| / ||ref||`` (float64) within :data:`REL_TOL` of the dtype; an all-gather moves bits, so it
  is exact for everyone. NaN never passes.

FP8 outputs are compared dequantised (``q * scale`` against the reference's), within
:data:`FP8_REL_TOL`, and the scales within the input dtype's :data:`REL_TOL`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..demo_checks import bit_equal, out_ulp_tolerance, ulp_distance
from ..reference import add_rmsnorm_reference, per_token_quant_reference, reduce_in_rank_order

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: Relative L2 error allowed for a library other than tpcomm. One rounding to bf16 / fp16 gives about
#: 1e-3 / 1.5e-4 (2**-8 and 2**-11 over sqrt(12), times ~1.5 for the add + norm chain); a sum in another
#: order or in the input dtype doubles that. The bounds leave a factor of ~4 while a lost rank's share
#: (~0.7) or a wrong row fails by orders of magnitude.
REL_TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}
#: e4m3 keeps 3 mantissa bits: one rounding is up to 2**-4 relative, about 2e-2 as an L2 average.
FP8_REL_TOL = 6e-2
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class Case:
    """One op at one shape, on this rank.

    Attributes:
        op: an op of :data:`tpcomm.bench.config.OPS`, or ``"copy"`` (the peer-copy reference).
        T, H: rows and hidden size (``T`` counts the whole tensor's rows for all-gather / reduce-scatter).
        dtype_name: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        world_size, rank: of the group.
        eps: RMSNorm epsilon.
        device: where this rank's tensors live (``cuda`` under NCCL; ``cpu`` for gloo ranks).
    """

    op: str
    T: int
    H: int
    dtype_name: str
    world_size: int
    rank: int
    eps: float
    device: str = "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype_name]

    @property
    def input_rows(self) -> int:
        """Rows of one rank's input: ``T / W`` for all-gather, else ``T``."""
        return self.T // self.world_size if self.op == "all_gather" else self.T

    @property
    def share(self) -> tuple[int, int]:
        """``(start, rows)`` of this rank's reduce-scatter share (``T`` is a multiple of ``W``)."""
        rows = self.T // self.world_size
        return self.rank * rows, rows


@dataclass
class Inputs:
    """Every rank's input (``xs[q]``, shape ``(input_rows, H)``), and the replicated residual ``(T, H)``
    and norm weight ``(H,)`` of the fused ops (None otherwise)."""

    xs: list
    residual: torch.Tensor | None
    weight: torch.Tensor | None


_OP_KEY = {"fused": 1, "fused_fp8": 2, "all_reduce": 3, "all_gather": 4, "reduce_scatter": 5, "copy": 6}


def _randn(shape, dtype, device, *key: int) -> torch.Tensor:
    g = torch.Generator(device=device)
    h = 0
    for k in key:
        h = (h * 1_000_003 + k) % (2**62)
    g.manual_seed(h)
    return torch.randn(shape, generator=g, device=device).to(dtype)


def make_inputs(case: Case, seed: int, salt: int, ranks: range | list | None = None) -> Inputs:
    """Inputs of ``case`` for seed ``seed`` and ``salt`` (0 for timing, one salt per contender for its
    check). ``ranks``: whose inputs to make (default every rank's; others are None)."""
    dt = case.dtype
    key = (seed, salt, _OP_KEY[case.op], case.T, case.H, int(case.dtype_name == "fp16"))
    shape = (case.input_rows, case.H)
    want = set(range(case.world_size) if ranks is None else ranks)
    dev = case.device
    xs = [_randn(shape, dt, dev, *key, q) if q in want else None for q in range(case.world_size)]
    residual = weight = None
    if case.op in ("fused", "fused_fp8"):
        residual = _randn((case.T, case.H), dt, dev, *key, 997)
        weight = (1.0 + 0.1 * _randn((case.H,), torch.float32, dev, *key, 998)).to(dt)
    return Inputs(xs, residual, weight)


def expected(case: Case, inp: Inputs) -> dict:
    """The contract's result of ``case`` on ``inp`` for this rank, named as contenders name outputs:
    ``sum`` (all-reduce), ``out`` / ``residual_out`` (fused), ``q`` / ``scale`` / ``residual_out``
    (fused_fp8), ``gathered`` (all-gather), ``share`` (reduce-scatter), ``received`` (copy: what the
    previous rank wrote here)."""
    op = case.op
    if op == "copy":
        return {"received": inp.xs[(case.rank - 1) % case.world_size]}
    if op == "all_gather":
        return {"gathered": torch.cat(inp.xs, dim=0)}
    s = reduce_in_rank_order(inp.xs)
    if op == "all_reduce":
        return {"sum": s}
    if op == "reduce_scatter":
        start, rows = case.share
        return {"share": s[start:start + rows]}
    out, res = add_rmsnorm_reference(s, inp.residual, inp.weight, case.eps)
    if op == "fused":
        return {"out": out, "residual_out": res}
    q, scale = per_token_quant_reference(out, FP8_DTYPE)
    return {"q": q, "scale": scale, "residual_out": res}


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``||y - ref|| / ||ref||`` in float64 (NaN if ``y`` holds a NaN; inf if shapes differ)."""
    if y.shape != ref.shape:
        return float("inf")
    r = ref.to(torch.float64)
    num = torch.linalg.vector_norm(y.to(torch.float64) - r)
    den = torch.linalg.vector_norm(r)
    return float(num / den) if float(den) > 0 else float(num)


def compare(case: Case, got: dict, want: dict, exact: bool) -> str | None:
    """Why ``got`` is not ``want`` (None when it is), at the strictness of the module docstring."""
    problems = []
    for name, ref in want.items():
        y = got.get(name)
        if y is None:
            problems.append(f"no {name} output")
            continue
        if tuple(y.shape) != tuple(ref.shape):
            problems.append(f"{name} has shape {tuple(y.shape)}, expected {tuple(ref.shape)}")
            continue
        if name == "q":
            scale = got.get("scale")
            if scale is None:
                continue
            err = relative_error(y.float() * scale.float().reshape(-1, 1),
                                 ref.float() * want["scale"].float().reshape(-1, 1))
            if not err <= FP8_REL_TOL:
                problems.append(f"dequantised q off by {err:.2e} (tolerance {FP8_REL_TOL:g})")
            continue
        if name == "scale":
            err, tol = relative_error(y.float().reshape(-1), ref.float().reshape(-1)), REL_TOL[case.dtype]
            if not err <= tol:
                problems.append(f"scale off by {err:.2e} (tolerance {tol:g})")
            continue
        if y.dtype != ref.dtype:
            problems.append(f"{name} has dtype {y.dtype}, expected {ref.dtype}")
            continue
        if name == "out" and exact:
            d, tol = ulp_distance(y, ref), out_ulp_tolerance(ref.dtype, case.H)
            if d > tol:
                problems.append(f"out differs by {d} ulp (contract: {tol})")
        elif exact or name in ("gathered", "received"):
            if not bit_equal(y, ref):
                problems.append(f"{name} not bit-exact ({ulp_distance(y, ref)} ulp)")
        else:
            err, tol = relative_error(y, ref), REL_TOL[case.dtype]
            if not err <= tol:
                problems.append(f"{name} off by {err:.2e} relative (tolerance {tol:g})")
    return "; ".join(problems) or None
