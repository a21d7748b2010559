"""``torch.library`` custom ops, so ``torch.compile`` and CUDA graphs see each tpcomm call as one opaque op.

Ops (namespace ``tpcomm``; ``handle`` is an ``int`` from :func:`register`, see below)::

    torch.ops.tpcomm.all_reduce(handle, x) -> Tensor                     # new tensor, x's shape
    torch.ops.tpcomm.all_reduce_out(handle, x, out) -> ()                # writes out (out may be x)
    torch.ops.tpcomm.fused_add_rmsnorm(handle, x, residual?, weight, eps, gemma) -> Tensor[]
        # [out, residual_out] with a residual, [out] without one
    torch.ops.tpcomm.fused_add_rmsnorm_fp8(handle, x, residual?, weight, eps, gemma, quant, fp8_dtype,
                                          group_size, column_major_scales, emit_unquantized, scale?,
                                          swizzled_scales) -> Tensor[]
        # [q, scales] + [residual_out] with a residual + [out] with emit_unquantized;
        # quant="fp8_static": [q] + ..., the scale is the input scale (an op returns no alias of an input)
    torch.ops.tpcomm.fused_add_rmsnorm_out(handle, x, residual?, weight, eps, gemma, out, residual_out?) -> ()
        # writes out and residual_out; residual_out None: the residual in place
    torch.ops.tpcomm.fused_add_rmsnorm_fp8_out(handle, x, residual?, weight, eps, gemma, quant, fp8_dtype,
                                              group_size, column_major_scales, q, scales?, residual_out?,
                                              out?, scale?, swizzled_scales) -> ()
        # out given: emit_unquantized; scales None with fp8_static
    torch.ops.tpcomm.all_gather(handle, x, dim, rank, world_size) -> Tensor        # dim grows W times
    torch.ops.tpcomm.fused_qk_rmsnorm(handle, q, k, q_weight, k_weight, eps, kv_replicas=1) -> Tensor[]
        # [q_out, k_out]
    torch.ops.tpcomm.reduce_scatter(handle, x, dim, rank, world_size) -> Tensor    # this rank's share
    torch.ops.tpcomm.moe_finalize(expert_out, topk_weights, index?, shared_out?, scaling) -> Tensor
    torch.ops.tpcomm.fused_moe_finalize_add_rmsnorm(handle, expert_out, topk_weights, index?, shared_out?,
                                                   scaling, residual?, weight, eps, gemma, quant?, ...) -> Tensor[]
        # as fused_add_rmsnorm / fused_add_rmsnorm_fp8 (the schema: tpcomm.ops.moe)
    torch.ops.tpcomm.per_token_quant_fp8(x, fp8_dtype) -> (Tensor, Tensor)     # the standalone quantisers
    torch.ops.tpcomm.per_group_quant_fp8(x, group_size, fp8_dtype, column_major_scales, ue8m0) -> (Tensor, Tensor)
    torch.ops.tpcomm.static_quant_fp8(x, scale, fp8_dtype) -> Tensor           # (no handle: tpcomm.ops.quant)

Each op runs the :class:`~tpcomm.Communicator` method it is named after; it has a fake (meta)
implementation that gives the output's shape, dtype, device and strides without running anything, so
``torch.compile(fullgraph=True)`` traces a model that calls them without graph breaks, and the compiled
model runs the very same kernels as eager mode (the same bits). The ``*_out`` ops mutate their output
arguments (declared in ``mutates_args``; the fused ones also the residual, which they update in place when
no separate ``residual_out`` is passed); every other op's outputs are new tensors that alias no input.

Why a handle: an op's arguments are tensors and plain values, not a Python object, so every
communicator gets an ``int`` handle at construction (``comm.handle``, :func:`register`) in a registry
that holds communicators weakly; handles are never reused, so a compiled graph that outlives its
communicator raises instead of talking to another one. The wrappers (:func:`all_reduce`,
:func:`fused_add_rmsnorm`, :func:`all_gather`, :func:`reduce_scatter`, :func:`fused_qk_rmsnorm`,
:func:`fused_moe_finalize_add_rmsnorm`; not the local :func:`moe_finalize`) take the communicator
itself (or a handle) and read its handle as an attribute, which ``torch.compile`` folds into a
constant and guards on: a model holding another communicator recompiles.

``all_gather`` and ``reduce_scatter`` also take the group's rank and size (the wrappers pass them):
their output shapes depend on them, and a fake implementation must depend on its arguments alone
(compiled graphs are cached on disk by their code and arguments, across processes).

In a model::

    import tpcomm.ops as tops
    y = tops.all_reduce(comm, x)                                       # eager or compiled alike
    out, residual = tops.fused_add_rmsnorm(comm, x, residual, weight, eps=1e-6)

Importing this package imports ``torch._dynamo`` (for ``torch.compiler.assume_constant_result``, about
1 s), which is why ``import tpcomm`` does not import it; import it before loading a compiled artifact
that calls the ops.

Inference only: the ops have no autograd formula (run under ``torch.inference_mode()`` /
``torch.no_grad()``, or with parameters that do not require grad). Inputs are validated by the
communicator when the op runs (the fake implementations compute shapes and check only what they need:
``dim``, and the FP8 arguments through the communicator's own allocation), so a bad input raises the
communicator's ``ValueError`` / ``TypeError`` at run time, compiled or not. Graph safety (warm-up before
capture, one stream per communicator) is in :mod:`tpcomm.graphs`.

The package: :mod:`tpcomm.ops.registry` (the handles, and the signatures that
:func:`tpcomm.capture.before_call` keys a call by), :mod:`tpcomm.ops.core` (the all-reduce, fused norm,
QK norm, all-gather and reduce-scatter ops), :mod:`tpcomm.ops.moe` (the MoE finalize ops) and
:mod:`tpcomm.ops.quant` (the standalone FP8 quantisers); every public name is importable from
``tpcomm.ops`` itself.
"""

from .core import all_gather, all_reduce, fused_add_rmsnorm, fused_qk_rmsnorm, reduce_scatter
from .moe import fused_moe_finalize_add_rmsnorm, moe_finalize
from .quant import per_group_quant_fp8, per_token_quant_fp8, static_quant_fp8
from .registry import handle_of, lookup, register

__all__ = ["all_gather", "all_reduce", "fused_add_rmsnorm", "fused_moe_finalize_add_rmsnorm", "fused_qk_rmsnorm",
           "handle_of", "lookup", "moe_finalize", "reduce_scatter", "register"]
__all__ += ["per_group_quant_fp8", "per_token_quant_fp8", "static_quant_fp8"]
