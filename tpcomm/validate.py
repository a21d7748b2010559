"""Argument checks of :class:`~tpcomm.Communicator`'s constructor and ops.

Every check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong value, shape, device,
layout) with a message that names the op and the argument. They run on a call's first occurrence of a
key (:mod:`tpcomm.call_cache`); what they depend on is part of the key, except what depends on
addresses (overlaps), which a repeated call checks again in the code written for it
(:mod:`tpcomm.hit_code`).
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from . import dispatch

#: The largest finite float32 (``eps`` is added in float32).
FLOAT32_MAX = 3.4028234663852886e38
#: Kernels index a launch's elements with int32: one launch stays under 2**31 elements.
MAX_MAX_BYTES = 1 << 30


def checked_limits(who: str, max_bytes, timeout_s) -> tuple[int, float]:
    """``(max_bytes, timeout_s)`` checked: an int in ``(0, MAX_MAX_BYTES]`` and a positive, finite number
    of seconds.

    Raises:
        TypeError: ``max_bytes`` is not an int, or ``timeout_s`` not a number.
        ValueError: either is out of range.
    """
    if isinstance(max_bytes, (bool, np.bool_)) or not isinstance(max_bytes, numbers.Integral):
        raise TypeError(f"{who}: max_bytes must be an int (bytes), got {_type_name(max_bytes)}")
    max_bytes = int(max_bytes)  # numpy integers too
    if not 0 < max_bytes <= MAX_MAX_BYTES:
        raise ValueError(f"{who}: max_bytes must be in (0, {MAX_MAX_BYTES}], got {max_bytes}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{who}: timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"{who}: timeout_s must be positive and finite, got {timeout_s}")
    return max_bytes, float(timeout_s)


def strides_may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: True unless, with the dimensions of more than one
    element sorted by stride, each stride exceeds the largest offset the smaller ones reach (a sufficient
    test; it also flags a stride of 0, e.g. from ``expand()``)."""
    reach = 0
    for stride, size in sorted((abs(st), sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def partly_overlaps(out: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether contiguous ``out`` and ``x`` of the same size and dtype share bytes without being the same
    (``out=x`` is in place, which the kernels support): e.g. ``out=buf[:-1]`` with ``x=buf[1:]``. Only
    then would the kernel write ``out`` while ``x`` is still read (a non-contiguous ``x`` is copied and a
    non-contiguous ``out`` written through a staging tensor anyway)."""
    return 0 < abs(out.data_ptr() - x.data_ptr()) < x.numel() * x.element_size()


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def overlapping(outputs: tuple, inputs: tuple, allowed: tuple = ()) -> tuple[int, int] | None:
    """The first ``(i, j)`` such that contiguous ``outputs[i]`` shares bytes with ``inputs[j]`` (or, for
    ``j >= len(inputs)``, with output ``j - len(inputs)`` other than ``i``), or None. ``None`` entries are
    skipped; ``(i, j)`` pairs in ``allowed`` may be the very same tensor (an in-place output)."""
    spans_in = [None if t is None else _span(t) for t in inputs]
    spans_out = [None if t is None else _span(t) for t in outputs]
    for i, a in enumerate(spans_out):
        if a is None or a[0] == a[1]:
            continue
        for j, b in enumerate(spans_in + spans_out):
            if b is None or (j >= len(inputs) and j - len(inputs) == i) or b[0] == b[1]:
                continue
            if a[0] < b[1] and b[0] < a[1]:
                if (i, j) in allowed and a == b:
                    continue
                return i, j
    return None


def _type_name(v) -> str:
    """``int``, or ``numpy.bool`` for a type outside the builtins (so a message never says "got bool" of
    a value that is not Python's bool)."""
    t = type(v)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


#: Dtypes no op takes: bit containers and sub-byte integers, whose elements torch cannot copy or cat.
_NO_BYTES = frozenset(getattr(torch, n) for n in ("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16", "uint1",
                                                  "uint2", "uint3", "uint4", "uint5", "uint6", "uint7", "int1",
                                                  "int2", "int3", "int4", "int5", "int6", "int7")
                      if hasattr(torch, n))


def check_tensor(op: str, name: str, t, device: torch.device) -> None:
    """``t`` is a tensor on ``device``, of a dtype whose elements are whole bytes (TypeError for torch's bit
    containers and sub-byte integers, which torch itself cannot copy)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {_type_name(t)}")
    if t.dtype in _NO_BYTES:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}, a bit container or sub-byte integer; expected a "
                        "dtype of whole-byte elements")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but this communicator runs on {device}")


def check_summable(op: str, x: torch.Tensor) -> None:
    """``x`` has a sum: a kernel dtype or an integer dtype."""
    if x.dtype not in dispatch.KERNEL_DTYPES and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise TypeError(f"{op}: x has dtype {x.dtype}; expected bfloat16, float16, float32 or an integer dtype")


def check_dim(op: str, x: torch.Tensor, dim) -> int:
    """``dim`` normalised to ``[0, x.dim())``: TypeError when it is not an int (bool included), ValueError
    when it is out of range or ``x`` is a scalar."""
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dimension, got a scalar")
    if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__} {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim must be in [{-x.dim()}, {x.dim()}) for x of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    return int(dim) % x.dim()


def _check_not_negated(op: str, name: str, t: torch.Tensor) -> None:
    """An output without the negative bit: the kernels write its memory, which such a view reads negated."""
    if t.is_neg():
        raise ValueError(f"{op}: {name} is a lazily negated view (its negative bit is set, e.g. from "
                         "torch._neg_view); the kernels write memory, which it reads negated: pass a tensor "
                         "without the bit")


def check_all_reduce_out(op: str, x: torch.Tensor, out: torch.Tensor, device: torch.device) -> None:
    """``out`` of ``all_reduce``: ``x``'s shape and dtype, distinct elements, no negative bit."""
    check_tensor(op, "out", out, device)
    _check_not_negated(op, "out", out)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"{op}: out has shape {tuple(out.shape)} and dtype {out.dtype} but x has "
                         f"{tuple(x.shape)} and {x.dtype}")
    if strides_may_overlap(out):
        raise ValueError(f"{op}: out has elements that share memory (stride {tuple(out.stride())}, "
                         "e.g. from expand()); pass a tensor whose elements are distinct")


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
        raise TypeError(f"{op}: eps must be a real number, got {_type_name(eps)}")
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
            raise TypeError(f"{op}: {name} must be a bool (Python's True or False), got {_type_name(flag)}")
    return eps


def _check_output(op: str, name: str, t, shape, dtype, device: torch.device) -> None:
    check_tensor(op, name, t, device)
    _check_not_negated(op, name, t)
    if t.shape != shape or t.dtype != dtype:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} and dtype {t.dtype}; expected "
                         f"{tuple(shape)} and {dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (the kernel writes it row by row), got strides "
                         f"{tuple(t.stride())}")


def check_fused_outputs(op: str, x, residual, weight, quant, emit_unquantized, out, residual_out,
                        device: torch.device) -> None:
    """``out`` and ``residual_out`` given to ``fused_add_rmsnorm``: contiguous, ``x``'s shape and dtype;
    ``residual_out`` only with a residual, and may be ``residual`` itself (in place); ``out`` with
    ``quant`` only with ``emit_unquantized``. Neither may share bytes with an input or the other."""
    if out is not None:
        if quant is not None and not emit_unquantized:
            raise ValueError(f"{op}: out with quant={quant!r} needs emit_unquantized=True (otherwise no "
                             "unquantised output is written)")
        _check_output(op, "out", out, x.shape, x.dtype, device)
    if residual_out is not None:
        if residual is None:
            raise ValueError(f"{op}: residual_out needs a residual (without one there is no residual output)")
        _check_output(op, "residual_out", residual_out, x.shape, x.dtype, device)


def check_fp8_outputs(op: str, x, quant, q_out, scales_out, expected_scales: torch.Tensor | None,
                      fp8_dtype, device: torch.device, q_shape: tuple | None = None) -> None:
    """``q_out`` and ``scales_out`` given to ``fused_add_rmsnorm``: only with ``quant``; ``q_out`` contiguous
    in ``fp8_dtype`` shaped like ``x`` (or ``q_shape``: FP4's packed bytes, ``fp8_dtype`` then uint8);
    ``scales_out`` with the dtype, shape and strides of the scales the call would return
    (``expected_scales``)."""
    if quant is None:
        if q_out is not None or scales_out is not None:
            from .quant import QUANT_MODES

            raise ValueError(f"{op}: q_out and scales_out need quant= (one of {', '.join(QUANT_MODES)})")
        return
    if q_out is not None:
        _check_output(op, "q_out", q_out, x.shape if q_shape is None else q_shape, fp8_dtype, device)
    if scales_out is not None:
        check_tensor(op, "scales_out", scales_out, device)
        _check_not_negated(op, "scales_out", scales_out)
        shape, strides = tuple(expected_scales.shape), expected_scales.stride()
        if scales_out.dtype != expected_scales.dtype or tuple(scales_out.shape) != shape:
            raise ValueError(f"{op}: scales_out has shape {tuple(scales_out.shape)} and dtype {scales_out.dtype}; "
                             f"expected {shape} and {expected_scales.dtype}")
        if any(st != want for st, want, n in zip(scales_out.stride(), strides, shape) if n > 1):
            why = " (column_major_scales decides the layout)" if quant != "fp8_per_token" else " (row-major)"
            raise ValueError(f"{op}: scales_out has strides {tuple(scales_out.stride())}; expected {strides}{why}")
