"""``fused_add_rmsnorm``: all-reduce ``x``, add ``residual``, RMSNorm, and optionally quantise ``out``, in
one kernel.

Plain torch::

    s = all_reduce(x); residual_out = s + residual
    out = residual_out * rsqrt(mean(residual_out ** 2) + eps) * w          # 1 + w with gemma
    q, scales = per_token_quant_fp8(out)                                    # with quant=, the form's op

with the numerics contract (docs/numerics.md items 1-4): the same bits on every rank, for every algorithm
and number of rows.

Host path: check the inputs -> check the given outputs, make the quantised ones (the quant form,
:mod:`tpcomm.quant.forms`) -> ask dispatch for the plan (which also says whether the kernels write
``out``: :meth:`~tpcomm.dispatch.Plan.skips_out`) -> make ``out`` and ``residual_out``, refuse overlaps
-> launch the row kernels, or fall back to ``torch.distributed``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .. import call_cache, dispatch, reference
from ..quant import DEFAULT_GROUP_SIZE, Fp8Outputs, check_fp8_outputs, check_unquantized_call, fp8_outputs
from ..validate import check_output, check_tensor, overlapping, type_name
from .fallback import fall_back

OP = "fused_add_rmsnorm"
#: The largest finite float32 (``eps`` is added in float32).
FLOAT32_MAX = 3.4028234663852886e38


def fused_add_rmsnorm(comm, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float = 1e-6, gemma: bool = False, quant: str | None = None,
                      fp8_dtype: torch.dtype = torch.float8_e4m3fn, group_size: int = DEFAULT_GROUP_SIZE,
                      column_major_scales: bool = False, emit_unquantized: bool = False, *,
                      scale: torch.Tensor | None = None, swizzled_scales: bool = False,
                      out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                      q_out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None, key=None):
    """All-reduce ``x``, add ``residual``, RMSNorm — in one kernel (``comm.fused_add_rmsnorm(...)``).

    Plain torch: ``s = all_reduce(x); residual_out = s + residual;
    out = residual_out * rsqrt(mean(residual_out^2) + eps) * w`` (``w`` replaced by ``1 + w`` when
    ``gemma``), with the numerics contract (docs/numerics.md).

    Collective: every rank calls it with the same shapes, dtypes, ``eps`` and ``gemma``.

    Args:
        comm: the :class:`~tpcomm.Communicator`.
        x: ``(T, H)`` (or ``(..., H)``: leading dims are flattened), bf16 / fp16 / fp32, this device.
        residual: like ``x`` (same shape and dtype), or None for the no-residual form.
        weight: ``(H,)`` norm weight, any float dtype (used as ``f32(w)``; typically the input's or
            float32).
        eps: >= 0, added to the mean square.
        gemma: use ``1 + w`` (Gemma-style norms).
        quant: None, or one of ``"fp8_per_token"``, ``"fp8_per_group"``, ``"fp8_per_group_ue8m0"``,
            ``"fp8_static"`` (FP8), ``"mxfp4"``, ``"nvfp4"`` (FP4): also quantise ``out`` in the same
            kernel. The per-token and per-group FP8 forms (docs/numerics.md item 4):
            ``scale = amax / MAX`` over the row (or group) of the rounded ``out`` (1 where that is 0;
            with ``_ue8m0`` rounded up to a power of two), ``q = fp8(out / scale)`` saturated to +-MAX;
            the bytes and scales equal :func:`tpcomm.quant.per_token_quant_fp8` /
            :func:`~tpcomm.quant.per_group_quant_fp8` (``ue8m0=True`` for the third form) applied to
            the unquantised ``out``. ``"fp8_static"``: one calibrated ``scale`` for the whole tensor,
            ``q = fp8(out * f32(1 / scale))`` (docs/numerics.md, "Static per-tensor FP8"), the bytes
            of :func:`tpcomm.quant.static_quant_fp8` applied to ``out``. ``"mxfp4"`` / ``"nvfp4"``:
            E2M1 codes packed two to a byte with a scale per block of 32 (E8M0) or 16 (e4m3fn, from
            the global ``scale``), the bytes and scales of :func:`tpcomm.quant.mxfp4_quant` (the
            spec's ``"floor"`` rule) / :func:`~tpcomm.quant.nvfp4_quant` applied to ``out``
            (docs/numerics.md, "MXFP4", "NVFP4"); H a multiple of the block.
        fp8_dtype: the FP8 forms only: ``torch.float8_e4m3fn`` (MAX 448) or ``torch.float8_e4m3fnuz``
            (MAX 240).
        group_size: elements per scale of the per-group forms (default 128, DeepSeek-V3's 1 x 128);
            a power of two that divides H. Another value with ``fp8_per_token`` raises ValueError.
        column_major_scales: the per-group forms only, ``x`` 2-D: return the scales as the transpose
            view of a contiguous ``(H / group_size, T)`` tensor (the layout grouped GEMMs read).
        emit_unquantized: with ``quant``, also return ``out`` in the input dtype.
        scale: with ``quant="fp8_static"`` (the calibrated scale) or ``"nvfp4"`` (the global scale,
            TensorRT-LLM's ``448 * 6 / amax``) only, and then required: float32 tensor of one element
            (shape ``()``, ``(1,)`` or ``(1, 1)``) on this device, finite and positive (a static one
            also more than 2**-128, so that its float32 reciprocal is finite), the same on every rank;
            read by the kernel, so a CUDA graph replays with its current value. Its
            value is checked on CPU only (a CUDA scale is not read on the host: a bad one gives NaN,
            zero or saturated bytes).
        swizzled_scales: the FP4 forms only, ``x`` 2-D: return the block scales in the 128x4 layout
            of SM100 FP4 GEMMs (a zero-padded contiguous ``(ceil(T / 128) * 128, ceil(H / block /
            4) * 4)`` tensor, :func:`tpcomm.reference.swizzle_128x4`); a given ``scales_out`` keeps
            its padding as it is.
        out, residual_out: where to write ``out`` and ``residual_out`` instead of new tensors:
            contiguous, ``x``'s shape and dtype; ``residual_out`` may be ``residual`` itself (the
            residual updated in place, as engines call ``fused_add_rms_norm``). With ``quant``,
            ``out`` needs ``emit_unquantized``.
        q_out, scales_out: with ``quant``, where to write ``q`` and the scales: contiguous, the shape
            and dtype this call would return (FP8: ``x``'s shape in ``fp8_dtype``; FP4: ``(..., H / 2)``
            uint8), the scales also with its strides (FP8: float32; MXFP4: uint8; NVFP4:
            ``torch.float8_e4m3fn``; none with ``fp8_static``). No given output may share memory with
            an input or another output.
        key: the call's key in the communicator's call cache (:mod:`tpcomm.call_cache`), under which its
            launches are recorded; None records nothing. The communicator's method passes it.
    Returns:
        Without ``quant``: ``(out, residual_out)``, shaped like ``x`` (the given tensors, or new ones);
        ``residual_out`` is None without a residual. With ``quant``: ``(q, scales, residual_out,
        out)``: ``q`` shaped like ``x`` in ``fp8_dtype``; ``scales`` float32 ``(..., 1)`` per token
        or ``(..., H / group_size)`` per group, ``scale`` itself (the same object) for
        ``fp8_static``; FP4: ``q`` ``(..., H / 2)`` uint8 and the block scales, uint8 E8M0 bytes
        (MXFP4) or ``torch.float8_e4m3fn`` (NVFP4), ``(..., H / block)`` or swizzled; ``out`` None
        unless ``emit_unquantized``. Identical
        bits on every rank, for every algorithm. Safe in CUDA graphs. Messages larger than
        ``max_bytes`` run in chunks of rows.
    Raises:
        TypeError: a tensor argument is not a tensor or has an unsupported dtype.
        TypeError: ``gemma``, ``emit_unquantized``, ``column_major_scales`` or ``swizzled_scales`` is
            not a bool; ``group_size`` is not an int; ``scale`` is not a float32 tensor.
        ValueError: shapes disagree (x vs residual vs weight), a tensor is on another device,
            ``eps`` is negative or not finite (TypeError if it is not a number), a quant argument
            is invalid (unknown ``quant`` or ``fp8_dtype``, H not a multiple of ``group_size``, ``scale``
            missing, of more than one element, on another device or, on CPU, not finite and positive,
            ``scale`` without ``fp8_static`` or ``nvfp4``, ``scales_out`` with ``fp8_static``), or a
            given output has the wrong shape, dtype or layout, is a lazily negated view, or overlaps an
            input or another output.
        PeerTimeoutError: a peer did not arrive within the timeout (this or an earlier call).
    """
    comm._check_open(OP)
    eps, residual, weight, qout, plan = check_call(
        comm, OP, x, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales,
        emit_unquantized, scale, swizzled_scales, out, residual_out, q_out, scales_out)
    x = x.resolve_neg()  # a lazily negated view made real (as all_reduce)
    outs = FusedOutputs.make(x, residual, weight, scale, plan, qout, emit_unquantized, out, residual_out,
                             q_out, scales_out)
    if x.numel() == 0:
        return outs.result()
    if plan.algorithm == "fallback":
        # what the kernels' signatures hold (column_major_scales and emit_unquantized may differ)
        call = (tuple(x.shape), str(x.dtype), residual is None, eps, gemma, quant, str(fp8_dtype), group_size,
                swizzled_scales)
        fall_back(comm, OP, call, lambda: outs.fill(reference.fused_add_rmsnorm_reference(
            x, residual, weight, eps, gemma, comm.group)))
        return outs.result()
    _launch(comm, plan, x, residual, weight, outs, eps, gemma, scale, swizzled_scales, key)
    return outs.result()


def check_call(comm, op: str, x, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales,
               emit_unquantized, scale, swizzled_scales, out, residual_out, q_out, scales_out):
    """The fused norm's checks of a call whose rows are shaped like ``x`` (``x`` itself, or a stand-in of
    its shape, dtype and device), its quantised outputs and its plan: ``(eps, residual, weight, quant
    outputs or None, plan or None)``, ``residual`` and ``weight`` with a lazily negated view made real;
    no plan for an empty ``x``."""
    eps = check_fused_inputs(op, x, residual, weight, eps, gemma, emit_unquantized, column_major_scales, comm.device)
    weight = weight.resolve_neg()
    if residual is not None and residual.is_neg():
        residual = residual.resolve_neg()
    if quant is None:
        check_unquantized_call(op, fp8_dtype, group_size, column_major_scales, emit_unquantized, scale,
                               swizzled_scales)
    check_fused_outputs(op, x, residual, weight, quant, emit_unquantized, out, residual_out, comm.device)
    qout = quant_outputs(comm, op, x, quant, fp8_dtype, group_size, column_major_scales, q_out, scales_out, scale,
                         swizzled_scales)
    plan = comm.plan(OP, x.numel() * x.element_size(), x.shape[-1], x.dtype) if x.numel() else None
    return eps, residual, weight, qout, plan


def quant_outputs(comm, op: str, x, quant, fp8_dtype, group_size, column_major_scales, q_out, scales_out, scale,
                  swizzled_scales) -> Fp8Outputs | None:
    """The quantised outputs of the call, checked and made by its quant form (:func:`~tpcomm.quant.fp8_outputs`),
    or None without ``quant`` (which then takes no ``q_out`` / ``scales_out``)."""
    if quant is None:
        check_fp8_outputs(op, x, None, q_out, scales_out, None, fp8_dtype, comm.device)
        return None
    return fp8_outputs(op, x, quant, fp8_dtype, group_size, column_major_scales, q_out, scales_out, scale,
                       swizzled_scales)


@dataclass
class FusedOutputs:
    """The outputs of one call and the contiguous inputs the kernels read.

    Attributes:
        out, residual_out: ``x``'s shape and dtype (``residual_out`` None without a residual); ``out`` is
            ``residual_out`` itself where the plan skips ``out`` (:meth:`~tpcomm.dispatch.Plan.skips_out`).
        quant: the quantised outputs (:class:`~tpcomm.quant.Fp8Outputs`), or None.
        emit_unquantized: the call returns ``out`` beside the quantised outputs.
        written: ``(out, residual_out, q, scales)`` as the kernels write them (``out`` None where skipped,
            ``scales`` None for static FP8, whose scales are its input), without the last two when
            unquantised: what a given output may not overlap, and what a repeat allocates.
        given: the outputs the caller passed, in the same order (None where not passed).
        xc, rc, wc: ``x``, ``residual`` and ``weight`` as the kernels read them (contiguous); ``xc`` None
            where the caller names what the kernels read in its place (``reads``: the MoE finalize's
            inputs).
    """

    out: torch.Tensor
    residual_out: torch.Tensor | None
    quant: Fp8Outputs | None
    emit_unquantized: bool
    written: tuple
    given: tuple
    xc: torch.Tensor | None
    rc: torch.Tensor | None
    wc: torch.Tensor

    @staticmethod
    def make(x, residual, weight, scale, plan, qout, emit_unquantized, out, residual_out, q_out, scales_out,
             op: str = OP, reads: dict | None = None) -> "FusedOutputs":
        """New ``out`` and ``residual_out`` where not given (none for an ``out`` the plan skips); raises
        ValueError when a given output shares bytes with an input or another output (``residual_out``
        may be ``residual`` itself). ``x`` gives the outputs' shape, dtype and device. ``reads``: the
        inputs the kernels read ahead of ``residual``, ``weight`` and ``scale``, by name, in place of
        ``x`` (the MoE finalize's); ``op`` names the call in the message."""
        quantised_only = qout is not None and not emit_unquantized and residual is not None
        no_out = plan is not None and plan.skips_out(quantised_only)
        static = qout is not None and qout.mode == "fp8_static"  # its scales are the input scale
        given = (out, residual_out) + ((q_out, scales_out) if qout is not None else ())
        if residual_out is None and residual is not None:
            residual_out = call_cache.new_like(x)
        if out is None:
            out = residual_out if no_out else call_cache.new_like(x)
        written = (None if no_out else out, residual_out) + ((qout.q_fp8, None if static else qout.scales_view)
                                                             if qout is not None else ())
        # the kernels read x, residual, weight and a static scale in place: a given output may not share
        # their bytes (residual_out may be residual itself)
        xc = x.contiguous() if reads is None else None
        rc, wc = residual.contiguous() if residual is not None else None, weight.contiguous()
        reads = {"x": xc} if reads is None else reads
        if any(t is not None for t in given):
            clash = overlapping(written, tuple(reads.values()) + (rc, wc, scale), allowed=((1, len(reads)),))
            if clash is not None:
                names = ("out", "residual_out", "q_out", "scales_out")
                other = tuple(reads) + ("residual", "weight", "scale") + names
                raise ValueError(f"{op}: {names[clash[0]]} shares memory with {other[clash[1]]}; outputs may "
                                 "overlap no input and no other output (residual_out may be residual itself)")
        return FusedOutputs(out, residual_out, qout, emit_unquantized, written, given, xc, rc, wc)

    def result(self) -> tuple:
        """What the call returns: ``(out, residual_out)``, or ``(q, scales, residual_out, out)`` with
        ``quant`` (``out`` None unless ``emit_unquantized``)."""
        if self.quant is None:
            return self.out, self.residual_out
        return self.quant.q_fp8, self.quant.scales_view, self.residual_out, (self.out if self.emit_unquantized
                                                                             else None)

    def fill(self, reference_outputs: tuple) -> None:
        """Write the fallback's ``(out, residual_out)`` (and the quantised outputs of ``out``)."""
        o, ro = reference_outputs
        self.out.copy_(o)
        if self.residual_out is not None:
            self.residual_out.copy_(ro)
        if self.quant is not None:
            self.quant.fill_from(self.out)


def _launch(comm, plan: dispatch.Plan, x, residual, weight, outs: FusedOutputs, eps: float, gemma: bool, scale,
            swizzled_scales: bool, key) -> None:
    """The row kernels of ``plan`` over the rows of ``x`` (as ``outs.xc``); records the launches under
    ``key`` (when they took the caller's own tensors: :func:`tpcomm.call_cache.record`)."""
    H, qout = x.shape[-1], outs.quant
    launch_quant = qout.launch_args(comm.device, outs.emit_unquantized) if qout else None
    # contiguous, any number of dimensions: the kernels take flat pointers (_run_rows flattens a tensor
    # only to cut it into launches)
    launched = [] if key is not None else None
    comm._run_rows(OP, plan, outs.xc, outs.out, outs.rc, outs.residual_out, outs.wc, x.numel() // H, H, eps,
                   norm=True, gemma=gemma, quant=launch_quant, record=launched)
    if launched is None:
        return
    tensors = (x, residual, weight, outs.out, outs.residual_out, launch_quant and launch_quant.q,
               launch_quant and launch_quant.scales, scale)
    passed = tuple(g is not None for g in outs.given) + (False,) * (4 - len(outs.given))
    spec = call_cache.fused_spec(tensors, (outs.written + (None, None))[:4], passed, qout and qout.mode,
                                 outs.emit_unquantized, swizzled_scales, comm._cuda)
    comm._remember(key, launched, tensors, spec)


def check_fused_inputs(op: str, x, residual, weight, eps, gemma, emit_unquantized, column_major_scales,
                       device: torch.device) -> float:
    """The inputs of ``fused_add_rmsnorm``; returns ``eps`` as a float (``-0.0`` as ``+0.0``: one
    signature for the same sum)."""
    check_tensor(op, "x", x, device)
    if x.dtype not in dispatch.KERNEL_DTYPES:
        raise TypeError(f"{op}: x has dtype {x.dtype}; expected bfloat16, float16 or float32")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dimension (..., H), got a scalar")
    H = x.shape[-1]
    if residual is not None:
        check_tensor(op, "residual", residual, device)
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"{op}: residual has dtype {residual.dtype} but x has {x.dtype}")
    check_tensor(op, "weight", weight, device)
    if weight.shape != (H,):
        raise ValueError(f"{op}: weight has shape {tuple(weight.shape)}; expected ({H},) to match x's last "
                         "dimension")
    if not weight.is_floating_point():
        raise TypeError(f"{op}: weight has dtype {weight.dtype}; expected a float dtype")
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):  # numpy scalars included
        raise TypeError(f"{op}: eps must be a real number, got {type_name(eps)}")
    try:
        eps = float(eps) + 0.0
    except OverflowError:  # an int beyond float64
        raise ValueError(f"{op}: eps must be >= 0 and finite in float32 (<= {FLOAT32_MAX:.4g}), got an integer "
                         "beyond float64") from None
    if not 0.0 <= eps <= FLOAT32_MAX:  # the kernels add it in float32
        raise ValueError(f"{op}: eps must be >= 0 and finite in float32 (<= {FLOAT32_MAX:.4g}), got {eps}")
    for name, flag in (("gemma", gemma), ("emit_unquantized", emit_unquantized),
                       ("column_major_scales", column_major_scales)):
        if not isinstance(flag, bool):
            raise TypeError(f"{op}: {name} must be a bool (Python's True or False), got {type_name(flag)}")
    return eps


def check_fused_outputs(op: str, x, residual, weight, quant, emit_unquantized, out, residual_out,
                        device: torch.device) -> None:
    """``out`` and ``residual_out`` given to ``fused_add_rmsnorm``: contiguous, ``x``'s shape and dtype;
    ``residual_out`` only with a residual, and may be ``residual`` itself (in place); ``out`` with
    ``quant`` only with ``emit_unquantized``. Neither may share bytes with an input or the other."""
    if out is not None:
        if quant is not None and not emit_unquantized:
            raise ValueError(f"{op}: out with quant={quant!r} needs emit_unquantized=True (otherwise no "
                             "unquantised output is written)")
        check_output(op, "out", out, x.shape, x.dtype, device)
    if residual_out is not None:
        if residual is None:
            raise ValueError(f"{op}: residual_out needs a residual (without one there is no residual output)")
        check_output(op, "residual_out", residual_out, x.shape, x.dtype, device)
