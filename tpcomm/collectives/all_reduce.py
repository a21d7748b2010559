"""``all_reduce``: the sum of ``x`` over the ranks of the group.

Plain torch: ``torch.distributed.all_reduce(x.clone())``, with the numerics contract (docs/numerics.md
item 1): ``T(+0.0 + f32(x_0) + ... + f32(x_{W-1}))`` in rank order, the same bits on every rank and for
every algorithm.

Host path: check ``x`` -> make or check ``out`` -> ask dispatch for the plan (the algorithm, and the
width of the flat rows the kernels take, ``Plan.width``) -> launch the row kernels, or sum integers
exactly through the all-gather kernel, or fall back to ``torch.distributed``.
"""

from __future__ import annotations

import torch

from .. import call_cache, reference
from ..validate import check_not_negated, check_summable, check_tensor, partly_overlaps, strides_may_overlap
from .all_gather import integer_sum
from .fallback import HOST_WRITES, fall_back

OP = "all_reduce"


def all_reduce(comm, x: torch.Tensor, out: torch.Tensor | None = None, key=None) -> torch.Tensor:
    """Sum ``x`` over the ranks of the group (``comm.all_reduce(x, out)``).

    Collective: every rank calls it with the same shape and dtype.

    Args:
        comm: the :class:`~tpcomm.Communicator`.
        x: any shape, bf16 / fp16 / fp32 (kernels) or an integer dtype (gathered through the
            all-gather kernel and summed exactly in int64, wrapping like a native sum; through
            ``torch.distributed`` when the group has no workspace), on this communicator's device.
            Non-contiguous inputs are copied first.
        out: optional output of ``x``'s shape, dtype and device; may be ``x`` itself (in place), or
            overlap ``x`` in any other way (then ``x`` is copied first, so the result is still exact).
        key: the call's key in the communicator's call cache (:mod:`tpcomm.call_cache`), under which its
            launches are recorded; None records nothing. The communicator's method passes it.
    Returns:
        ``out`` (or a new tensor): ``T(+0.0 + f32(x_0) + ... + f32(x_{W-1}))``, the same bits on
        every rank and for every algorithm. Safe in CUDA graphs.
    Raises:
        TypeError: ``x`` is not a tensor, or its dtype has no sum (bool, FP8, complex).
        ValueError: ``x`` or ``out`` is on another device, ``out`` does not match ``x``, ``out``'s
            strides let two elements share memory (a stride of 0, or e.g. strides ``(1, 1)``), or
            ``out`` is a lazily negated view (``torch._neg_view``).
        PeerTimeoutError: a peer did not arrive within the timeout (this or an earlier call);
            :class:`PeerMismatchError` when it made a different call.
    """
    comm._check_open(OP)
    check_tensor(OP, "x", x, comm.device)
    check_summable(OP, x)
    x = x.resolve_neg()  # a lazily negated view: the kernels read memory, so the negation is made real
    given = out is not None
    out, overlap = _output(comm, x, out)
    if x.numel() == 0:
        return out
    n = x.numel()
    plan = comm.plan(OP, n * x.element_size(), n, x.dtype)
    if plan.algorithm == "push":  # an integer sum
        with HOST_WRITES():
            out.copy_(integer_sum(comm, OP, x, (tuple(x.shape),)).view(x.shape))
        return out
    if plan.algorithm == "fallback":
        fall_back(comm, OP, (tuple(x.shape), str(x.dtype)),
                  lambda: out.copy_(reference.all_reduce_reference(x, comm.group)))
        return out
    return _launch(comm, plan, x, out, given, overlap, key)


def check_all_reduce_out(op: str, x: torch.Tensor, out: torch.Tensor, device: torch.device) -> None:
    """``out`` of ``all_reduce``: ``x``'s shape and dtype, distinct elements, no negative bit."""
    check_tensor(op, "out", out, device)
    check_not_negated(op, "out", out)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"{op}: out has shape {tuple(out.shape)} and dtype {out.dtype} but x has "
                         f"{tuple(x.shape)} and {x.dtype}")
    if strides_may_overlap(out):
        raise ValueError(f"{op}: out has elements that share memory (stride {tuple(out.stride())}, "
                         "e.g. from expand()); pass a tensor whose elements are distinct")


def _output(comm, x: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """``(out, overlap)``: a new contiguous ``out``, or the given one checked; ``overlap``: it shares
    bytes with ``x`` without being ``x``'s very memory (then the kernels reduce from a copy)."""
    if out is None:
        return call_cache.new_like(x), False
    check_all_reduce_out(OP, x, out, comm.device)
    return out, x.is_contiguous() and out.is_contiguous() and partly_overlaps(out, x)


def _launch(comm, plan, x: torch.Tensor, out: torch.Tensor, given: bool, overlap: bool, key) -> torch.Tensor:
    """The row kernels of ``plan`` over ``x`` as flat rows of ``plan.width``; records the launches under
    ``key`` when they took the caller's own tensors."""
    n, width = x.numel(), plan.width
    # an out that overlaps x other than in place would be written while peers and this rank still
    # read x: reduce from a copy. The kernels address x and out flat, whatever their shape.
    src = x.clone() if overlap else x.contiguous()
    dst = out if out.is_contiguous() else torch.empty(n, dtype=x.dtype, device=x.device)
    launched = [] if key is not None and not overlap else None
    comm._run_rows(OP, plan, src, dst, None, None, None, -(-n // width), width, 0.0, norm=False, gemma=False,
                   call=(tuple(x.shape),), record=launched)
    if dst.data_ptr() != out.data_ptr():
        with HOST_WRITES():
            out.copy_(dst.view(out.shape))
    elif launched is not None:
        comm._remember(key, launched, (x, out), call_cache.all_reduce_spec(x, out, given))
    return out
