"""The FP8 outputs of ``Communicator.fused_add_rmsnorm(..., quant=...)``: validation, allocation, the
kernels' view of them, and the fallback's fill (docs/numerics.md, item 4)."""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import torch

from . import reference
from .kernels.epilogue import QUANT_PER_GROUP, QUANT_PER_TOKEN, QuantOut
from .quant import DEFAULT_GROUP_SIZE, MAX_GROUP_SIZE, native_fp8
from .validate import check_fp8_outputs

#: ``quant`` choices of ``fused_add_rmsnorm``.
QUANT_MODES = ("fp8_per_token", "fp8_per_group")
#: FP8 formats and their Triton types (e4m3fn: MAX 448; e4m3fnuz: MAX 240).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


@dataclass
class Fp8Outputs:
    """The tensors a quantised fused call returns, and how the kernels address them.

    Attributes:
        q_fp8: ``x``'s shape, ``fp8_dtype``.
        scales_view: float32 scales as returned: ``(..., 1)`` per token, ``(..., H / g)`` per group
            (row-major), or ``(T, H / g)`` as the transpose of a contiguous ``(H / g, T)`` (column-major).
        mode, fp8_dtype, group_size, column_major: the request.
    """

    q_fp8: torch.Tensor
    scales_view: torch.Tensor
    mode: str
    fp8_dtype: torch.dtype
    group_size: int
    column_major: bool

    def launch_args(self, device: torch.device, store_out: bool) -> QuantOut:
        """The kernels' :class:`~tpcomm.kernels.epilogue.QuantOut` (``store_out``: also write ``out``)."""
        import triton.language as tl

        T = self.q_fp8.numel() // self.q_fp8.shape[-1]
        if self.mode == "fp8_per_token":
            row_stride, group_stride, group = 1, 0, 1
        elif self.column_major:
            row_stride, group_stride, group = 1, T, self.group_size
        else:
            row_stride, group_stride, group = self.scales_view.shape[-1], 1, self.group_size
        mode = QUANT_PER_TOKEN.value if self.mode == "fp8_per_token" else QUANT_PER_GROUP.value
        fp8 = tl.float8e4nv if self.fp8_dtype == torch.float8_e4m3fn else tl.float8e4b8
        return QuantOut(self.q_fp8.view(torch.uint8), self.scales_view, row_stride, group_stride,
                        mode, fp8, _native_fp8(device, self.fp8_dtype), group, store_out)

    def fill_from(self, out: torch.Tensor) -> None:
        """Quantise an unquantised ``out`` into these tensors with the plain-torch reference (the
        fallback path; the same bytes as the kernels)."""
        rows = out.reshape(-1, out.shape[-1])
        if self.mode == "fp8_per_token":
            q, s = reference.per_token_quant_reference(rows, self.fp8_dtype)
        else:
            q, s = reference.per_group_quant_reference(rows, self.group_size, self.fp8_dtype)
        self.q_fp8.view(-1, out.shape[-1]).copy_(q)
        self.scales_view.copy_(s.reshape(self.scales_view.shape))


@functools.lru_cache(maxsize=64)
def _native_fp8(device: torch.device, fp8_dtype: torch.dtype) -> bool:
    return native_fp8(device, fp8_dtype)  # asks the device once (it was a tenth of a call's host time)


def check_unquantized_call(op: str, fp8_dtype, group_size, column_major_scales, emit_unquantized) -> None:
    """A call without ``quant`` takes none of the FP8 options (they would be ignored).

    Raises:
        ValueError: ``emit_unquantized`` or ``column_major_scales`` is set, or ``group_size`` /
            ``fp8_dtype`` differs from its default.
    """
    if (emit_unquantized or column_major_scales or group_size != DEFAULT_GROUP_SIZE
            or fp8_dtype != torch.float8_e4m3fn):
        raise ValueError(f"{op}: emit_unquantized, column_major_scales, group_size and fp8_dtype need "
                         "quant='fp8_per_token' or 'fp8_per_group' (without quant they would be ignored)")


def fp8_outputs(op: str, x: torch.Tensor, quant: str, fp8_dtype: torch.dtype, group_size: int,
                column_major_scales: bool, q_out: torch.Tensor | None = None,
                scales_out: torch.Tensor | None = None) -> Fp8Outputs:
    """Validate the quant arguments of ``op`` for input ``x`` (``(..., H)``) and allocate the outputs, or
    take ``q_out`` / ``scales_out`` where the caller gives them (checked by
    :func:`tpcomm.validate.check_fp8_outputs` against the layout this call would allocate).

    Raises:
        ValueError: ``quant`` or ``fp8_dtype`` is not a supported choice, ``group_size`` is not a power
            of two in [1, 8192] or does not divide H (the message names both numbers), or
            ``column_major_scales`` is asked for per-token scales or a non-2-D ``x``, or a ``group_size``
            other than the default is passed with per-token scales.
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"{op}: quant must be None or one of {QUANT_MODES}, got {quant!r}")
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"{op}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {fp8_dtype}")
    H = x.shape[-1]
    lead = x.shape[:-1]
    if quant == "fp8_per_token":
        if column_major_scales:
            raise ValueError(f"{op}: column_major_scales applies to quant='fp8_per_group' only")
        if group_size != DEFAULT_GROUP_SIZE:
            raise ValueError(f"{op}: group_size={group_size!r} applies to quant='fp8_per_group' only (per-token "
                             "scales have one group: the row)")
        # rows of no elements launch nothing: their amax is 0, so their scale is 1 (docs/numerics.md item 4)
        scales = _scales(op, x, quant, fp8_dtype, (*lead, 1), False, q_out, scales_out)
        if H == 0:
            scales.fill_(1.0)
        return Fp8Outputs(_q(x, fp8_dtype, q_out), scales, quant, fp8_dtype, 1, False)
    if isinstance(group_size, numbers.Integral) and not isinstance(group_size, bool):
        group_size = int(group_size)  # numpy integers too
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 1 <= group_size <= MAX_GROUP_SIZE \
            or group_size & (group_size - 1):
        raise ValueError(f"{op}: group_size must be a power of two in [1, {MAX_GROUP_SIZE}] "
                         f"(default {DEFAULT_GROUP_SIZE}), got {group_size!r}")
    if H % group_size:
        raise ValueError(f"{op}: x has H={H} elements per row, not a multiple of group_size={group_size}")
    G = H // group_size
    if column_major_scales and x.dim() != 2:
        raise ValueError(f"{op}: column_major_scales needs a 2-D x (T, H), got shape {tuple(x.shape)}")
    shape = (G, x.shape[0]) if column_major_scales else (*lead, G)
    scales = _scales(op, x, quant, fp8_dtype, shape, column_major_scales, q_out, scales_out)
    return Fp8Outputs(_q(x, fp8_dtype, q_out), scales, quant, fp8_dtype, group_size, column_major_scales)


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
