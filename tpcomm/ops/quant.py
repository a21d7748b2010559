"""The custom ops of the standalone FP8 quantisers (:mod:`tpcomm.quant.standalone`) and their wrappers
(registered when :mod:`tpcomm.ops` is imported; conventions there)::

    torch.ops.tpcomm.per_token_quant_fp8(x, fp8_dtype) -> (Tensor, Tensor)                  # q, scales
    torch.ops.tpcomm.per_group_quant_fp8(x, group_size, fp8_dtype, column_major_scales, ue8m0)
        -> (Tensor, Tensor)                                                                # q, scales
    torch.ops.tpcomm.static_quant_fp8(x, scale, fp8_dtype) -> Tensor                       # q

A compiled graph holds each quantiser as one op that runs the standalone Triton kernel (the same bytes
as eager mode). They are local (no communicator, no handle). After a fused all-reduce + RMSNorm they are
what :mod:`tpcomm.inductor` folds into the fused kernel's quantised form: contract item 4 makes the fused
kernel's bytes and scales equal to these ops applied to its unquantised output.

In a model::

    import tpcomm.ops as tops
    q, scales = tops.per_token_quant_fp8(h)                 # h (T, H) bf16 / fp16 / fp32
"""

from __future__ import annotations

import torch

from ..quant import (
    DEFAULT_GROUP_SIZE,
    per_group_quant_fp8 as _per_group,
    per_token_quant_fp8 as _per_token,
    static_quant_fp8 as _static,
)


def _two_dims(op: str, x: torch.Tensor) -> tuple:
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (T, H), got shape {tuple(x.shape)}")
    return tuple(x.shape)


@torch.library.custom_op("tpcomm::per_token_quant_fp8", mutates_args=(),
                         schema="(Tensor x, ScalarType fp8_dtype) -> (Tensor, Tensor)")
def _per_token_op(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _per_token(x, fp8_dtype)


@_per_token_op.register_fake
def _(x, fp8_dtype):
    T, H = _two_dims("per_token_quant_fp8", x)
    return x.new_empty((T, H), dtype=fp8_dtype), x.new_empty((T, 1), dtype=torch.float32)


@torch.library.custom_op("tpcomm::per_group_quant_fp8", mutates_args=(),
                         schema="(Tensor x, int group_size, ScalarType fp8_dtype, bool column_major_scales, "
                                "bool ue8m0) -> (Tensor, Tensor)")
def _per_group_op(x: torch.Tensor, group_size: int, fp8_dtype: torch.dtype, column_major_scales: bool,
                  ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _per_group(x, group_size, fp8_dtype, column_major_scales, ue8m0)


@_per_group_op.register_fake
def _(x, group_size, fp8_dtype, column_major_scales, ue8m0):
    T, H = _two_dims("per_group_quant_fp8", x)
    if group_size < 1 or H % group_size:
        raise ValueError(f"per_group_quant_fp8: x has H={H} elements per row, not a multiple of "
                         f"group_size={group_size}")
    n_groups = H // group_size
    scales = (x.new_empty((n_groups, T), dtype=torch.float32).t() if column_major_scales
              else x.new_empty((T, n_groups), dtype=torch.float32))
    return x.new_empty((T, H), dtype=fp8_dtype), scales


@torch.library.custom_op("tpcomm::static_quant_fp8", mutates_args=(),
                         schema="(Tensor x, Tensor scale, ScalarType fp8_dtype) -> Tensor")
def _static_op(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    return _static(x, scale, fp8_dtype)


@_static_op.register_fake
def _(x, scale, fp8_dtype):
    return x.new_empty(_two_dims("static_quant_fp8", x), dtype=fp8_dtype)


def per_token_quant_fp8(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tpcomm.quant.per_token_quant_fp8` through the op ``tpcomm::per_token_quant_fp8``: FP8 with
    one float32 scale per row (contract item 4), the same bytes, one op under ``torch.compile``.

    Args:
        x: ``(T, H)`` bf16 / fp16 / fp32.
        fp8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e4m3fnuz``.
    Returns:
        ``(q, scales)``: ``q`` ``(T, H)`` of ``fp8_dtype``; ``scales`` ``(T, 1)`` float32.
    Raises:
        As :func:`tpcomm.quant.per_token_quant_fp8` (``ValueError`` for a tensor that is not 2-D, also
        while tracing).
    """
    q, scales = torch.ops.tpcomm.per_token_quant_fp8(x, fp8_dtype)
    return q, scales


def per_group_quant_fp8(x: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                        fp8_dtype: torch.dtype = torch.float8_e4m3fn, column_major_scales: bool = False,
                        ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tpcomm.quant.per_group_quant_fp8` through the op ``tpcomm::per_group_quant_fp8``: FP8 with
    one float32 scale per ``group_size`` elements of a row, the same bytes.

    Args:
        x: ``(T, H)`` bf16 / fp16 / fp32, ``H`` a multiple of ``group_size``.
        group_size, fp8_dtype, column_major_scales, ue8m0: as :func:`tpcomm.quant.per_group_quant_fp8`.
    Returns:
        ``(q, scales)``: ``q`` ``(T, H)``; ``scales`` ``(T, H / group_size)`` float32 (the transpose view
        of a contiguous ``(H / group_size, T)`` tensor with ``column_major_scales``).
    Raises:
        As :func:`tpcomm.quant.per_group_quant_fp8`.
    """
    q, scales = torch.ops.tpcomm.per_group_quant_fp8(x, group_size, fp8_dtype, column_major_scales, ue8m0)
    return q, scales


def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                     ) -> torch.Tensor:
    """:func:`tpcomm.quant.static_quant_fp8` through the op ``tpcomm::static_quant_fp8``: FP8 with one
    calibrated float32 ``scale`` (a one-element tensor, read when the op runs), the same bytes.

    Returns:
        ``q``: ``(T, H)`` of ``fp8_dtype``.
    Raises:
        As :func:`tpcomm.quant.static_quant_fp8`.
    """
    return torch.ops.tpcomm.static_quant_fp8(x, scale, fp8_dtype)
