"""``reduce_scatter``: the sum of ``x`` over the ranks, this rank's share along ``dim``.

Plain torch: ``torch.tensor_split(all_reduce(x), world_size, dim)[rank]``, with the numerics contract
(the same bits as the matching rows of ``all_reduce``). Shares are cut as ``torch.tensor_split`` cuts
them: the first ``T % W`` ranks get one row more, the last ranks may get none.

Host path: check ``x`` and ``dim`` -> make the output (this rank's share) -> ask dispatch for the plan
-> launch two-shot's first half, or sum through the all-gather kernel (integers exactly; rows too
narrow for the kernel in rank order), or fall back to ``torch.distributed``. Along ``dim != 0`` the call
scatters ``x.movedim(dim, 0)`` and moves the dimension back.
"""

from __future__ import annotations

import torch

from .. import call_cache, dispatch, reference
from ..kernels import chunks
from ..validate import check_dim, check_summable, check_tensor
from .all_gather import gather, integer_sum
from .fallback import fall_back

OP = "reduce_scatter"


def reduce_scatter(comm, x: torch.Tensor, dim: int = 0, key=None) -> torch.Tensor:
    """Sum ``x`` over the ranks and return this rank's share along ``dim`` (``comm.reduce_scatter(x,
    dim)``).

    Shares are cut as ``torch.tensor_split(sum, world_size, dim)`` cuts them: when the size of
    ``dim`` (``T``) is not divisible by the world size, the first ``T % W`` ranks get one row more
    and the last ranks may get none (an empty tensor).

    Collective: every rank calls it with the same shape and dtype.

    Args:
        comm: the :class:`~tpcomm.Communicator`.
        x: at least one dimension; bf16 / fp16 / fp32 (the two-shot kernel; rows under 16 elements
            through the all-gather kernel and the rank-order sum here) or an integer dtype (the
            all-gather kernel and an exact int64 sum), this device.
        dim: the dimension to scatter along (negative counts from the end).
        key: the call's key in the communicator's call cache (:mod:`tpcomm.call_cache`); None records
            nothing. The communicator's method passes it.
    Returns:
        A new tensor: rank ``r``'s share of ``T(+0.0 + f32(x_0) + ... + f32(x_{W-1}))``, the same bits
        as the matching rows of :meth:`~tpcomm.Communicator.all_reduce`. Safe in CUDA graphs.
    Raises:
        TypeError: ``x`` is not a tensor, its dtype has no sum (bool, FP8, complex), or ``dim`` is not
            an int.
        ValueError: ``x`` is on another device or a scalar, or ``dim`` is out of range.
        PeerTimeoutError: a peer did not arrive within the timeout (this or an earlier call).
    """
    comm._check_open(OP)
    check_tensor(OP, "x", x, comm.device)
    check_summable(OP, x)
    dim = check_dim(OP, x, dim)
    return scatter(comm, OP, x.resolve_neg(), dim, (tuple(x.shape), dim), key)


def scatter(comm, op: str, x: torch.Tensor, dim: int, call: tuple, key=None) -> torch.Tensor:
    """:func:`reduce_scatter` of checked arguments; ``call`` and ``key`` as in
    :func:`~tpcomm.collectives.all_gather.gather`."""
    if dim != 0:
        return scatter(comm, op, x.movedim(dim, 0), 0, call).movedim(0, dim).contiguous()
    T, W = x.shape[0], comm.world_size
    start, length = reference.share_bounds(T, W, comm.rank)
    out = torch.empty((length, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    H = x.numel() // T
    plan = comm.plan(op, x.numel() * x.element_size(), H, x.dtype)
    if plan.algorithm == "push" and dispatch.is_integer(x.dtype):
        out.copy_(integer_sum(comm, op, x, call).view(x.shape)[start:start + length])
        return out
    if plan.algorithm == "push":
        # Narrow rows: every rank's input through the all-gather kernel, then the contract's
        # rank-order sum here (the same bits; and a peer making another call raises, as in a kernel).
        g = gather(comm, op, x.reshape(-1), 0, call).view(W, -1)
        s = reference.reduce_in_rank_order(list(g.unbind(0))).view(x.shape)
        out.copy_(s[start:start + length])
        return out
    if plan.algorithm == "fallback":
        fall_back(comm, op, call + (str(x.dtype),),
                  lambda: out.copy_(reference.reduce_scatter_reference(x, comm.group)))
        return out
    xc = x.contiguous()  # addressed flat
    launched = [] if key is not None else None
    comm._run(op, chunks.two_shot_launches(comm.workspace, W, xc, out, None, None, None, T, H, 0.0, False, False,
                                           None, comm._signer(op), scatter_only=True, call=call),
              launched)
    if launched is not None:
        comm._remember(key, launched, (x, out), call_cache.dim_spec(op, x, out))
    return out
