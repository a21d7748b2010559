"""CUDA-graph safety: what an inference engine must do, a warm-up helper and a capture guard.

What an engine must do, and when:

1. **Create every Communicator before any capture** (one per process group; collective). The
   constructor sets up and arms the workspace (zeroed signal pads, Lamport buffers filled with the
   sentinel) and exchanges addresses over the process group, none of which can be captured. A graph
   captures the workspace's addresses: keep the communicator open while any graph that uses it may
   replay, and close it only after the last replay has completed.
2. **Run every call once, with the shapes that will be captured, before capturing** — one eager forward
   per captured batch size, or :func:`warmup`. The first call of a shape compiles and loads its Triton
   kernels (host work that must not happen inside a capture). With ``torch.compile``, the compiled
   model's first runs do this (``mode="reduce-overhead"`` warms up before it captures).
3. **Capture on one stream.** Call a communicator from the capturing stream only: nothing of tpcomm on a
   side stream during capture. Calls of one communicator are ordered by the stream (epochs advance
   inside the kernels), so two streams inside one graph could run two calls at once.
4. **Replay freely.** No host value changes per call: epochs and the Lamport buffer index live in device
   memory and advance inside the kernels, so a graph replays any number of times, interleaved with eager
   calls and other graphs of the same communicator, as long as every rank replays the same graphs and
   makes the same eager calls in the same order (each call is collective).
5. **After replays**, call ``comm.check()`` (cheap, no synchronisation) from time to time: a peer timeout
   inside a replay is reported there or by the next eager call.

:func:`capture_guard` checks points 1-3 for calls made through :mod:`tpcomm.ops` (the custom ops and
their wrappers; direct ``Communicator`` method calls are not seen)::

    tpcomm.graphs.warmup(comm, [(T, H) for T in batch_sizes])     # or one eager forward per size
    with tpcomm.graphs.capture_guard(comm):
        for T in batch_sizes:
            with torch.cuda.graph(graphs[T]):
                outs[T] = model(static_inputs[T])

Inside the guard, a call made during capture raises :class:`GraphCaptureError` if its signature (op,
shapes, dtypes, 16-byte alignment) was never run on this communicator outside a capture, or if it runs
on another stream than the communicator's earlier calls in this guard. Outside a guard nothing is
checked; the bookkeeping (one set insertion per call) always runs.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .capture import GraphCaptureError, before_call, capture_guard, warmed
from .quant import QUANT_MODES

__all__ = ["GraphCaptureError", "WARMUP_OPS", "before_call", "capture_guard", "warmed", "warmup"]


#: The quantised forms among :data:`WARMUP_OPS` (one per ``quant`` form), and the ``quant`` each passes.
_QUANT_WARMUPS = {f"fused_add_rmsnorm_{q}": q for q in QUANT_MODES}
#: The MoE ops among :data:`WARMUP_OPS`: they need ``topk``.
_MOE_WARMUPS = ("fused_moe_finalize_add_rmsnorm", "moe_finalize")
#: What :func:`warmup` can run: the ops of :mod:`tpcomm.ops` (the FP8 forms with their defaults:
#: e4m3fn, group size 128, row-major scales).
WARMUP_OPS = ("all_reduce", "fused_add_rmsnorm", "fused_rmsnorm", *_QUANT_WARMUPS, "all_gather", "reduce_scatter",
              "fused_qk_rmsnorm", *_MOE_WARMUPS)


def warmup(comm, shapes: Iterable[Sequence[int]], dtypes: Iterable[torch.dtype] = (torch.bfloat16,),
           ops: Iterable[str] = ("all_reduce", "fused_add_rmsnorm", "fused_rmsnorm"),
           weight_dtype: torch.dtype | None = None, gemma: bool = False, *, k_width: int | None = None,
           topk: int | None = None, moe_index: torch.dtype | None = None, moe_shared: bool = False) -> int:
    """Run each op once for each shape and dtype, eagerly through :mod:`tpcomm.ops`, so that every
    Triton kernel those calls need is compiled and loaded, and :func:`capture_guard` accepts them.

    Collective: every rank of the group calls it with the same arguments. The inputs are zeros (the
    results are discarded); the device is synchronised and ``comm.check()`` run at the end.

    Args:
        comm: the :class:`tpcomm.Communicator`.
        shapes: ``(T, H)`` shapes (any shape for ``all_reduce``; ``(..., H)`` for the fused norms; gathers
            and scatters along dim 0; ``(T, H)`` exactly for the QK norm, where ``H`` is ``q``'s width, and
            for the MoE ops, where it is the output's).
        dtypes: activation dtypes (default bf16).
        ops: any of :data:`WARMUP_OPS`: ``"all_reduce"``, ``"fused_add_rmsnorm"`` (with a residual),
            ``"fused_rmsnorm"`` (without one), ``"fused_add_rmsnorm_<quant>"`` for each ``quant`` form
            (``fp8_per_token``, ``fp8_per_group``, ``fp8_per_group_ue8m0``, ``fp8_static``, ``mxfp4``,
            ``nvfp4``; with a residual; e4m3fn, group size 128, linear scales: H must be a multiple of
            128 for the group forms, 32 for MXFP4, 16 for NVFP4), ``"all_gather"``,
            ``"reduce_scatter"``, ``"fused_qk_rmsnorm"`` (contiguous ``q`` ``(T, H)`` and ``k``
            ``(T, k_width)``), ``"fused_moe_finalize_add_rmsnorm"`` (with a residual, no quant) and
            ``"moe_finalize"`` (``topk`` slots a token, float32 routing weights; its kernel is local,
            so :func:`capture_guard` does not check it, but a capture still needs it compiled). Other
            arguments compile other kernels or make other signatures: quant arguments (``fp8_dtype``,
            ``column_major_scales``, ``emit_unquantized``, ``swizzled_scales``), column views of a
            packed QKV tensor for the QK norm (their row stride is part of the signature), a quantised
            MoE output, other routing-weight dtypes; warm those calls up by making them once.
        weight_dtype: dtype of the norm weights (default: the activation dtype).
        gemma: warm up the Gemma form of the fused ops instead (its kernels differ).
        k_width: ``k``'s width for ``"fused_qk_rmsnorm"`` (default: ``q``'s, the shape's ``H``).
        topk: ``K``, the expert slots of a token, for the MoE ops (required with them).
        moe_index: None: the MoE ops take ``expert_out`` ``(T, K, H)`` in token order; ``torch.int32``
            or ``torch.int64``: the permuted layout, ``expert_out`` ``(T * K, H)`` with an ``index``
            ``(T, K)`` of that dtype.
        moe_shared: pass a ``shared_out`` ``(T, H)`` to the MoE ops.
    Returns:
        The number of calls made.
    Raises:
        ValueError: an unknown op name or an empty shape; a QK norm or MoE op with a shape that is not
            ``(T, H)``, or a MoE op without ``topk``.
        As the ops themselves for bad shapes or dtypes.
    """
    from . import ops as tops

    ops = tuple(ops)
    bad = [o for o in ops if o not in WARMUP_OPS]
    if bad:
        raise ValueError(f"warmup: unknown ops {bad}; expected some of {', '.join(WARMUP_OPS)}")
    shapes = [tuple(int(s) for s in shape) for shape in shapes]
    if any(not shape for shape in shapes):
        raise ValueError("warmup: shapes must have at least one dimension, got ()")
    two_d = [o for o in ops if o == "fused_qk_rmsnorm" or o in _MOE_WARMUPS]
    if two_d and any(len(shape) != 2 for shape in shapes):
        raise ValueError(f"warmup: {', '.join(two_d)} take (T, H) shapes, got {shapes}")
    if topk is None and any(o in _MOE_WARMUPS for o in ops):
        raise ValueError("warmup: the MoE ops need topk (K, the expert slots of a token)")
    calls = 0
    for shape in shapes:
        for dtype in dtypes:
            x = torch.zeros(shape, dtype=dtype, device=comm.device)
            w = torch.ones(shape[-1], dtype=weight_dtype or dtype, device=comm.device)
            for op in ops:
                if op == "all_reduce":
                    tops.all_reduce(comm, x)
                elif op == "all_gather":
                    tops.all_gather(comm, x)
                elif op == "reduce_scatter":
                    tops.reduce_scatter(comm, x)
                elif op in _QUANT_WARMUPS:
                    quant = _QUANT_WARMUPS[op]
                    # the static scale and NVFP4's global scale are inputs: any one-element float32 tensor
                    scale = (torch.ones(1, dtype=torch.float32, device=comm.device)
                             if quant in ("fp8_static", "nvfp4") else None)
                    tops.fused_add_rmsnorm(comm, x, x, w, gemma=gemma, quant=quant, scale=scale)
                elif op == "fused_qk_rmsnorm" or op in _MOE_WARMUPS:
                    _warm_2d(comm, tops, op, shape, dtype, weight_dtype or dtype, gemma, k_width, topk, moe_index,
                             moe_shared)
                else:
                    tops.fused_add_rmsnorm(comm, x, x if op == "fused_add_rmsnorm" else None, w, gemma=gemma)
                calls += 1
    if comm.device.type == "cuda":
        torch.cuda.synchronize(comm.device)
    comm.check("warmup")
    return calls


def _warm_2d(comm, tops, op, shape, dtype, weight_dtype, gemma, k_width, topk, moe_index, moe_shared) -> None:
    """One call of the QK norm or a MoE op for a ``(T, H)`` shape (:func:`warmup`'s arguments)."""
    (T, H), dev = shape, comm.device
    zeros = lambda *size: torch.zeros(size, dtype=dtype, device=dev)  # noqa: E731
    ones = lambda n: torch.ones(n, dtype=weight_dtype, device=dev)  # noqa: E731
    if op == "fused_qk_rmsnorm":
        Hk = H if k_width is None else int(k_width)
        tops.fused_qk_rmsnorm(comm, zeros(T, H), zeros(T, Hk), ones(H), ones(Hk))
        return
    K = int(topk)
    moe = dict(topk_weights=torch.zeros((T, K), dtype=torch.float32, device=dev),
               shared_out=zeros(T, H) if moe_shared else None)
    if moe_index is None:
        expert_out = zeros(T, K, H)
    else:  # the permuted layout: one row a slot
        expert_out = zeros(T * K, H)
        moe["index"] = torch.arange(T * K, dtype=moe_index, device=dev).view(T, K)
    if op == "moe_finalize":
        tops.moe_finalize(expert_out, **moe)
    else:
        tops.fused_moe_finalize_add_rmsnorm(comm, expert_out, residual=zeros(T, H), weight=ones(H), gemma=gemma,
                                            **moe)
