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


#: What :func:`warmup` can run: the ops of :mod:`tpcomm.ops` (the FP8 forms with their defaults:
#: e4m3fn, group size 128, row-major scales).
#: The quantised forms among :data:`WARMUP_OPS` (one per ``quant`` form), and the ``quant`` each passes.
_QUANT_WARMUPS = {f"fused_add_rmsnorm_{q}": q for q in QUANT_MODES}
WARMUP_OPS = ("all_reduce", "fused_add_rmsnorm", "fused_rmsnorm", *_QUANT_WARMUPS, "all_gather", "reduce_scatter")


def warmup(comm, shapes: Iterable[Sequence[int]], dtypes: Iterable[torch.dtype] = (torch.bfloat16,),
           ops: Iterable[str] = ("all_reduce", "fused_add_rmsnorm", "fused_rmsnorm"),
           weight_dtype: torch.dtype | None = None, gemma: bool = False) -> int:
    """Run each op once for each shape and dtype, eagerly through :mod:`tpcomm.ops`, so that every
    Triton kernel those calls need is compiled and loaded, and :func:`capture_guard` accepts them.

    Collective: every rank of the group calls it with the same arguments. The inputs are zeros (the
    results are discarded); the device is synchronised and ``comm.check()`` run at the end.

    Args:
        comm: the :class:`tpcomm.Communicator`.
        shapes: ``(T, H)`` shapes (any shape for ``all_reduce``; ``(..., H)`` for the fused ops; gathers
            and scatters along dim 0).
        dtypes: activation dtypes (default bf16).
        ops: any of :data:`WARMUP_OPS`: ``"all_reduce"``, ``"fused_add_rmsnorm"`` (with a residual),
            ``"fused_rmsnorm"`` (without one), ``"fused_add_rmsnorm_<quant>"`` for each ``quant`` form
            (``fp8_per_token``, ``fp8_per_group``, ``fp8_per_group_ue8m0``, ``fp8_static``, ``mxfp4``,
            ``nvfp4``; with a residual; e4m3fn, group size 128, linear scales: H must be a multiple of
            128 for the group forms, 32 for MXFP4, 16 for NVFP4), ``"all_gather"``,
            ``"reduce_scatter"``. Other quant arguments (``fp8_dtype``, ``column_major_scales``,
            ``emit_unquantized``, ``swizzled_scales``) compile other kernels: warm those calls up by
            making them once.
        weight_dtype: dtype of the norm weight (default: the activation dtype).
        gemma: warm up the Gemma form of the fused ops instead (its kernels differ).
    Returns:
        The number of calls made.
    Raises:
        ValueError: an unknown op name or an empty shape.
        As the ops themselves for bad shapes or dtypes.
    """
    from . import ops as tops

    ops = tuple(ops)
    bad = [o for o in ops if o not in WARMUP_OPS]
    if bad:
        raise ValueError(f"warmup: unknown ops {bad}; expected some of {', '.join(WARMUP_OPS)}")
    calls = 0
    for shape in shapes:
        shape = tuple(int(s) for s in shape)
        if not shape:
            raise ValueError("warmup: shapes must have at least one dimension, got ()")
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
                else:
                    tops.fused_add_rmsnorm(comm, x, x if op == "fused_add_rmsnorm" else None, w, gemma=gemma)
                calls += 1
    if comm.device.type == "cuda":
        torch.cuda.synchronize(comm.device)
    comm.check("warmup")
    return calls
