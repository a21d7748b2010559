"""``all_gather``: every rank's ``x`` concatenated along ``dim``, in rank order.

Plain torch: ``torch.cat(gathered_list, dim)`` after ``torch.distributed.all_gather(gathered_list, x)``;
the slice of rank ``q`` holds ``x_q`` bit for bit (a copy: any dtype, moved as bytes where the kernel
has no element type for it).

Host path: check ``x`` and ``dim`` -> make the output -> ask dispatch for the plan -> launch the
all-gather kernel (``push``), or fall back to ``torch.distributed``. Along ``dim != 0`` the call gathers
``x.movedim(dim, 0)`` and moves the dimension back. :func:`integer_sum` serves the all-reduce and the
reduce-scatter of integers: every rank's input through this kernel, summed here.
"""

from __future__ import annotations

import torch

from .. import call_cache, dispatch, reference
from ..kernels import chunks
from ..validate import check_dim, check_tensor
from .fallback import fall_back

OP = "all_gather"


def all_gather(comm, x: torch.Tensor, dim: int = 0, key=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order (``comm.all_gather(x, dim)``).

    Collective: every rank calls it with the same shape and dtype (a peer with another shape is
    detected: :class:`PeerMismatchError`).

    Args:
        comm: the :class:`~tpcomm.Communicator`.
        x: any shape with at least one dimension, any dtype (the kernel copies it; dtypes other than
            bf16 / fp16 / fp32 move as bytes), this device.
        dim: the dimension to concatenate along (negative counts from the end).
        key: the call's key in the communicator's call cache (:mod:`tpcomm.call_cache`); None records
            nothing. The communicator's method passes it.
    Returns:
        A new tensor: ``x``'s shape with ``dim`` multiplied by the world size; the slice of rank
        ``q`` holds ``x_q`` bit for bit. Safe in CUDA graphs.
    Raises:
        TypeError: ``x`` is not a tensor, or ``dim`` is not an int.
        ValueError: ``x`` is on another device or a scalar, or ``dim`` is out of range.
        PeerTimeoutError: a peer did not arrive within the timeout (this or an earlier call).
    """
    comm._check_open(OP)
    check_tensor(OP, "x", x, comm.device)
    dim = check_dim(OP, x, dim)
    return gather(comm, OP, x.resolve_neg(), dim, (tuple(x.shape), dim), key)


def gather(comm, op: str, x: torch.Tensor, dim: int, call: tuple, key=None) -> torch.Tensor:
    """:func:`all_gather` of checked arguments. ``op`` and ``call`` (the user's call: its shape and
    ``dim``) go into every launch's signature, so an error names the op the user called and peers
    that called with another ``dim`` (same gathered bytes, other meaning) raise instead of returning
    wrong values. ``key``: the call's key (:mod:`tpcomm.call_cache`), recorded when the launches
    take ``x`` and the output whole."""
    W = comm.world_size
    if dim != 0:
        y = x.movedim(dim, 0)  # (S, *pre, *post)
        g = gather(comm, op, y, 0, call).view(W, *y.shape).movedim((0, 1), (dim, dim + 1))
        # contiguous, as torch.cat returns it (reshape may give a strided view here)
        return g.reshape(*x.shape[:dim], W * x.shape[dim], *x.shape[dim + 1:]).contiguous()
    n = x.numel()
    out = torch.empty((W * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    plan = comm.plan("all_gather", n * x.element_size(), n, x.dtype)  # whichever op it serves
    as_bytes = x.dtype not in dispatch.KERNEL_DTYPES  # a copy: move the bytes (integers, FP8, bool, float64)
    if as_bytes:
        n *= x.element_size()  # from here on, n counts what the kernel moves
    if plan.algorithm == "fallback":
        fall_back(comm, op, call + (str(x.dtype),), lambda: out.copy_(reference.all_gather_reference(x, comm.group)))
        return out
    src, dst = x.contiguous(), out  # addressed flat
    if as_bytes:
        src, dst = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    launched = [] if key is not None and not as_bytes else None
    comm._run(op, chunks.gather_launches(comm.workspace, src, dst, n, str(x.dtype), comm._signer(op), call),
              launched)
    if launched is not None:
        comm._remember(key, launched, (x, out), call_cache.dim_spec(op, x, out))
    return out


def integer_sum(comm, op: str, x: torch.Tensor, call: tuple) -> torch.Tensor:
    """Flat sum over the ranks of integer ``x``: every rank's input through the all-gather kernel
    (signed as ``op``'s ``call``), summed in int64 (exact; wraps modulo 2**64, then modulo the
    dtype's range like a native sum)."""
    g = gather(comm, op, x.reshape(-1), 0, call)
    return g.view(comm.world_size, -1).to(torch.int64).sum(0).to(x.dtype)
