"""MoE finalize, alone and fused with the all-reduce, the residual add and the RMSNorm.

Plain torch (``e`` the expert outputs in token order ``(T, K, H)``; ``e = expert_out[index]`` in the
permuted layout)::

    x = (scaling * (topk_weights[..., None].float() * e.float()).sum(1) + shared_out.float()).to(e.dtype)
    out, residual_out = comm.fused_add_rmsnorm(x, residual, weight, eps)

with the sum over the K slots taken in slot order from +0.0 and every product and sum rounded to
float32 on its own (docs/numerics.md, "MoE finalize"): :func:`moe_finalize` gives exactly ``x``, and
the fused call gives the bits of the composition ``comm.fused_add_rmsnorm(moe_finalize(...), ...)``
on every rank, for every algorithm and number of tokens.

Host path of :meth:`tpcomm.Communicator.fused_moe_finalize_add_rmsnorm`: check the arguments
(:func:`check_moe_inputs`, then the fused norm's own checks) -> make or check the outputs (the fused
norm's :class:`~tpcomm.collectives.fused_norm.FusedOutputs`, with its quant form for a quantised output,
:mod:`tpcomm.quant.forms`) -> the fused norm's plan (:meth:`~tpcomm.dispatch.Plan.skips_out`,
:attr:`~tpcomm.dispatch.Plan.prologue`) -> launch: one-shot and Lamport make this rank's rows in their
prologue (``kernels/moe.py:finalize_tile``, in every launch of a chunked call); two-shot runs the
standalone finalize, then the fused norm's kernels; the fallback runs the standalone finalize, then the
fused norm's fallback (:func:`~tpcomm.collectives.fallback.fall_back`). Every launch's signature carries
K, the layout, the shared output and the scaling (``MoeIn.fields``), so a peer calling with another K
is a :class:`~tpcomm.PeerMismatchError`, not wrong values.
"""

from __future__ import annotations

import contextlib
import math
import numbers

import torch

from .. import dispatch, reference, validate
from ..env import interpreter_enabled, interpreter_problem
from ..kernels.moe import MoeIn, moe_finalize_call
from ..quant import DEFAULT_GROUP_SIZE
from .fallback import fall_back
from .fused_norm import FLOAT32_MAX, FusedOutputs, check_call, check_fused_outputs

OP = "fused_moe_finalize_add_rmsnorm"

_INDEX_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- arguments ---------------------------------------------------------------------------------------
def check_moe_inputs(op: str, expert_out, topk_weights, index, shared_out, scaling,
                     device: torch.device) -> tuple[MoeIn, int, int]:
    """The finalize's inputs checked and made contiguous: ``(moe, T, H)``.

    Raises:
        TypeError: a tensor argument is not a tensor or has another dtype (``expert_out`` bf16 / fp16 /
            fp32; ``topk_weights`` float32 / bf16 / fp16; ``index`` int32 / int64; ``shared_out``
            ``expert_out``'s dtype); ``scaling`` is not a real number.
        ValueError: a shape differs from the expected one (the message names both), a tensor is on
            another device, K or H is 0, ``scaling`` is not finite in float32, or (CPU tensors only) an
            ``index`` entry lies outside ``[0, M)``.
    """
    validate.check_tensor(op, "expert_out", expert_out, device)
    if expert_out.dtype not in dispatch.KERNEL_DTYPES:
        raise TypeError(f"{op}: expert_out has dtype {expert_out.dtype}; expected bfloat16, float16 or float32")
    validate.check_tensor(op, "topk_weights", topk_weights, device)
    if topk_weights.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"{op}: topk_weights has dtype {topk_weights.dtype}; expected float32, bfloat16 or "
                        "float16")
    if index is None:
        if expert_out.dim() != 3:
            raise ValueError(f"{op}: expert_out must be (T, K, H) in token order, got shape "
                             f"{tuple(expert_out.shape)} (pass index= for the (M, H) permuted layout)")
        T, K, H = expert_out.shape
        M = T * K
    else:
        validate.check_tensor(op, "index", index, device)
        if index.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{op}: index has dtype {index.dtype}; expected torch.int32 or torch.int64")
        if index.dim() != 2:
            raise ValueError(f"{op}: index must be (T, K), got shape {tuple(index.shape)}")
        if expert_out.dim() != 2:
            raise ValueError(f"{op}: expert_out must be (M, H) with index (the permuted layout), got shape "
                             f"{tuple(expert_out.shape)}")
        (T, K), (M, H) = index.shape, expert_out.shape
        if topk_weights.shape != index.shape:
            raise ValueError(f"{op}: index has shape {tuple(index.shape)} but topk_weights has "
                             f"{tuple(topk_weights.shape)}; both are (T, K)")
    if tuple(topk_weights.shape) != (T, K):
        raise ValueError(f"{op}: topk_weights has shape {tuple(topk_weights.shape)}; expected (T, K) = {(T, K)}")
    if K < 1 or H < 1:
        raise ValueError(f"{op}: K and H must be >= 1, got K={K}, H={H}")
    if shared_out is not None:
        validate.check_tensor(op, "shared_out", shared_out, device)
        if shared_out.dtype != expert_out.dtype:
            raise TypeError(f"{op}: shared_out has dtype {shared_out.dtype} but expert_out has {expert_out.dtype}")
        if tuple(shared_out.shape) != (T, H):
            raise ValueError(f"{op}: shared_out has shape {tuple(shared_out.shape)}; expected (T, H) = {(T, H)}")
    if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
        raise TypeError(f"{op}: scaling must be a real number (a Python float), got {type(scaling).__name__}")
    scaling = float(scaling)
    if not (math.isfinite(scaling) and abs(scaling) <= FLOAT32_MAX):
        raise ValueError(f"{op}: scaling must be finite in float32, got {scaling}")
    scaling = float(torch.tensor(scaling, dtype=torch.float32)) + 0.0  # what the kernels use; -0.0 as +0.0
    if index is not None and T and index.device.type == "cpu" and not _tracing(index):
        bad = ((index < 0) | (index >= M)).nonzero()
        if len(bad):
            t, k = bad[0].tolist()
            raise ValueError(f"{op}: index[{t}, {k}] = {int(index[t, k])} lies outside [0, M) = [0, {M}) "
                             f"(M: the rows of expert_out); {len(bad)} entries do")
    contiguous = [None if t is None else t.resolve_neg().contiguous() for t in (expert_out, index, topk_weights,
                                                                                  shared_out)]
    return MoeIn(*contiguous, K, M, scaling), T, H


