"""The quantised output forms of the fused ops: one :class:`QuantForm` object per ``quant=`` choice, in
one table, :data:`QUANT_FORMS`, which every fused op reads.

A form holds, for an input ``x`` of ``(..., H)``:

* which quant options it takes (``fp8_dtype``, ``group_size``, ``column_major_scales``,
  ``swizzled_scales``, the input ``scale``) and their checks;
* the shapes, dtypes and strides of its outputs ``q`` and ``scales``, the checks of a given ``q_out`` /
  ``scales_out`` against them, and their allocation (:meth:`QuantForm.outputs`, which returns the
  :class:`Fp8Outputs` of the call);
* the epilogue's constexpr (``kernels/epilogue.QUANT_*``) and how the kernels address the scales
  (:meth:`QuantForm.scale_strides`, read by :meth:`Fp8Outputs.launch_args`);
* the standalone op whose bytes the fused form equals (:attr:`QuantForm.standalone`) and the plain-torch
  fill of the fallback (:meth:`QuantForm.fill`, the same bytes).

A fused op calls :func:`fp8_outputs` (the checks every form shares, then the form's) or, without
``quant``, :func:`check_unquantized_call`. A new form is one more object in the table, with its epilogue
in ``kernels/epilogue.py`` and its standalone op and reference beside the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton.language as tl

from ..kernels.epilogue import (
    QUANT_MXFP4,
    QUANT_NVFP4,
    QUANT_PER_GROUP,
    QUANT_PER_GROUP_UE8M0,
    QUANT_PER_TOKEN,
    QUANT_STATIC,
    QuantOut,
)
from ..validate import check_not_negated, check_output, check_tensor
from . import reference
from .standalone import (
    DEFAULT_GROUP_SIZE,
    MAX_GROUP_SIZE,
    check_static_scale,
    group_size_int,
    mxfp4_quant,
    native_fp8_cached,
    nvfp4_quant,
    per_group_quant_fp8,
    per_token_quant_fp8,
    static_quant_fp8,
)

#: FP8 formats the FP8 forms write (e4m3fn: MAX 448; e4m3fnuz: MAX 240).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

_ONLY_GROUPS = ("{op}: column_major_scales applies to the per-group forms only "
                "(quant='fp8_per_group' or 'fp8_per_group_ue8m0')")


@dataclass
class Fp8Outputs:
    """The tensors a quantised fused call returns, and how the kernels address them.

    Attributes:
        q_fp8: ``x``'s shape, ``fp8_dtype``; FP4: ``(..., H / 2)`` uint8, two codes a byte.
        scales_view: float32 scales as returned: ``(..., 1)`` per token, ``(..., H / g)`` per group
            (row-major), or ``(T, H / g)`` as the transpose of a contiguous ``(H / g, T)`` (column-major);
            static: the caller's one-element scale itself (an input, which the kernels only read); FP4:
            the block scales, ``(..., H / block)`` (uint8 E8M0 bytes or e4m3fn) or the zero-padded
            contiguous 128x4 buffer ``(ceil(T / 128) * 128, ceil(H / block / 4) * 4)``.
        mode, fp8_dtype, group_size, column_major, swizzled: the request (``mode``: the form's name).
        in_scale: static FP8's scale or NVFP4's global scale (read by the kernels), else None.
    """

    q_fp8: torch.Tensor
    scales_view: torch.Tensor
    mode: str
    fp8_dtype: torch.dtype
    group_size: int
    column_major: bool
    swizzled: bool = False
    in_scale: torch.Tensor | None = None

    @property
    def form(self) -> "QuantForm":
        return QUANT_FORMS[self.mode]

    def launch_args(self, device: torch.device, store_out: bool) -> QuantOut:
        """The kernels' :class:`~tpcomm.kernels.epilogue.QuantOut` (``store_out``: also write ``out``)."""
        form = self.form
        T = self.q_fp8.numel() // self.q_fp8.shape[-1]
        row_stride, group_stride, group = form.scale_strides(self, T)
        fp8 = tl.float8e4nv if self.fp8_dtype == torch.float8_e4m3fn else tl.float8e4b8
        return QuantOut(self.q_fp8.view(torch.uint8), form.kernel_scales(self), row_stride, group_stride,
                        form.epilogue.value, fp8, native_fp8_cached(device, self.fp8_dtype), group, store_out,
                        self.in_scale)

    def fill_from(self, out: torch.Tensor) -> None:
        """Quantise an unquantised ``out`` into these tensors with the plain-torch reference (the
        fallback path; the same bytes as the kernels)."""
        self.form.fill(self, out.reshape(-1, out.shape[-1]))


@dataclass(frozen=True)
class QuantForm:
    """One ``quant=`` choice of the fused ops (the base of the four kinds below).

    Attributes:
        name: the ``quant=`` string.
        epilogue: the epilogue's constexpr (``kernels/epilogue.QUANT_*``).
        standalone: the standalone op (:mod:`tpcomm.quant.standalone`) whose bytes and scales the fused
            form equals, applied to the unquantised ``out``.
        scale_dtype: dtype of the returned scales (float32; MXFP4 uint8 E8M0 bytes; NVFP4 e4m3fn).
    """

    name: str
    epilogue: object
    standalone: Callable
    scale_dtype: torch.dtype = torch.float32

    def outputs(self, op: str, x: torch.Tensor, fp8_dtype, group_size: int, column_major_scales, q_out,
                scales_out, scale, swizzled_scales: bool) -> Fp8Outputs:
        """Check this form's options for ``x`` (``(..., H)``) and return its outputs: ``q_out`` /
        ``scales_out`` where given (checked against what the call would allocate), new tensors else."""
        raise NotImplementedError

    def scale_strides(self, outs: Fp8Outputs, T: int) -> tuple[int, int, int]:
        """``(row_stride, group_stride, group)`` of :class:`~tpcomm.kernels.epilogue.QuantOut` for
        ``outs`` of ``T`` rows."""
        raise NotImplementedError

    def kernel_scales(self, outs: Fp8Outputs) -> torch.Tensor:
        """The scales tensor as the kernels take it."""
        return outs.scales_view

    def fill(self, outs: Fp8Outputs, rows: torch.Tensor) -> None:
        """Write the bytes and scales of the unquantised ``rows`` (``(T, H)``) into ``outs`` (plain torch)."""
        raise NotImplementedError

    def _fp8_options(self, op: str, scale, swizzled_scales: bool) -> None:
        """What every FP8 form refuses: the FP4 forms' ``swizzled_scales``, and ``scale`` (but static)."""
        if swizzled_scales:
            raise ValueError(f"{op}: swizzled_scales applies to the FP4 forms only (quant='mxfp4' or 'nvfp4')")
        if self.name != "fp8_static" and scale is not None:
            raise ValueError(f"{op}: scale applies to quant='fp8_static' or 'nvfp4' only (quant={self.name!r} "
                             "computes its scales from out)")


def _one_group(op: str, column_major_scales, group_size, why: str) -> None:
    """What a form of one scale a row or tensor refuses: the per-group forms' options (``why`` says why)."""
    if column_major_scales:
        raise ValueError(_ONLY_GROUPS.format(op=op))
    if group_size != DEFAULT_GROUP_SIZE:
        raise ValueError(f"{op}: group_size={group_size!r} applies to the per-group forms only "
                         f"(quant='fp8_per_group' or 'fp8_per_group_ue8m0'; {why})")


@dataclass(frozen=True)
class PerTokenForm(QuantForm):
    """``fp8_per_token``: one float32 scale a row, ``(..., 1)``."""

    def outputs(self, op, x, fp8_dtype, group_size, column_major_scales, q_out, scales_out, scale,
                swizzled_scales):
        self._fp8_options(op, scale, swizzled_scales)
        _one_group(op, column_major_scales, group_size, "per-token scales have one group: the row")
        # rows of no elements launch nothing: their amax is 0, so their scale is 1 (docs/numerics.md item 4)
        scales = _scales(op, x, self.name, fp8_dtype, (*x.shape[:-1], 1), False, q_out, scales_out)
        if x.shape[-1] == 0:
            scales.fill_(1.0)
        return Fp8Outputs(_q(x, fp8_dtype, q_out), scales, self.name, fp8_dtype, 1, False)

    def scale_strides(self, outs, T):
        return 1, 0, 1

    def fill(self, outs, rows):
        q, s = reference.per_token_quant_reference(rows, outs.fp8_dtype)
        outs.q_fp8.view(-1, rows.shape[-1]).copy_(q)
        outs.scales_view.copy_(s.reshape(outs.scales_view.shape))


@dataclass(frozen=True)
class PerGroupForm(QuantForm):
    """``fp8_per_group`` (``ue8m0``: ``fp8_per_group_ue8m0``): a float32 scale per ``group_size`` elements
    of a row, ``(..., H / group_size)`` row-major or, with ``column_major_scales``, the transpose of a
    contiguous ``(H / group_size, T)``."""

    ue8m0: bool = False

    def outputs(self, op, x, fp8_dtype, group_size, column_major_scales, q_out, scales_out, scale,
                swizzled_scales):
        self._fp8_options(op, scale, swizzled_scales)
        if not 1 <= group_size <= MAX_GROUP_SIZE or group_size & (group_size - 1):
            raise ValueError(f"{op}: group_size must be a power of two in [1, {MAX_GROUP_SIZE}] "
                             f"(default {DEFAULT_GROUP_SIZE}), got {group_size!r}")
        H = x.shape[-1]
        if H % group_size:
            raise ValueError(f"{op}: x has H={H} elements per row, not a multiple of group_size={group_size}")
        G = H // group_size
        if column_major_scales and x.dim() != 2:
            raise ValueError(f"{op}: column_major_scales needs a 2-D x (T, H), got shape {tuple(x.shape)}")
        shape = (G, x.shape[0]) if column_major_scales else (*x.shape[:-1], G)
        scales = _scales(op, x, self.name, fp8_dtype, shape, column_major_scales, q_out, scales_out)
        return Fp8Outputs(_q(x, fp8_dtype, q_out), scales, self.name, fp8_dtype, group_size, column_major_scales)

    def scale_strides(self, outs, T):
        if outs.column_major:
            return 1, T, outs.group_size
        return outs.scales_view.shape[-1], 1, outs.group_size

    def fill(self, outs, rows):
        quantise = reference.per_group_ue8m0_quant_reference if self.ue8m0 else reference.per_group_quant_reference
        q, s = quantise(rows, outs.group_size, outs.fp8_dtype)
        outs.q_fp8.view(-1, rows.shape[-1]).copy_(q)
        outs.scales_view.copy_(s.reshape(outs.scales_view.shape))


@dataclass(frozen=True)
class StaticForm(QuantForm):
    """``fp8_static``: one calibrated input ``scale``, which is also the returned scales (no output)."""

    def outputs(self, op, x, fp8_dtype, group_size, column_major_scales, q_out, scales_out, scale,
                swizzled_scales):
        self._fp8_options(op, scale, swizzled_scales)
        _one_group(op, column_major_scales, group_size, "fp8_static has one scale")
        check_static_scale(op, x, scale)
        if scales_out is not None:
            raise ValueError(f"{op}: scales_out does not apply to quant='fp8_static' (its scale is the input "
                             "scale, returned as it is)")
        if q_out is not None:
            check_fp8_outputs(op, x, self.name, q_out, None, None, fp8_dtype, x.device)
        return Fp8Outputs(_q(x, fp8_dtype, q_out), scale, self.name, fp8_dtype, 1, False, in_scale=scale)

    def scale_strides(self, outs, T):
        return 0, 0, 1  # no output scales

    def fill(self, outs, rows):  # no scale to write: it is the input
        outs.q_fp8.view(-1, rows.shape[-1]).copy_(reference.static_fp8_bytes(rows, outs.scales_view, outs.fp8_dtype))


@dataclass(frozen=True)
class Fp4Form(QuantForm):
    """``mxfp4`` / ``nvfp4``: E2M1 codes two a byte, ``(..., H / 2)`` uint8, and a scale per ``block``
    elements, ``(..., H / block)`` or the 128x4 swizzled buffer; NVFP4 (``global_scale``) takes its global
    scale as ``scale``."""

    block: int = 32
    global_scale: bool = False

    def outputs(self, op, x, fp8_dtype, group_size, column_major_scales, q_out, scales_out, scale,
                swizzled_scales):
        quant = self.name
        for name, bad in (("fp8_dtype", fp8_dtype != torch.float8_e4m3fn),
                          ("group_size", group_size != DEFAULT_GROUP_SIZE),
                          ("column_major_scales", column_major_scales)):
            if bad:
                raise ValueError(f"{op}: {name} applies to the FP8 forms only (quant={quant!r} has blocks of "
                                 f"{self.block} and its own scale format)")
        if self.global_scale:
            check_static_scale(op, x, scale, quant)
        elif scale is not None:
            raise ValueError(f"{op}: scale applies to quant='fp8_static' or 'nvfp4' only (quant={quant!r} computes "
                             "its scales from out)")
        H = x.shape[-1]
        if H % self.block:
            raise ValueError(f"{op}: x has H={H} elements per row, not a multiple of {quant}'s block size "
                             f"{self.block}")
        if swizzled_scales and x.dim() != 2:
            raise ValueError(f"{op}: swizzled_scales needs a 2-D x (T, H), got shape {tuple(x.shape)}")
        q_shape = (*x.shape[:-1], H // 2)
        if swizzled_scales:
            T, C = x.shape[0], H // self.block
            s_shape = (-(-T // 128) * 128, -(-C // 4) * 4)
        else:
            s_shape = (*x.shape[:-1], H // self.block)
        if q_out is not None or scales_out is not None:
            check_fp8_outputs(op, x, quant, q_out, scales_out,
                              torch.empty(s_shape, dtype=self.scale_dtype, device="meta"), torch.uint8, x.device,
                              q_shape)
        q = q_out if q_out is not None else torch.empty(q_shape, dtype=torch.uint8, device=x.device)
        if scales_out is not None:
            scales = scales_out
        else:  # the swizzled buffer's padding is zero (only the real scales are written)
            scales = (torch.zeros if swizzled_scales else torch.empty)(s_shape, dtype=self.scale_dtype,
                                                                       device=x.device)
        return Fp8Outputs(q, scales, quant, fp8_dtype, self.block, False, swizzled_scales,
                          scale if self.global_scale else None)

    def scale_strides(self, outs, T):
        # group 1: linear scales; 0: swizzled (kernels/epilogue.fp4_row)
        return (0, 0, 0) if outs.swizzled else (outs.scales_view.shape[-1], 1, 1)

    def kernel_scales(self, outs):
        return outs.scales_view.view(torch.uint8) if self.global_scale else outs.scales_view

    def fill(self, outs, rows):
        if self.global_scale:
            q, s = reference.nvfp4_quant_unchecked(rows, outs.in_scale)
        else:
            q, s = reference.mxfp4_quant_reference(rows)
        outs.q_fp8.view(-1, q.shape[-1]).copy_(q)
        if outs.swizzled:  # only the real scales' bytes: a given buffer keeps its padding, as the kernels leave it
            dst = outs.scales_view.view(torch.uint8)
            real = reference.swizzle_128x4(torch.ones(s.shape, dtype=torch.uint8, device=s.device)) != 0
            dst[real] = reference.swizzle_128x4(s).view(torch.uint8)[real]
        else:
            outs.scales_view.copy_(s.reshape(outs.scales_view.shape))


#: Every ``quant=`` choice of the fused ops, by name, in the order the docs list them.
QUANT_FORMS: dict[str, QuantForm] = {f.name: f for f in (
    PerTokenForm("fp8_per_token", QUANT_PER_TOKEN, per_token_quant_fp8),
    PerGroupForm("fp8_per_group", QUANT_PER_GROUP, per_group_quant_fp8),
    PerGroupForm("fp8_per_group_ue8m0", QUANT_PER_GROUP_UE8M0, per_group_quant_fp8, ue8m0=True),
    StaticForm("fp8_static", QUANT_STATIC, static_quant_fp8),
    Fp4Form("mxfp4", QUANT_MXFP4, mxfp4_quant, torch.uint8, block=32),
    Fp4Form("nvfp4", QUANT_NVFP4, nvfp4_quant, torch.float8_e4m3fn, block=16, global_scale=True),
)}
#: ``quant`` choices of the fused ops.
QUANT_MODES = tuple(QUANT_FORMS)
#: The per-group forms (they take ``group_size`` and ``column_major_scales``).
GROUP_MODES = tuple(n for n, f in QUANT_FORMS.items() if isinstance(f, PerGroupForm))
#: The FP4 forms, their block sizes and scale dtypes (they take ``swizzled_scales``; nvfp4 its global
#: scale as ``scale``).
FP4_BLOCKS = {n: (f.block, f.scale_dtype) for n, f in QUANT_FORMS.items() if isinstance(f, Fp4Form)}


def fp8_outputs(op: str, x: torch.Tensor, quant: str, fp8_dtype: torch.dtype, group_size: int,
                column_major_scales: bool, q_out: torch.Tensor | None = None,
                scales_out: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                swizzled_scales: bool = False) -> Fp8Outputs:
    """Validate the quant arguments of ``op`` for input ``x`` (``(..., H)``) and allocate the outputs, or
    take ``q_out`` / ``scales_out`` where the caller gives them (checked by :func:`check_fp8_outputs`
    against the layout this call would allocate): the checks every form shares, then the form's
    (:meth:`QuantForm.outputs`). ``scale``: the input scale of ``quant='fp8_static'``
    (:func:`~tpcomm.quant.check_static_scale`), which the result returns as its scales, or NVFP4's global
    scale. ``swizzled_scales``: the FP4 forms' 128x4 scale layout (2-D ``x``); a given ``scales_out`` in
    that layout has its padding left as it is.

    Raises:
        ValueError: ``quant`` or ``fp8_dtype`` is not a supported choice, ``group_size`` is not a power
            of two in [1, 8192] or does not divide H (the message names both numbers), or
            ``column_major_scales`` is asked for per-token or static scales or a non-2-D ``x``, or a
            ``group_size`` other than the default is passed with per-token or static scales; ``scale`` is
            given with another form than ``fp8_static`` or ``nvfp4``, or these have no valid ``scale``,
            or ``fp8_static`` is given ``scales_out``; an FP4 form with H not a multiple of its block,
            another ``fp8_dtype``, ``group_size`` or ``column_major_scales``; ``swizzled_scales`` with
            another form or a non-2-D ``x``.
        TypeError: ``scale`` is not a float32 tensor; ``swizzled_scales`` is not a bool; ``group_size``
            is not an int.
    """
    form = QUANT_FORMS.get(quant) if isinstance(quant, str) else None
    if form is None:
        raise ValueError(f"{op}: quant must be None or one of {QUANT_MODES}, got {quant!r}")
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"{op}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {fp8_dtype}")
    if not isinstance(swizzled_scales, bool):
        raise TypeError(f"{op}: swizzled_scales must be a bool (Python's True or False), got "
                        f"{type(swizzled_scales).__name__}")
    group_size = group_size_int(op, group_size)
    return form.outputs(op, x, fp8_dtype, group_size, column_major_scales, q_out, scales_out, scale,
                        swizzled_scales)


def check_unquantized_call(op: str, fp8_dtype, group_size, column_major_scales, emit_unquantized,
                           scale=None, swizzled_scales=False) -> None:
    """A call without ``quant`` takes none of the quant options (they would be ignored).

    Raises:
        ValueError: ``emit_unquantized``, ``column_major_scales`` or ``swizzled_scales`` is set, ``scale``
            is given, or ``group_size`` / ``fp8_dtype`` differs from its default.
        TypeError: ``group_size`` is not an int.
    """
    if scale is not None:
        raise ValueError(f"{op}: scale needs quant='fp8_static' or 'nvfp4' (without a quant form it would be "
                         "ignored)")
    if swizzled_scales:
        raise ValueError(f"{op}: swizzled_scales needs quant='mxfp4' or 'nvfp4' (without a quant form it would "
                         "be ignored)")
    if (emit_unquantized or column_major_scales or group_size_int(op, group_size) != DEFAULT_GROUP_SIZE
            or fp8_dtype != torch.float8_e4m3fn):
        raise ValueError(f"{op}: emit_unquantized, column_major_scales, group_size and fp8_dtype need "
                         "a quant form (emit_unquantized any of quant='fp8_per_token', 'fp8_per_group', "
                         "'fp8_per_group_ue8m0', 'fp8_static', 'mxfp4' or 'nvfp4'; column_major_scales and "
                         "group_size a per-group one; fp8_dtype an FP8 one; without it they would be ignored)")


def check_fp8_outputs(op: str, x, quant, q_out, scales_out, expected_scales: torch.Tensor | None,
                      fp8_dtype, device: torch.device, q_shape: tuple | None = None) -> None:
    """``q_out`` and ``scales_out`` given to a fused op: only with ``quant``; ``q_out`` contiguous in
    ``fp8_dtype`` shaped like ``x`` (or ``q_shape``: FP4's packed bytes, ``fp8_dtype`` then uint8);
    ``scales_out`` with the dtype, shape and strides of the scales the call would return
    (``expected_scales``)."""
    if quant is None:
        if q_out is not None or scales_out is not None:
            raise ValueError(f"{op}: q_out and scales_out need quant= (one of {', '.join(QUANT_MODES)})")
        return
    if q_out is not None:
        check_output(op, "q_out", q_out, x.shape if q_shape is None else q_shape, fp8_dtype, device)
    if scales_out is not None:
        check_tensor(op, "scales_out", scales_out, device)
        check_not_negated(op, "scales_out", scales_out)
        shape, strides = tuple(expected_scales.shape), expected_scales.stride()
        if scales_out.dtype != expected_scales.dtype or tuple(scales_out.shape) != shape:
            raise ValueError(f"{op}: scales_out has shape {tuple(scales_out.shape)} and dtype {scales_out.dtype}; "
                             f"expected {shape} and {expected_scales.dtype}")
        if any(st != want for st, want, n in zip(scales_out.stride(), strides, shape) if n > 1):
            why = " (column_major_scales decides the layout)" if quant != "fp8_per_token" else " (row-major)"
            raise ValueError(f"{op}: scales_out has strides {tuple(scales_out.stride())}; expected {strides}{why}")


def _q(x: torch.Tensor, fp8_dtype: torch.dtype, q_out: torch.Tensor | None) -> torch.Tensor:
    return q_out if q_out is not None else torch.empty(x.shape, dtype=fp8_dtype, device=x.device)


def _scales(op: str, x, quant: str, fp8_dtype, shape: tuple, transposed: bool, q_out, scales_out) -> torch.Tensor:
    """The scales of a call: ``scales_out`` checked against the layout allocated here (``shape``, its
    transpose with ``transposed``), or a new tensor of it."""
    if q_out is None and scales_out is None:
        scales = torch.empty(shape, dtype=torch.float32, device=x.device)
        return scales.t() if transposed else scales
    expected = torch.empty(shape, dtype=torch.float32, device="meta")
    check_fp8_outputs(op, x, quant, q_out, scales_out, expected.t() if transposed else expected, fp8_dtype,
                      x.device)
    if scales_out is not None:
        return scales_out
    scales = torch.empty(shape, dtype=torch.float32, device=x.device)
    return scales.t() if transposed else scales
