"""Argument checks every op shares (and the constructor's limits); an op's own checks open its module
(:mod:`tpcomm.collectives`), a quant form's are the form's (:mod:`tpcomm.quant.forms`).

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
        raise TypeError(f"{who}: max_bytes must be an int (bytes), got {type_name(max_bytes)}")
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


def type_name(v) -> str:
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
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type_name(t)}")
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


def check_not_negated(op: str, name: str, t: torch.Tensor) -> None:
    """An output without the negative bit: the kernels write its memory, which such a view reads negated."""
    if t.is_neg():
        raise ValueError(f"{op}: {name} is a lazily negated view (its negative bit is set, e.g. from "
                         "torch._neg_view); the kernels write memory, which it reads negated: pass a tensor "
                         "without the bit")


def check_output(op: str, name: str, t, shape, dtype, device: torch.device) -> None:
    """An output the caller gives: a tensor on ``device`` of ``shape`` and ``dtype``, contiguous, without
    the negative bit."""
    check_tensor(op, name, t, device)
    check_not_negated(op, name, t)
    if t.shape != shape or t.dtype != dtype:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} and dtype {t.dtype}; expected "
                         f"{tuple(shape)} and {dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (the kernel writes it row by row), got strides "
                         f"{tuple(t.stride())}")
