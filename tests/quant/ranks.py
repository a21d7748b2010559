"""Rank bodies of the fused FP8 tests (``tests/quant/test_fused_fp8.py``), and the FP8 helpers they share with
the GPU bodies (``tests/quant/gpu_ranks.py``).

A case is a :class:`Fp8Case`. Its body rebuilds every rank's input from the seed, makes the quantised
fused call (``Communicator.fused_add_rmsnorm(..., quant=...)``) and the same call without ``quant`` on
the same communicator and algorithm, quantises the unquantised ``out`` with the standalone Triton quant
(``tpcomm.quant``) and the plain-torch oracle (``tpcomm.reference``), computes the float32 reference of
the norm, and returns the tensors; the assertions live in the test file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import tpcomm
from tests.support.numerics import all_inputs, raised, residual_input, weight_input
from tpcomm.quant import mxfp4_quant, nvfp4_quant, per_group_quant_fp8, per_token_quant_fp8, static_quant_fp8
from tpcomm.reference import (
    mxfp4_quant_reference,
    nvfp4_quant_reference,
    per_group_quant_reference,
    per_group_ue8m0_quant_reference,
    per_token_quant_reference,
    static_fp8_quant_reference,
    swizzle_128x4,
)

#: Per FP8 format: the byte of every NaN, the magnitude bits of +-MAX, the smallest normal (2^-6 e4m3fn,
#: 2^-7 e4m3fnuz: below it the FP8 step is that of the subnormals).
NAN_BYTE = {torch.float8_e4m3fn: 0x7F, torch.float8_e4m3fnuz: 0x80}
MAX_CODE = {torch.float8_e4m3fn: 0x7E, torch.float8_e4m3fnuz: 0x7F}
MIN_NORMAL = {torch.float8_e4m3fn: 2.0 ** -6, torch.float8_e4m3fnuz: 2.0 ** -7}
#: The float32 NaN every NaN scale has (``tpcomm.kernels.quant``).
SCALE_NAN_BITS = 0x7FC00000
#: Mantissa bits of both FP8 formats (e4m3): one FP8 step in [2^e, 2^(e+1)) is 2^(e - 3).
FP8_MANTISSA_BITS = 3


@dataclass(frozen=True)
class _FusedCase:
    """What every quantised fused case has: the call, its inputs and its options (attributes as
    :class:`Fp8Case`)."""

    seed: int
    shape: tuple
    dtype: torch.dtype
    algo: str
    quant: str
    residual: bool = True
    gemma: bool = False
    emit: bool = False
    w_dtype: torch.dtype | None = None
    max_bytes: int | None = None
    special: bool = False
    peak: bool = False
    eps: float = 1e-6
    tiny: bool = False
    repeat: bool = False
    wild_weight: bool = False
    tiny_group: bool = False


@dataclass(frozen=True)
class Fp8Case(_FusedCase):
    """One quantised fused call.

    Attributes:
        seed: inputs (``numerics.all_inputs``; the same on every rank).
        shape: ``x``'s shape ``(T, H)`` or ``(B, S, H)``.
        dtype, w_dtype: input and norm-weight dtypes (``w_dtype`` None: the input's).
        algo: forced with ``Communicator.use_algorithm`` (lamport, one_shot, two_shot, fallback).
        quant: ``fp8_per_token``, ``fp8_per_group``, ``fp8_per_group_ue8m0`` or ``fp8_static``; fp8: the
            FP8 dtype; group: ``group_size``.
        scale, scale_shape: ``fp8_static``'s scale value and the shape of its tensor (``()``, ``(1,)`` or
            ``(1, 1)``); with a small scale the large elements of ``out`` saturate.
        repeat: (``fp8_static``) two more calls, with another scale tensor and then with that tensor's
            value changed in place: a repeated call (the call cache's replay) reads the scale it is given.
        column_major: ``column_major_scales``; residual, gemma, emit: the call's options.
        max_bytes: the communicator's (None: default; small: the call runs in several launches).
        special: overwrite rows 0..3 with zeros, a dominant element, a NaN and huge values (T >= 4).
        peak: every row of rank 0's ``x`` gets 1000 at column H - 3, so a row's amax lies in its last
            tile (rows wider than one tile) and its last group.
        eps: the norm's.
        tiny: (bf16 or fp32, T >= 2, with ``eps`` 0) rows 0 and 1 of every rank's ``x`` are 1e-30, row 0
            at odd columns only (0 elsewhere), and their residual 0: their squares underflow, so the
            norm's inverse is +Inf and ``out`` is NaN at the zeros and +-Inf elsewhere, where the
            largest ``|v * w'|`` no longer gives the row's amax (``epilogue.out_amax``).
        wild_weight: the norm weight holds a NaN at column 1 and 3e38 at column H - 2 (bf16, fp32), so the
            norm's inverse stays finite while ``v * w'`` is NaN in one group (block) of every row and
            +-Inf or huge in another: the groups' amax taken from ``v * w'`` (``epilogue.out_amax``)
            meets NaN and Inf. The float32 reference (written order) is not compared then.
        tiny_group: (bf16 or fp32 weight, per group) the weight's last group is 1e-38, so that group's
            scale lies far below 2^-90 (the fast division's bound, ``quant.divide``: its reciprocal
            overflows) in rows whose other groups are ordinary.
    """

    fp8: torch.dtype = torch.float8_e4m3fn
    group: int = 32
    column_major: bool = False
    scale: float | None = None
    scale_shape: tuple = ()

    def scale_tensor(self) -> torch.Tensor | None:
        """``fp8_static``'s scale (a new float32 tensor of ``scale_shape``), None for the other forms."""
        return None if self.scale is None else torch.full(self.scale_shape, self.scale, dtype=torch.float32)

    def kwargs(self, scale: torch.Tensor | None = None) -> dict:
        """The quant keyword arguments of ``fused_add_rmsnorm`` (``scale``: the static form's)."""
        kw = dict(quant=self.quant, fp8_dtype=self.fp8, column_major_scales=self.column_major,
                  emit_unquantized=self.emit)
        if self.quant == "fp8_static":
            kw["scale"] = scale
        elif self.quant != "fp8_per_token":  # per-token calls take no group_size (ValueError)
            kw["group_size"] = self.group
        return kw


@dataclass(frozen=True)
class Fp4Case(_FusedCase):
    """One fused call with an FP4 output (``quant="mxfp4"`` or ``"nvfp4"``); attributes as
    :class:`Fp8Case`, and ``swizzled`` (``swizzled_scales``), ``global_scale`` (NVFP4's ``scale``: 500
    maps a block amax of 5.4 to the block scale 448, so larger blocks saturate it and small ones get
    e4m3 subnormals), ``repeat`` (two more calls: NVFP4 with another global scale tensor, then that
    tensor with a new value; MXFP4 the same call again)."""

    swizzled: bool = False
    global_scale: float = 500.0

    def scale_tensor(self, value: float | None = None) -> torch.Tensor | None:
        if self.quant != "nvfp4":
            return None
        return torch.tensor([self.global_scale if value is None else value], dtype=torch.float32)

    def kwargs(self, scale: torch.Tensor | None = None) -> dict:
        kw = dict(quant=self.quant, emit_unquantized=self.emit, swizzled_scales=self.swizzled)
        if scale is not None:
            kw["scale"] = scale
        return kw


def fp4_quant(out2d: torch.Tensor, quant: str, swizzled: bool, scale, standalone: bool):
    """``(q, scales as uint8)`` of a ``(T, H)`` output: ``tpcomm.quant``'s Triton op (``standalone``) or
    the plain-torch reference (swizzled by ``reference.swizzle_128x4``)."""
    if standalone:
        q, s = (mxfp4_quant(out2d, swizzled_scales=swizzled) if quant == "mxfp4"
                else nvfp4_quant(out2d, scale, swizzled_scales=swizzled))
    else:
        q, s = mxfp4_quant_reference(out2d) if quant == "mxfp4" else nvfp4_quant_reference(out2d, scale)
        s = swizzle_128x4(s) if swizzled else s
    return q, s.view(torch.uint8)


# -- FP8 helpers (CPU and GPU bodies) -----------------------------------------------------------------------
def standalone_quant(out2d: torch.Tensor, quant: str, fp8, group: int, column_major: bool, scale=None):
    """``tpcomm.quant``'s Triton quant of a ``(T, H)`` output: ``(q, scales)`` (static: ``scale`` itself)."""
    if quant == "fp8_static":
        return static_quant_fp8(out2d, scale, fp8), scale
    if quant == "fp8_per_token":
        return per_token_quant_fp8(out2d, fp8)
    return per_group_quant_fp8(out2d, group, fp8, column_major_scales=column_major,
                               ue8m0=quant == "fp8_per_group_ue8m0")


def reference_quant(out2d: torch.Tensor, quant: str, fp8, group: int, column_major: bool, scale=None):
    """``tpcomm.reference``'s plain-torch quant of a ``(T, H)`` output: ``(q, scales)`` (static: ``scale``)."""
    if quant == "fp8_static":
        return static_fp8_quant_reference(out2d, scale, fp8), scale
    if quant == "fp8_per_token":
        return per_token_quant_reference(out2d, fp8)
    if quant == "fp8_per_group_ue8m0":
        q, scales = per_group_ue8m0_quant_reference(out2d, group, fp8)
        if column_major:  # the (1, T) strides of a transposed (G, T) tensor, as the kernels write them
            scales = torch.empty(scales.shape[::-1], dtype=scales.dtype, device=scales.device).t().copy_(scales)
        return q, scales
    return per_group_quant_reference(out2d, group, fp8, column_major_scales=column_major)


def expand_scales(scales2d: torch.Tensor, H: int) -> torch.Tensor:
    """``(T, G)`` scales (G = 1 per token) repeated to one per element: ``(T, H)`` float32."""
    return scales2d.repeat_interleave(H // scales2d.shape[1], dim=1)


def dequantize(q2d: torch.Tensor, scales2d: torch.Tensor) -> torch.Tensor:
    """``f32(q) * scale`` per element, ``(T, H)`` float32."""
    return q2d.to(torch.float32) * expand_scales(scales2d.float(), q2d.shape[1])


def fp8_step(y: torch.Tensor, scale: torch.Tensor, fp8) -> torch.Tensor:
    """One FP8 step at ``y / scale``, in ``y``'s units: ``2^(floor(log2 |y / scale|) - 3) * scale``, with
    ``|y / scale|`` raised to the smallest normal (below it the subnormal step is constant)."""
    a = (y / scale).abs().clamp(min=MIN_NORMAL[fp8])
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    return torch.ldexp(torch.ones_like(a), e - 1 - FP8_MANTISSA_BITS) * scale


def scale_rule_failures(q2: torch.Tensor, s2: torch.Tensor, out2: torch.Tensor, fp8, pow2: bool = False) -> list[str]:
    """The scale rules on fused bytes ``q2`` (``(T, H)`` uint8) and scales ``s2`` (``(T, G)``), per row
    (group), from the unquantised ``out2`` (``(T, H)``): amax 0 gives scale 1.0; a NaN gives the scale
    0x7FC00000 and every byte the NaN byte; otherwise the amax's byte is +-MAX, or with ``pow2``
    (UE8M0 scales) every finite scale is a power of two with ``amax / scale`` in ``(MAX / 2, MAX]``
    (unless the scale is the smallest, 2^-127). Returns what failed."""
    T, H = out2.shape
    G = s2.shape[1]
    o = out2.float().reshape(T, G, H // G)
    qg = q2.reshape(T, G, H // G).to(torch.int32)
    has_nan = o.isnan().any(-1)
    amax = o.abs().masked_fill(o.isnan(), 0.0).amax(-1)  # +Inf stays +Inf (not nan_to_num's largest float)
    sbits = s2.contiguous().view(torch.int32)
    failures = []
    zero = ~has_nan & (amax == 0)
    if not bool((s2[zero] == 1.0).all()):
        failures.append(f"{int((s2[zero] != 1.0).sum())} all-zero groups without scale 1")
    if not bool((sbits[has_nan] == SCALE_NAN_BITS).all()):
        failures.append(f"{int((sbits[has_nan] != SCALE_NAN_BITS).sum())} NaN groups without the NaN scale")
    if not bool((qg[has_nan] == NAN_BYTE[fp8]).all()):
        failures.append(f"{int((qg[has_nan] != NAN_BYTE[fp8]).sum())} bytes of NaN groups are not the "
                        "NaN byte")
    finite = ~has_nan & (amax > 0) & amax.isfinite()
    if pow2:
        fmax = torch.finfo(fp8).max
        sc = s2[finite]
        ratio = amax[finite] / sc
        power = ((sc.contiguous().view(torch.int32) & 0x7FFFFF) == 0) | (sc == 2.0 ** -127)  # that one is subnormal
        ok = power & (ratio <= fmax) & ((ratio > fmax / 2) | (sc == 2.0 ** -127))
        if not bool(ok.all()):
            failures.append(f"{int((~ok).sum())} groups whose scale is no power of two with amax / scale in "
                            f"(MAX / 2, MAX], e.g. {sc[~ok][:4].tolist()}")
        return failures
    top = (qg & 0x7F).amax(-1)[finite]
    if not bool((top == MAX_CODE[fp8]).all()):
        failures.append(f"{int((top != MAX_CODE[fp8]).sum())} groups whose largest byte is not +-MAX, e.g. "
                        f"{top[top != MAX_CODE[fp8]][:4].tolist()}")
    return failures


def static_rule_failures(q2: torch.Tensor, out2: torch.Tensor, scale: float, fp8) -> list[str]:
    """The static form's byte rules on ``q2`` (``(T, H)`` uint8) from the unquantised ``out2``: the NaN
    byte exactly where ``out`` is NaN, and the magnitude +-MAX wherever ``|f32(out) * f32(1 / scale)|``
    is past MAX (saturation; +-Inf included). Returns what failed."""
    inv = (1.0 / torch.tensor(scale, dtype=torch.float32).double()).float()
    v = out2.float() * inv
    q = q2.to(torch.int32)
    failures = []
    nan = v.isnan()
    if not torch.equal(q == NAN_BYTE[fp8], nan):
        failures.append(f"NaN bytes at {int((q == NAN_BYTE[fp8]).sum())} places, NaN in out at {int(nan.sum())}")
    sat = ~nan & (v.abs() > torch.finfo(fp8).max)
    if not bool(((q[sat] & 0x7F) == MAX_CODE[fp8]).all()):
        failures.append(f"{int(((q[sat] & 0x7F) != MAX_CODE[fp8]).sum())} of {int(sat.sum())} saturating "
                        "elements are not +-MAX")
    return failures


def dequantised_failure(q2: torch.Tensor, s2: torch.Tensor, y32: torch.Tensor, fp8) -> str | None:
    """``f32(q) * scale`` (``q2`` ``(T, H)`` uint8, ``s2`` ``(T, G)``) within one FP8 step (at
    ``y / scale``, :func:`fp8_step`) of the float32 reference ``y32`` (any shape of T * H elements), and
    NaN exactly where it is NaN; None if so, else what failed. One step covers the FP8 rounding (half a
    step), the rounding of ``out`` to T (bf16: 2^-9 relative, far below half a step) and the order of the
    mean's sum."""
    deq = dequantize(q2.view(fp8), s2)
    y = y32.reshape(deq.shape)
    if not torch.equal(deq.isnan(), y.isnan()):
        return f"dequantised NaNs at {int((deq.isnan() != y.isnan()).sum())} places the reference has none"
    ok = ~y.isnan()
    step = fp8_step(y, expand_scales(s2.float(), y.shape[1]), fp8)
    err = (deq - y).abs()
    bad = ok & ~(err <= step)
    if bad.any():
        return (f"{int(bad.sum())} dequantised values more than one FP8 step from the float32 reference, "
                f"worst {float((err / step)[ok].max()):.2f} steps")
    return None

def norm_f32(v: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """The contract's ``y`` before its rounding to T: ``v * rsqrt(mean(v^2) + eps) * w'``, float32."""
    v = v.to(torch.float32)
    wf = w.to(torch.float32)
    if gemma:
        wf = 1.0 + wf
    return v * (1.0 / torch.sqrt((v * v).mean(dim=-1, keepdim=True) + eps)) * wf


def special_inputs(xs: list, res, dtype: torch.dtype, rank_of_nan: int) -> None:
    """Overwrite rows 0..3 of every rank's ``x`` (and of ``res``) in place, as a test of the scale rules:
    row 0 zeros everywhere (out 0: scale 1); row 1 one element 1000 on rank 0, at column H - 3 (the last
    group; it holds the row's amax: its byte is +-MAX); row 2 a NaN on ``rank_of_nan`` (the whole row of
    out is NaN: scale NaN, NaN bytes); row 3 huge values (bf16/fp32: 1e20, whose squares overflow float32,
    so the norm gives 0 and the scale 1; fp16: 2000 times the random values, a large finite row)."""
    for x in xs:
        x[0] = 0.0
    if res is not None:
        res[0] = 0.0
    xs[0][1, -3] = 1000.0
    xs[rank_of_nan][2, 5] = float("nan")
    for x in xs:
        if dtype == torch.float16:
            x[3] = x[3] * 2000.0
        else:
            x[3] = torch.where(x[3] < 0, -1e20, 1e20).to(dtype)


# -- rank bodies ------------------------------------------------------------------------------------------
def case_inputs(ctx, case) -> tuple:
    """Every rank's ``x``, the residual (or None) and the norm weight of ``case`` (an :class:`Fp8Case` or
    :class:`Fp4Case`), with its special rows, peak or tiny rows written in."""
    shape, dtype = tuple(case.shape), case.dtype
    H = shape[-1]
    xs = all_inputs(case.seed, ctx.world_size, shape, dtype)
    res = residual_input(case.seed, shape, dtype) if case.residual else None
    w = weight_input(case.seed, H, case.w_dtype or dtype, case.gemma)
    if case.special:
        special_inputs([x.view(-1, H) for x in xs], res.view(-1, H) if res is not None else None, dtype,
                       ctx.world_size - 1)
    if case.peak:
        xs[0][..., H - 3] = 1000.0
    if case.wild_weight:
        w[1] = float("nan")
        w[H - 2] = 3e38
    if case.tiny_group:
        w[H - case.group:] = 1e-38
    if case.tiny:
        for x in xs:
            x.view(-1, H)[:2] = 1e-30
            x.view(-1, H)[0, 0::2] = 0.0
        if res is not None:
            res.view(-1, H)[:2] = 0.0
    return xs, res, w


def fp8_case(ctx, case: Fp8Case) -> dict:
    """Run ``case`` (see the module docstring). Returns the quantised call's ``q`` (uint8), ``scales``,
    ``residual_out`` and ``out``; ``plain_out`` / ``plain_ro`` of the call without ``quant``;
    ``std_q`` / ``std_s`` (Triton quant of ``out`` if emitted, else of ``plain_out``) and ``ref_q`` /
    ``ref_s`` (torch quant of ``plain_out``), both on the ``(T, H)`` view; ``ro_ref`` and ``y32`` (float32
    reference of the norm); the plan, the launches of the call; and, with ``max_bytes``, ``whole_*``:
    the same call on a default communicator (one launch)."""
    comm = ctx.comm(case.max_bytes)
    xs, res, w = case_inputs(ctx, case)
    H, dtype = case.shape[-1], case.dtype
    x = xs[ctx.rank]
    scale = case.scale_tensor()
    with comm.use_algorithm(case.algo):
        before = comm.workspace.epoch() if comm.workspace is not None else 0
        q, scales, ro, out = comm.fused_add_rmsnorm(x, res, w, eps=case.eps, gemma=case.gemma,
                                                    **case.kwargs(scale))
        launches = (comm.workspace.epoch() if comm.workspace is not None else 0) - before
        plain_out, plain_ro = comm.fused_add_rmsnorm(x, res, w, eps=case.eps, gemma=case.gemma)
        plan = comm.plan("fused_add_rmsnorm", x.numel() * x.element_size(), H, dtype).algorithm
        if case.repeat:
            other = torch.full(case.scale_shape, case.scale * 3.0, dtype=torch.float32)
            again = [comm.fused_add_rmsnorm(x, res, w, eps=case.eps, gemma=case.gemma, **case.kwargs(other))[0]]
            other.fill_(case.scale / 5.0)  # the same tensor, a new value (as a CUDA graph replays)
            again.append(comm.fused_add_rmsnorm(x, res, w, eps=case.eps, gemma=case.gemma, **case.kwargs(other))[0])
    args = (case.quant, case.fp8, case.group, case.column_major, scale)
    own = out if out is not None else plain_out
    std_q, std_s = standalone_quant(own.reshape(-1, H), *args)
    ref_q, ref_s = reference_quant(plain_out.reshape(-1, H), *args)
    s_ref = tpcomm.reduce_in_rank_order(xs)
    _, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, w, case.eps, case.gemma)
    y32 = norm_f32(ro_ref if res is not None else s_ref, w, case.eps, case.gemma)
    result = {"q": q.view(torch.uint8), "q_dtype": q.dtype, "scales": scales, "ro": ro, "out": out,
              "plain_out": plain_out, "plain_ro": plain_ro, "std_q": std_q.view(torch.uint8), "std_s": std_s,
              "ref_q": ref_q.view(torch.uint8), "ref_s": ref_s, "ro_ref": ro_ref, "y32": y32,
              "plan": plan, "launches": launches}
    if scale is not None:
        result["scale_is_input"] = scales is scale
    if case.repeat:
        result["again"] = [a.view(torch.uint8) for a in again]
        values = [torch.tensor(v, dtype=torch.float32) for v in (case.scale * 3.0, case.scale / 5.0)]
        result["again_ref"] = [static_fp8_quant_reference(plain_out.reshape(-1, H), v, case.fp8)
                               .view(torch.uint8).reshape(x.shape) for v in values]
    if case.max_bytes is not None:
        whole = ctx.comm()
        with whole.use_algorithm(case.algo):
            wq, ws, wro, wout = whole.fused_add_rmsnorm(x, res, w, eps=case.eps, gemma=case.gemma,
                                                        **case.kwargs(scale))
        result.update(whole_q=wq.view(torch.uint8), whole_s=ws, whole_ro=wro, whole_out=wout)
    return result


def fp4_case(ctx, case: Fp4Case) -> dict:
    """Run ``case``: the FP4 fused call, the same call without ``quant``, the standalone Triton quant of
    its ``out`` (``std_*``) and the reference quant of the unquantised call's ``out`` (``ref_*``; also
    ``ref_linear``, the reference's unswizzled scales); ``ro_ref``, ``y32``, the plan and the launches as
    :func:`fp8_case`; ``again`` / ``again_ref`` with ``repeat``; ``whole_*`` with ``max_bytes``. Bytes
    and scales as uint8."""
    comm = ctx.comm(case.max_bytes)
    xs, res, w = case_inputs(ctx, case)
    H = case.shape[-1]
    x = xs[ctx.rank]
    g = case.scale_tensor()
    again, again_values = [], []
    with comm.use_algorithm(case.algo):
        before = comm.workspace.epoch() if comm.workspace is not None else 0
        q, scales, ro, out = comm.fused_add_rmsnorm(x, res, w, eps=case.eps, gemma=case.gemma, **case.kwargs(g))
        launches = (comm.workspace.epoch() if comm.workspace is not None else 0) - before
        plain_out, plain_ro = comm.fused_add_rmsnorm(x, res, w, eps=case.eps, gemma=case.gemma)
        plan = comm.plan("fused_add_rmsnorm", x.numel() * x.element_size(), H, case.dtype).algorithm
        if case.repeat:
            other = case.scale_tensor(case.global_scale * 3.0)
            for value in (case.global_scale * 3.0, case.global_scale / 5.0):
                if other is not None:
                    other.fill_(value)  # the second time: the same tensor, a new value (as a CUDA graph replays)
                aq, as_, _, _ = comm.fused_add_rmsnorm(x, res, w, eps=case.eps, gemma=case.gemma,
                                                       **case.kwargs(other))
                again.append((aq, as_.view(torch.uint8)))
                again_values.append(case.scale_tensor(value))
    rows = plain_out.reshape(-1, H)
    own = (out if out is not None else plain_out).reshape(-1, H)
    std_q, std_s = fp4_quant(own, case.quant, case.swizzled, g, standalone=True)
    ref_q, ref_s = fp4_quant(rows, case.quant, case.swizzled, g, standalone=False)
    _, ref_linear = fp4_quant(rows, case.quant, False, g, standalone=False)
    s_ref = tpcomm.reduce_in_rank_order(xs)
    _, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, w, case.eps, case.gemma)
    y32 = norm_f32(ro_ref if res is not None else s_ref, w, case.eps, case.gemma)
    result = {"q": q, "scales": scales.view(torch.uint8), "scales_dtype": scales.dtype,
              "scales_stride": scales.stride(),
              "ro": ro, "out": out, "plain_out": plain_out, "plain_ro": plain_ro, "std_q": std_q, "std_s": std_s,
              "ref_q": ref_q, "ref_s": ref_s, "ref_linear": ref_linear, "ro_ref": ro_ref, "y32": y32, "plan": plan,
              "launches": launches,
              "again": again, "again_ref": [fp4_quant(rows, case.quant, case.swizzled, v, standalone=False)
                                            for v in again_values]}
    if case.max_bytes is not None:
        whole = ctx.comm()
        with whole.use_algorithm(case.algo):
            wq, ws, _, _ = whole.fused_add_rmsnorm(x, res, w, eps=case.eps, gemma=case.gemma, **case.kwargs(g))
        result.update(whole_q=wq, whole_s=ws.view(torch.uint8))
    return result


def fp4_bound_failure(q2: torch.Tensor, linear: torch.Tensor, y32: torch.Tensor, quant: str,
                      global_scale: float) -> str | None:
    """Dequantised FP4 (``reference.mxfp4_dequant_reference`` / ``nvfp4_dequant_reference`` of ``q2`` and
    the linear scales) within the format's step of the float32 reference ``y32``, NaN exactly in the
    blocks where it is NaN; None if so. With ``S`` the block's unit (``2^e``, or ``s / global_scale``):
    ``|deq - y| <= max(|y|, S) / 4 + max(|y| - 6 S, 0) + |y| 2^-7``: half an E2M1 step is at most
    ``max(|y / S|, 1) / 4`` units, magnitudes past 6 units saturate, and ``out``'s rounding to T is below
    2^-8 of ``|y|`` (2^-7 leaves room for the order of the mean's sum)."""
    from tpcomm.reference import mxfp4_dequant_reference, nvfp4_dequant_reference

    block = 32 if quant == "mxfp4" else 16
    g = torch.tensor([global_scale], dtype=torch.float32)
    if quant == "mxfp4":
        deq = mxfp4_dequant_reference(q2, linear)
        unit = torch.exp2(linear.double() - 127)
    else:
        deq = nvfp4_dequant_reference(q2, linear.view(torch.float8_e4m3fn), g)
        unit = linear.view(torch.float8_e4m3fn).double() / global_scale
    y = y32.reshape(deq.shape).double()
    T, H = y.shape
    nan_blocks = y.isnan().reshape(T, H // block, block).any(-1).repeat_interleave(block, 1)
    if not torch.equal(deq.isnan(), nan_blocks):
        return (f"dequantised NaN in {int(deq.isnan().sum())} elements, the reference's NaN blocks hold "
                f"{int(nan_blocks.sum())}")
    S = unit.repeat_interleave(block, 1)
    bound = torch.maximum(y.abs(), S) / 4 + (y.abs() - 6 * S).clamp(min=0) + y.abs() * 2.0 ** -7
    err = (deq.double() - y).abs()
    bad = ~nan_blocks & ~(err <= bound)
    if bad.any():
        return f"{int(bad.sum())} dequantised values past the FP4 bound, worst {float((err - bound)[bad].max()):.3g}"
    return None


def _bad_fp8_call(comm, name: str):
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    r = torch.randn(4, 96, dtype=torch.bfloat16)
    w = torch.ones(96, dtype=torch.bfloat16)
    f = comm.fused_add_rmsnorm
    one = torch.tensor(0.01)
    one4 = torch.tensor([0.01])  # its 4 bytes as the q_out of a (1, 4) call
    calls = {
        "quant_unknown": lambda: f(x, r, w, quant="fp8_per_channel"),
        "quant_upper_case": lambda: f(x, r, w, quant="FP8_PER_TOKEN"),
        "fp8_dtype_e5m2": lambda: f(x, r, w, quant="fp8_per_token", fp8_dtype=torch.float8_e5m2),
        "fp8_dtype_bf16": lambda: f(x, r, w, quant="fp8_per_group", fp8_dtype=torch.bfloat16, group_size=32),
        "group_not_power_of_two": lambda: f(x, r, w, quant="fp8_per_group", group_size=48),
        "group_not_dividing_h": lambda: f(x, r, w, quant="fp8_per_group", group_size=64),
        "group_default_not_dividing_h": lambda: f(x, r, w, quant="fp8_per_group"),
        "group_zero": lambda: f(x, r, w, quant="fp8_per_group", group_size=0),
        "group_float": lambda: f(x, r, w, quant="fp8_per_group", group_size=32.0),
        "group_float_default_per_token": lambda: f(x, r, w, quant="fp8_per_token", group_size=128.0),
        "group_float_default_without_quant": lambda: f(x, r, w, group_size=128.0),
        "column_major_per_token": lambda: f(x, r, w, quant="fp8_per_token", column_major_scales=True),
        "group_size_per_token": lambda: f(x, r, w, quant="fp8_per_token", group_size=32),
        "column_major_3d": lambda: f(x.view(2, 2, 96), r.view(2, 2, 96), w, quant="fp8_per_group",
                                     group_size=32, column_major_scales=True),
        "emit_without_quant": lambda: f(x, r, w, emit_unquantized=True),
        "column_major_without_quant": lambda: f(x, r, w, column_major_scales=True),
        "group_size_without_quant": lambda: f(x, r, w, group_size=3),
        "fp8_dtype_without_quant": lambda: f(x, r, w, fp8_dtype=torch.bfloat16),
        "emit_not_bool": lambda: f(x, r, w, quant="fp8_per_token", emit_unquantized="no"),
        "column_major_not_bool": lambda: f(x, r, w, quant="fp8_per_group", group_size=32, column_major_scales="no"),
        # static per-tensor FP8
        "static_without_scale": lambda: f(x, r, w, quant="fp8_static"),
        "static_scale_float64": lambda: f(x, r, w, quant="fp8_static", scale=torch.tensor(0.01, dtype=torch.float64)),
        "static_scale_bf16": lambda: f(x, r, w, quant="fp8_static", scale=torch.tensor([0.01], dtype=torch.bfloat16)),
        "static_scale_python_float": lambda: f(x, r, w, quant="fp8_static", scale=0.01),
        "static_scale_two_elements": lambda: f(x, r, w, quant="fp8_static", scale=torch.tensor([0.01, 0.02])),
        "static_scale_empty": lambda: f(x, r, w, quant="fp8_static", scale=torch.empty(0)),
        "static_scale_meta": lambda: f(x, r, w, quant="fp8_static", scale=torch.empty((), device="meta")),
        "static_scale_nan": lambda: f(x, r, w, quant="fp8_static", scale=torch.tensor(float("nan"))),
        "static_scale_inf": lambda: f(x, r, w, quant="fp8_static", scale=torch.tensor([float("inf")])),
        "static_scale_zero": lambda: f(x, r, w, quant="fp8_static", scale=torch.tensor(0.0)),
        "static_scale_negative": lambda: f(x, r, w, quant="fp8_static", scale=torch.tensor(-0.5)),
        "static_scale_tiny": lambda: f(x, r, w, quant="fp8_static", scale=torch.tensor(1e-42)),
        "static_fp8_dtype_e5m2": lambda: f(x, r, w, quant="fp8_static", scale=one, fp8_dtype=torch.float8_e5m2),
        "static_group_size": lambda: f(x, r, w, quant="fp8_static", scale=one, group_size=32),
        "static_column_major": lambda: f(x, r, w, quant="fp8_static", scale=one, column_major_scales=True),
        "static_scales_out": lambda: f(x, r, w, quant="fp8_static", scale=one, scales_out=torch.empty(())),
        "static_q_out_is_scale": lambda: f(x[:1, :4].contiguous(), r[:1, :4].contiguous(), w[:4], quant="fp8_static",
                                           scale=one4, q_out=one4.view(torch.float8_e4m3fn).view(1, 4)),
        "scale_with_per_token": lambda: f(x, r, w, quant="fp8_per_token", scale=one),
        "scale_with_per_group": lambda: f(x, r, w, quant="fp8_per_group", group_size=32, scale=one),
        "scale_without_quant": lambda: f(x, r, w, scale=one),
        # FP4
        "mxfp4_h_not_multiple": lambda: f(x[:, :80].contiguous(), r[:, :80].contiguous(), w[:80], quant="mxfp4"),
        "nvfp4_h_not_multiple": lambda: f(x[:, :40].contiguous(), r[:, :40].contiguous(), w[:40], quant="nvfp4",
                                          scale=one),
        "nvfp4_without_scale": lambda: f(x, r, w, quant="nvfp4"),
        "nvfp4_scale_float64": lambda: f(x, r, w, quant="nvfp4", scale=torch.tensor(500.0, dtype=torch.float64)),
        "nvfp4_scale_nan": lambda: f(x, r, w, quant="nvfp4", scale=torch.tensor([float("nan")])),
        "mxfp4_with_scale": lambda: f(x, r, w, quant="mxfp4", scale=one),
        "fp4_fp8_dtype": lambda: f(x, r, w, quant="mxfp4", fp8_dtype=torch.float8_e4m3fnuz),
        "fp4_group_size": lambda: f(x, r, w, quant="nvfp4", scale=one, group_size=32),
        "fp4_column_major": lambda: f(x, r, w, quant="mxfp4", column_major_scales=True),
        "swizzled_with_fp8": lambda: f(x, r, w, quant="fp8_per_token", swizzled_scales=True),
        "swizzled_without_quant": lambda: f(x, r, w, swizzled_scales=True),
        "swizzled_not_bool": lambda: f(x, r, w, quant="mxfp4", swizzled_scales=1),
        "swizzled_3d": lambda: f(x.view(2, 2, 96), r.view(2, 2, 96), w, quant="mxfp4", swizzled_scales=True),
        "fp4_q_out_shape": lambda: f(x, r, w, quant="mxfp4", q_out=torch.empty(4, 96, dtype=torch.uint8)),
        "fp4_scales_out_dtype": lambda: f(x, r, w, quant="nvfp4", scale=one,
                                          scales_out=torch.empty(4, 6, dtype=torch.uint8)),
    }
    return calls[name]


def fp8_bad_inputs_case(ctx, names: list) -> dict:
    """``{name: (exception type, message) or None}`` for each bad call, then a good quantised call (the
    ranks must still be in step): ``after`` = its ``(q, scales)``, ``after_ref`` = the torch quant of its
    emitted ``out``; a static call likewise (``static`` and ``static_ref``) and the same call with a NaN
    scale (``static_nan_again``: what it raised); and a per-group call whose
    ``group_size`` is a numpy integer: ``numpy_group`` and ``numpy_group_ref`` likewise."""
    comm = ctx.comm()
    seen = {name: raised(_bad_fp8_call(comm, name)) for name in names}
    x = torch.full((2, 32), float(ctx.rank + 1), dtype=torch.bfloat16)
    q, s, _, out = comm.fused_add_rmsnorm(x, None, torch.ones(32, dtype=torch.bfloat16),
                                          quant="fp8_per_token", emit_unquantized=True)
    rq, rs = per_token_quant_reference(out)
    scale = torch.tensor([0.004])
    sq, ss, _, sout = comm.fused_add_rmsnorm(x, None, torch.ones(32, dtype=torch.bfloat16), quant="fp8_static",
                                             scale=scale, emit_unquantized=True)
    srq = static_fp8_quant_reference(sout, scale)
    # a call of the same layout is a cache hit, which reads a CPU scale as the full path does
    nan_again = raised(lambda: comm.fused_add_rmsnorm(x, None, torch.ones(32, dtype=torch.bfloat16),
                                                      quant="fp8_static", scale=torch.tensor([float("nan")]),
                                                      emit_unquantized=True))
    gq, gs, _, gout = comm.fused_add_rmsnorm(x, None, torch.ones(32, dtype=torch.bfloat16),
                                             quant="fp8_per_group", group_size=np.int64(16), emit_unquantized=True)
    grq, grs = per_group_quant_reference(gout, 16)
    return {"errors": seen, "after": (q.view(torch.uint8), s), "after_ref": (rq.view(torch.uint8), rs),
            "static": (sq.view(torch.uint8), ss), "static_ref": (srq.view(torch.uint8), scale),
            "static_nan_again": nan_again,
            "numpy_group": (gq.view(torch.uint8), gs), "numpy_group_ref": (grq.view(torch.uint8), grs)}


#: (name, shape, quant kwargs) of the zero-token calls.
ZERO_TOKEN_CALLS = [
    ("per_token", (0, 64), dict(quant="fp8_per_token", emit_unquantized=True)),
    ("per_group", (0, 64), dict(quant="fp8_per_group", group_size=16, fp8_dtype=torch.float8_e4m3fnuz)),
    ("per_group_column_major", (0, 64), dict(quant="fp8_per_group", group_size=32, column_major_scales=True,
                                             emit_unquantized=True)),
    ("per_group_3d", (2, 0, 64), dict(quant="fp8_per_group", group_size=32)),
    ("static", (0, 64), dict(quant="fp8_static", scale=torch.tensor([0.5]), emit_unquantized=True)),
    ("mxfp4", (0, 64), dict(quant="mxfp4", emit_unquantized=True)),
    ("nvfp4_swizzled", (0, 64), dict(quant="nvfp4", scale=torch.tensor([500.0]), swizzled_scales=True)),
]


def fp8_zero_tokens_case(ctx) -> dict:
    """Each of ZERO_TOKEN_CALLS on every rank: ``{name: [(shape, dtype, strides) or None for q, scales,
    residual_out, out]}`` (empty views do not survive pickling whole), the epoch
    before and after (no launch may happen), and a quantised call of one row right after
    (``after``: ``(q bytes, scales)``, ``after_ref``: the torch quant of its ``out``)."""
    comm = ctx.comm()
    epoch = comm.workspace.epoch()
    got = {}
    for name, shape, kw in ZERO_TOKEN_CALLS:
        x = torch.empty(shape, dtype=torch.bfloat16)
        w = torch.ones(shape[-1], dtype=torch.bfloat16)
        outs = comm.fused_add_rmsnorm(x, torch.empty_like(x), w, **kw)
        got[name] = [None if t is None else (tuple(t.shape), t.dtype, t.stride()) for t in outs]
    epoch_after = comm.workspace.epoch()
    x = torch.full((1, 64), float(ctx.rank + 1), dtype=torch.bfloat16)
    q, s, _, out = comm.fused_add_rmsnorm(x, None, torch.linspace(-2, 2, 64).to(torch.bfloat16),
                                          quant="fp8_per_group", group_size=16, emit_unquantized=True)
    rq, rs = per_group_quant_reference(out, 16)
    return {"calls": got, "epoch": epoch, "epoch_after": epoch_after,
            "after": (q.view(torch.uint8), s), "after_ref": (rq.view(torch.uint8), rs)}



def static_ops_case(ctx) -> dict:
    """``quant="fp8_static"`` (and the FP4 forms) through ``tpcomm.ops``: ``{name: bool or error text}``.

    ``wrapper``: ``tops.fused_add_rmsnorm`` gives the method's bytes, ``residual_out`` and ``out``, and
    the input scale itself as its scales; ``out_form``: the same with ``q_out`` and ``residual_out``
    given (``tpcomm::fused_add_rmsnorm_fp8_out``), written in place; ``opcheck`` / ``opcheck_out``:
    ``torch.library.opcheck`` of the allocating op with a scale; ``fp4_wrapper``: NVFP4 with swizzled
    scales through the wrapper, as the method; ``fp4_out_form``: MXFP4 into given ``q_out`` and
    ``scales_out``; ``compiled`` / ``compiled_new_value``:
    ``torch.compile(fullgraph=True, backend="aot_eager")`` of a function making the call, bit-identical to
    eager (with an NVFP4 call beside it), then with the scales' values changed in place (no recompilation:
    ``frames`` stays 1)."""
    import traceback

    from torch._dynamo.testing import CompileCounterWithBackend

    import tpcomm.ops as tops

    comm = ctx.comm()
    shape, dtype = (2, 32), torch.bfloat16
    x = all_inputs(51, ctx.world_size, shape, dtype)[ctx.rank]
    res = residual_input(51, shape, dtype)
    w = weight_input(51, shape[-1], dtype)
    scale = torch.tensor([0.006])
    got = {}

    def same_u8(a, b):
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    q, _, ro, out = comm.fused_add_rmsnorm(x, res, w, quant="fp8_static", scale=scale, emit_unquantized=True)
    oq, os_, oro, oout = tops.fused_add_rmsnorm(comm, x, res, w, quant="fp8_static", scale=scale,
                                                emit_unquantized=True)
    got["wrapper"] = (same_u8(oq, q) and os_ is scale and torch.equal(oro, ro) and torch.equal(oout, out)
                      and same_u8(q, static_quant_fp8(out, scale)))
    q_buf, ro_buf = torch.full(shape, float("nan")).to(torch.float8_e4m3fn), torch.full_like(x, float("nan"))
    bq, bs, bro, bout = tops.fused_add_rmsnorm(comm, x, res, w, quant="fp8_static", scale=scale, q_out=q_buf,
                                               residual_out=ro_buf)
    got["out_form"] = (bq is q_buf and bs is scale and bro is ro_buf and bout is None and same_u8(q_buf, q)
                       and torch.equal(ro_buf, ro))
    g = torch.tensor([500.0])
    m4 = comm.fused_add_rmsnorm(x, res, w, quant="nvfp4", scale=g, swizzled_scales=True, emit_unquantized=True)
    o4 = tops.fused_add_rmsnorm(comm, x, res, w, quant="nvfp4", scale=g, swizzled_scales=True,
                                emit_unquantized=True)
    got["fp4_wrapper"] = (same_u8(o4[0], m4[0]) and same_u8(o4[1], m4[1]) and o4[1].shape == (128, 4)
                          and torch.equal(o4[2], m4[2]) and torch.equal(o4[3], m4[3]))
    q4_buf, s4_buf = torch.empty(shape[0], shape[1] // 2, dtype=torch.uint8), torch.empty(2, 1, dtype=torch.uint8)
    b4 = tops.fused_add_rmsnorm(comm, x, res, w, quant="mxfp4", q_out=q4_buf, scales_out=s4_buf)
    r4 = mxfp4_quant_reference(m4[3])
    got["fp4_out_form"] = (b4[0] is q4_buf and b4[1] is s4_buf and torch.equal(q4_buf, r4[0])
                           and torch.equal(s4_buf, r4[1]))
    refused = raised(lambda: tops.fused_add_rmsnorm(comm, x, res, w, quant="fp8_static", scale=scale,
                                                    swizzled_scales=True, residual_out=torch.empty_like(x)))
    got["static_swizzled_refused"] = (refused is not None and refused[0] == "ValueError"
                                      and "swizzled_scales" in refused[1]) or str(refused)
    # a given swizzled buffer keeps its padding (0x55 here) under every algorithm, the fallback included
    padding = {}
    for algo in ("auto", "fallback"):
        buf = torch.full((128, 4), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
        with comm.use_algorithm(algo):
            comm.fused_add_rmsnorm(x, res, w, quant="nvfp4", scale=g, swizzled_scales=True, q_out=torch.empty(
                shape[0], shape[1] // 2, dtype=torch.uint8), scales_out=buf, residual_out=torch.empty_like(x))
        real = swizzle_128x4(torch.ones(shape[0], shape[1] // 16, dtype=torch.uint8)) != 0
        padding[algo] = (bool((buf.view(torch.uint8)[~real] == 0x55).all())
                         and torch.equal(buf.view(torch.uint8)[real], m4[1].view(torch.uint8)[real]))
    got["swizzled_padding_kept"] = all(padding.values()) or str(padding)
    # the out op is not opchecked: its schema test compares the mutated FP8 output with allclose, which
    # torch (2.13, CPU) does not implement for float8
    try:
        torch.library.opcheck(torch.ops.tpcomm.fused_add_rmsnorm_fp8.default,
                              (tops.register(comm), x, res, w, 1e-6, False, "fp8_static", torch.float8_e4m3fn, 128,
                               False, True, scale))
        got["opcheck"] = True
    except Exception:
        got["opcheck"] = traceback.format_exc()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def step(x, res, scale, g):
        q, _, ro, _ = tops.fused_add_rmsnorm(comm, x, res, w, quant="fp8_static", scale=scale)
        q4, s4, _, _ = tops.fused_add_rmsnorm(comm, x, res, w, quant="nvfp4", scale=g, swizzled_scales=True)
        return q, ro, q4, s4

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    with torch.inference_mode():
        cq, cro, cq4, cs4 = compiled(x, res, scale, g)
        got["compiled"] = (same_u8(cq, q) and torch.equal(cro, ro) and same_u8(cq4, m4[0])
                           and same_u8(cs4, m4[1]))
        scale.fill_(0.02)
        g.fill_(900.0)
        cq, _, cq4, cs4 = compiled(x, res, scale, g)
        n4 = nvfp4_quant(out, g, swizzled_scales=True)
        got["compiled_new_value"] = (same_u8(cq, static_quant_fp8(out, scale)) and same_u8(cq4, n4[0])
                                     and same_u8(cs4, n4[1]))
    got["frames"] = counter.frame_count
    return got