def _tracing(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or is_fake(t)


def _kernels_run_on(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device`` in this process (CUDA, or the CPU under the
    interpreter)."""
    if device.type == "cpu":
        return interpreter_enabled() and interpreter_problem() is None
    return device.type == "cuda" and not interpreter_enabled()


def _finalize_into(moe: MoeIn, out: torch.Tensor, T: int, H: int) -> None:
    """Launch the standalone finalize kernel writing ``out`` ``(T, H)``."""
    cfg = dispatch.row_config(H, 1)
    device = out.device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        moe_finalize_call(moe, out, T, H, cfg.block_h, cfg.num_warps).launch()


# -- the standalone op -------------------------------------------------------------------------------
def moe_finalize(expert_out: torch.Tensor, topk_weights: torch.Tensor, *, index: torch.Tensor | None = None,
                 shared_out: torch.Tensor | None = None, scaling: float = 1.0,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE finalize of one rank: each token's routing-weighted sum of its K expert outputs (a local
    Triton kernel, no communication).

    Per token ``t`` (docs/numerics.md, "MoE finalize"): ``acc = +0.0``; for ``k = 0 .. K - 1``
    ``acc = f32(acc + f32(f32(w[t, k]) * f32(e[t, k])))``; ``acc = f32(acc * f32(scaling))``; with
    ``shared_out`` ``acc = f32(acc + f32(shared_out[t]))``; ``x[t] = T(acc)`` (round to nearest even in
    ``expert_out``'s dtype). No fused multiply-add: every product and sum is rounded on its own, so a
    plain-torch evaluation in that order (:func:`moe_finalize_reference`) gives the same bits.

    Args:
        expert_out: ``(T, K, H)`` in token order, or, with ``index``, ``(M, H)`` in the experts'
            permuted order; bf16 / fp16 / fp32, on CUDA (on the CPU under the interpreter).
        topk_weights: ``(T, K)`` routing weights, float32 / bf16 / fp16 (used as ``f32(w)``).
        index: ``(T, K)`` int32 / int64: row of ``expert_out`` holding slot ``k`` of token ``t``
            (TensorRT-LLM's ``expanded_idx_to_permuted_idx``). Entries outside ``[0, M)`` raise on CPU
            tensors; on CUDA (not read on the host) such a slot adds nothing and nothing outside
            ``expert_out`` is read.
        shared_out: ``(T, H)`` shared-expert output in ``expert_out``'s dtype, added after the scaling.
        scaling: the routed scaling factor, a finite Python float, used rounded to float32.
        out: ``(T, H)`` contiguous tensor of ``expert_out``'s dtype to write, sharing memory with no input.
    Returns:
        ``out`` (or a new tensor) ``(T, H)`` in ``expert_out``'s dtype. One launch, safe in CUDA graphs.
    Raises:
        TypeError, ValueError: as :func:`check_moe_inputs`; ``out`` has another shape, dtype or layout,
            or overlaps an input; the tensors are on a device the kernels do not run on in this process.
        RuntimeError: CPU tensors, and the kernels cannot run under the interpreter in this process
            (:func:`tpcomm.env.interpreter_problem` says why: e.g. Triton imported before tpcomm).
    """
    op = "moe_finalize"
    device = expert_out.device if isinstance(expert_out, torch.Tensor) else torch.device("cpu")
    moe, T, H = check_moe_inputs(op, expert_out, topk_weights, index, shared_out, scaling, device)
    if device.type == "cpu" and interpreter_problem():
        raise RuntimeError(f"{op}: {interpreter_problem()}")
    if not _kernels_run_on(device):
        how = "Triton's CPU interpreter (TRITON_INTERPRET=1)" if interpreter_enabled() else "CUDA"
        raise ValueError(f"{op}: expert_out is on {device}, but the kernels run on {how} in this process")
    out = _finalize_out(op, moe, out, T, H, device)
    if T:
        _finalize_into(moe, out, T, H)
    return out


def _finalize_out(op: str, moe: MoeIn, out, T: int, H: int, device: torch.device) -> torch.Tensor:
    """``out`` of :func:`moe_finalize` checked, or a new one."""
    dtype = moe.expert_out.dtype
    if out is None:
        return torch.empty((T, H), dtype=dtype, device=device)
    spec = torch.empty((1,), dtype=dtype, device=device).expand(T, H)
    check_fused_outputs(op, spec, None, None, None, False, out, None, device)
    clash = validate.overlapping((out,), (moe.expert_out, moe.index, moe.weights, moe.shared))
    if clash is not None:
        name = ("expert_out", "index", "topk_weights", "shared_out")[clash[1]]
        raise ValueError(f"{op}: out shares memory with {name}; it may overlap no input")
    return out


def moe_finalize_reference(expert_out: torch.Tensor, topk_weights: torch.Tensor, *,
                           index: torch.Tensor | None = None, shared_out: torch.Tensor | None = None,
                           scaling: float = 1.0) -> torch.Tensor:
    """:func:`moe_finalize` in plain torch (float32, the same order of operations: the same bits).
    Arguments as there; no checks beyond torch's own. Returns ``(T, H)``."""
    e = expert_out if index is None else expert_out[index.long()]  # (T, K, H)
    w = topk_weights.to(torch.float32)
    acc = torch.zeros((e.shape[0], e.shape[2]), dtype=torch.float32, device=e.device)
    for k in range(e.shape[1]):
        acc = acc + w[:, k:k + 1] * e[:, k].to(torch.float32)
    acc = acc * torch.tensor(scaling, dtype=torch.float32)
    if shared_out is not None:
        acc = acc + shared_out.to(torch.float32)
    return acc.to(expert_out.dtype)


# -- the fused call ----------------------------------------------------------------------------------
def fused_moe_finalize_add_rmsnorm(comm, expert_out, topk_weights, residual, weight, eps=1e-6, *, index=None,
                                   shared_out=None, scaling=1.0, gemma=False, quant=None,
                                   fp8_dtype=torch.float8_e4m3fn, group_size=DEFAULT_GROUP_SIZE,
                                   column_major_scales=False, emit_unquantized=False, scale=None,
                                   swizzled_scales=False, out=None, residual_out=None, q_out=None, scales_out=None):
    """MoE finalize, all-reduce, residual add, RMSNorm: in one launch where the fused norm has one
    (``comm.fused_moe_finalize_add_rmsnorm(...)``).

    Plain torch: ``x = tpcomm.moe_finalize(expert_out, topk_weights, index=index, shared_out=shared_out,
    scaling=scaling)``, then ``comm.fused_add_rmsnorm(x, residual, weight, eps, gemma, quant, ...)``;
    the outputs are that composition's bits (docs/numerics.md, "MoE finalize"), the same on every rank
    for every algorithm and number of tokens.

    Collective: every rank calls it with the same shapes, K, layout, ``scaling``, ``eps`` and quant
    arguments; a peer with another K, H, layout (``index`` or not), ``shared_out`` or not, or
    ``scaling`` is a :class:`~tpcomm.PeerMismatchError` (a timeout if it ran another algorithm).

    Args:
        comm: the :class:`~tpcomm.Communicator`.
        expert_out: this rank's partial expert outputs: ``(T, K, H)`` in token order, or ``(M, H)`` in
            the experts' permuted order with ``index``; bf16 / fp16 / fp32, this device.
        topk_weights: ``(T, K)`` routing weights, float32 / bf16 / fp16 (the same on every rank).
        residual: ``(T, H)`` of ``expert_out``'s dtype, or None.
        weight, eps, gemma, quant: as :meth:`~tpcomm.Communicator.fused_add_rmsnorm`.
        index: ``(T, K)`` int32 / int64, the row of ``expert_out`` of each slot (TensorRT-LLM's
            ``expanded_idx_to_permuted_idx``). Out of ``[0, M)``: ValueError for CPU tensors; on CUDA
            the slot adds nothing and nothing outside ``expert_out`` is read.
        shared_out: ``(T, H)`` partial shared-expert output, ``expert_out``'s dtype, added after the
            scaling.
        scaling: the routed scaling factor (a finite Python float, used rounded to float32).
        fp8_dtype, group_size, column_major_scales, emit_unquantized, scale, swizzled_scales: as
            :meth:`~tpcomm.Communicator.fused_add_rmsnorm`.
        out, residual_out, q_out, scales_out: as :meth:`~tpcomm.Communicator.fused_add_rmsnorm` (``(T, H)``
            shapes).
    Returns:
        What :meth:`~tpcomm.Communicator.fused_add_rmsnorm` returns for ``x`` ``(T, H)``. Safe in CUDA
        graphs.
    Raises:
        TypeError, ValueError: a bad argument (named, with what was expected), nothing written:
            :func:`check_moe_inputs`, and the errors of :meth:`~tpcomm.Communicator.fused_add_rmsnorm`.
        PeerTimeoutError: a peer did not arrive within the timeout; :class:`~tpcomm.PeerMismatchError`
            when it made another call.
    """
    comm._check_open(OP)
    moe, T, H = check_moe_inputs(OP, expert_out, topk_weights, index, shared_out, scaling, comm.device)
    dtype = moe.expert_out.dtype
    if residual is not None:
        validate.check_tensor(OP, "residual", residual, comm.device)
        if tuple(residual.shape) != (T, H):
            raise ValueError(f"{OP}: residual has shape {tuple(residual.shape)}; expected (T, H) = {(T, H)}")
    spec = torch.empty((1,), dtype=dtype, device=comm.device).expand(T, H)  # x's shape, dtype and device
    eps, residual, weight, qout, plan = check_call(  # the fused norm's checks and plan, for its (T, H) rows
        comm, OP, spec, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales,
        emit_unquantized, scale, swizzled_scales, out, residual_out, q_out, scales_out)
    # the kernels read the finalize's inputs in place of x (a prologue's out stands for x)
    reads = {"expert_out": moe.expert_out, "index": moe.index, "topk_weights": moe.weights, "shared_out": moe.shared}
    outs = FusedOutputs.make(spec, residual, weight, scale, plan, qout, emit_unquantized, out, residual_out, q_out,
                             scales_out, op=OP, reads=reads)
    if T == 0:
        return outs.result()
    call = moe.fields()
    if plan.algorithm == "fallback":
        # what the kernels' signatures hold, and the finalize's fields
        fall_back(comm, OP, (T, H, str(dtype), residual is None, eps, gemma, quant, str(fp8_dtype), group_size,
                             swizzled_scales) + call,
                  lambda: outs.fill(reference.fused_add_rmsnorm_reference(_finalized(comm, moe, T, H), outs.rc,
                                                                          outs.wc, eps, gemma, comm.group)))
        return outs.result()
    launch_quant = qout.launch_args(comm.device, emit_unquantized) if qout else None
    if plan.prologue:  # one launch (or one per chunk): the finalize in the kernels' prologue; out stands for x
        x, rows_moe = outs.out, moe
    else:  # two-shot: the standalone finalize, then the fused norm's kernels
        x, rows_moe = torch.empty((T, H), dtype=dtype, device=comm.device), None
        _finalize_into(moe, x, T, H)
    comm._run_rows(OP, plan, x, outs.out, outs.rc, outs.residual_out, outs.wc, T, H, eps, norm=True, gemma=gemma,
                   quant=launch_quant, call=call, moe=rows_moe)
    return outs.result()


def _finalized(comm, moe: MoeIn, T: int, H: int) -> torch.Tensor:
    """The fallback's ``x``: the standalone finalize (plain torch where the kernels cannot run here: the
    same bits)."""
    if _kernels_run_on(comm.device):
        x = torch.empty((T, H), dtype=moe.expert_out.dtype, device=comm.device)
        _finalize_into(moe, x, T, H)
        return x
    return moe_finalize_reference(moe.expert_out, moe.weights, index=moe.index, shared_out=moe.shared,
                                  scaling=moe.scaling)
