"""The custom ops of the all-reduce, the fused add + RMSNorm (unquantised, quantised, and their ``*_out``
forms), the full-width QK norm, the all-gather and the reduce-scatter, and their wrappers (conventions:
:mod:`tpcomm.ops`)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import capture
from ..quant import DEFAULT_GROUP_SIZE, QUANT_MODES, check_unquantized_call
from .registry import group_of, handle_of, lookup, scale_sig, signature, tensor_sig


def _unaligned(*outputs) -> tuple:
    """Signature entries of given outputs that are not 16-byte aligned (none for aligned ones, which
    compile the same kernels as the new outputs of the allocating op, so one warm-up serves both)."""
    return tuple(tensor_sig(t) for t in outputs if t is not None and t.data_ptr() % 16)


# Explicit schemas: ``int handle`` (not the inferred ``SymInt``), so the handle is never traced as a
# symbolic value and the fake implementations could look it up.
@torch.library.custom_op("tpcomm::all_reduce", mutates_args=(), schema="(int handle, Tensor x) -> Tensor")
def _all_reduce_op(handle: int, x: torch.Tensor) -> torch.Tensor:
    comm = lookup(handle)
    capture.before_call(comm, ("all_reduce", tensor_sig(x), (tuple(x.shape), x.dtype, True)))
    return comm.all_reduce(x)


@_all_reduce_op.register_fake
def _(handle, x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tpcomm::all_reduce_out", mutates_args=("out",),
                         schema="(int handle, Tensor x, Tensor(a!) out) -> ()")
def _all_reduce_out_op(handle: int, x: torch.Tensor, out: torch.Tensor) -> None:
    comm = lookup(handle)
    capture.before_call(comm, signature("all_reduce", x, out))
    comm.all_reduce(x, out=out)


@_all_reduce_out_op.register_fake
def _(handle, x, out):
    return None


@torch.library.custom_op("tpcomm::fused_add_rmsnorm", mutates_args=(),
                         schema="(int handle, Tensor x, Tensor? residual, Tensor weight, float eps, bool gemma) "
                                "-> Tensor[]")
def _fused_add_rmsnorm_op(handle: int, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                          eps: float, gemma: bool) -> list[torch.Tensor]:
    comm = lookup(handle)
    capture.before_call(comm, signature(f"fused_add_rmsnorm(gemma={gemma})", x, residual, weight))
    out, residual_out = comm.fused_add_rmsnorm(x, residual, weight, eps=eps, gemma=gemma)
    return [out] if residual_out is None else [out, residual_out]


@_fused_add_rmsnorm_op.register_fake
def _(handle, x, residual, weight, eps, gemma):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return [out] if residual is None else [out, torch.empty_like(out)]


@torch.library.custom_op("tpcomm::fused_add_rmsnorm_fp8", mutates_args=(),
                         schema="(int handle, Tensor x, Tensor? residual, Tensor weight, float eps, bool gemma, "
                                "str quant, ScalarType fp8_dtype, int group_size, bool column_major_scales, "
                                "bool emit_unquantized, Tensor? scale=None, bool swizzled_scales=False) -> Tensor[]")
def _fused_fp8_op(handle, x, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales,
                  emit_unquantized, scale=None, swizzled_scales=False):
    comm = lookup(handle)
    capture.before_call(comm, signature(f"fused_add_rmsnorm(gemma={gemma}, quant={quant}, fp8={fp8_dtype}, "
                                        f"group={group_size}, column_major={column_major_scales}, "
                                        f"swizzled={swizzled_scales}, unquantized={emit_unquantized})",
                                        x, residual, weight) + (scale_sig(scale),))
    q, scales, residual_out, out = comm.fused_add_rmsnorm(
        x, residual, weight, eps=eps, gemma=gemma, quant=quant, fp8_dtype=fp8_dtype, group_size=group_size,
        column_major_scales=column_major_scales, emit_unquantized=emit_unquantized, scale=scale,
        swizzled_scales=swizzled_scales)
    if quant == "fp8_static":
        scales = None  # the input scale itself: the wrapper returns it
    return [t for t in (q, scales, residual_out, out) if t is not None]


@_fused_fp8_op.register_fake
def _(handle, x, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales,
      emit_unquantized, scale=None, swizzled_scales=False):
    from ..quant import fp8_outputs

    # the communicator's own allocation (and validation): the same shapes and strides (column-major
    # scales are the transpose of a contiguous (H / group_size, T) tensor)
    outs = fp8_outputs("fused_add_rmsnorm", x, quant, fp8_dtype, group_size, column_major_scales, scale=scale,
                       swizzled_scales=swizzled_scales)
    extra = [torch.empty(x.shape, dtype=x.dtype, device=x.device)] if residual is not None else []
    if emit_unquantized:
        extra.append(torch.empty(x.shape, dtype=x.dtype, device=x.device))
    return [outs.q_fp8] + ([] if quant == "fp8_static" else [outs.scales_view]) + extra


# Out forms: the caller's tensors receive the outputs. ``residual_out=None`` with a residual means the
# residual is updated in place (declared mutable for that); a separate residual_out is passed as such.
@torch.library.custom_op("tpcomm::fused_add_rmsnorm_out", mutates_args=("residual", "out", "residual_out"),
                         schema="(int handle, Tensor x, Tensor(a!)? residual, Tensor weight, float eps, bool gemma, "
                                "Tensor(b!) out, Tensor(c!)? residual_out) -> ()")
def _fused_add_rmsnorm_out_op(handle, x, residual, weight, eps, gemma, out, residual_out) -> None:
    comm = lookup(handle)
    capture.before_call(comm, signature(f"fused_add_rmsnorm(gemma={gemma})", x, residual, weight)
                       + _unaligned(out, residual_out))
    comm.fused_add_rmsnorm(x, residual, weight, eps=eps, gemma=gemma, out=out,
                           residual_out=residual if residual_out is None else residual_out)


@_fused_add_rmsnorm_out_op.register_fake
def _(handle, x, residual, weight, eps, gemma, out, residual_out):
    return None


@torch.library.custom_op("tpcomm::fused_add_rmsnorm_fp8_out",
                         mutates_args=("residual", "q", "scales", "residual_out", "out"),
                         schema="(int handle, Tensor x, Tensor(a!)? residual, Tensor weight, float eps, bool gemma, "
                                "str quant, ScalarType fp8_dtype, int group_size, bool column_major_scales, "
                                "Tensor(b!) q, Tensor(c!)? scales, Tensor(d!)? residual_out, Tensor(e!)? out, "
                                "Tensor? scale=None, bool swizzled_scales=False) -> ()")
def _fused_fp8_out_op(handle, x, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales,
                      q, scales, residual_out, out, scale=None, swizzled_scales=False) -> None:
    comm = lookup(handle)
    capture.before_call(comm, signature(f"fused_add_rmsnorm(gemma={gemma}, quant={quant}, fp8={fp8_dtype}, "
                                        f"group={group_size}, column_major={column_major_scales}, "
                                        f"swizzled={swizzled_scales}, unquantized={out is not None})",
                                        x, residual, weight) + (scale_sig(scale),)
                       + _unaligned(q, scales, residual_out, out))
    comm.fused_add_rmsnorm(x, residual, weight, eps=eps, gemma=gemma, quant=quant, fp8_dtype=fp8_dtype,
                           group_size=group_size, column_major_scales=column_major_scales,
                           emit_unquantized=out is not None, out=out, q_out=q, scales_out=scales,
                           residual_out=residual if residual_out is None else residual_out, scale=scale,
                           swizzled_scales=swizzled_scales)


@_fused_fp8_out_op.register_fake
def _(handle, x, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales, q, scales,
      residual_out, out, scale=None, swizzled_scales=False):
    return None


@torch.library.custom_op("tpcomm::fused_qk_rmsnorm", mutates_args=(),
                         schema="(int handle, Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, "
                                "int kv_replicas=1) -> Tensor[]")
def _fused_qk_rmsnorm_op(handle, q, k, q_weight, k_weight, eps, kv_replicas=1) -> list[torch.Tensor]:
    comm = lookup(handle)  # the row strides go into the kernel's specialisation (packed QKV views); the
    # kernel takes kv_replicas unspecialised, so a warmed call of any kv_replicas covers the others
    capture.before_call(comm, signature("fused_qk_rmsnorm", q, k, q_weight, k_weight) + (q.stride(), k.stride()))
    return list(comm.fused_qk_rmsnorm(q, k, q_weight, k_weight, eps, kv_replicas=kv_replicas))


@_fused_qk_rmsnorm_op.register_fake
def _(handle, q, k, q_weight, k_weight, eps, kv_replicas=1):
    return [q.new_empty(q.shape), k.new_empty(k.shape)]


def _lookup_group(op: str, handle: int, rank: int, world_size: int):
    comm = lookup(handle)
    if (comm.rank, comm.world_size) != (rank, world_size):
        raise ValueError(f"{op}: rank {rank} of {world_size} was passed for handle {handle}, whose communicator "
                         f"is rank {comm.rank} of {comm.world_size}")
    return comm


def _norm_dim(op: str, x: torch.Tensor, dim: int) -> int:
    if x.dim() < 1 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim must be in [{-x.dim()}, {x.dim()}) for x of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    return dim % x.dim()


# all_gather and reduce_scatter take the group's rank and size as arguments: their output shapes depend
# on them, and a fake implementation must be a function of its arguments alone. Inductor's FX graph cache
# (on disk, shared by the processes of a machine) keys a compiled graph by its code and arguments: with
# the rank read from the registry, rank 1's compiled reduce_scatter, whose handle had the same number,
# was served to rank 0 with rank 1's output size (seen on CPU ranks, torch 2.13).
@torch.library.custom_op("tpcomm::all_gather", mutates_args=(),
                         schema="(int handle, Tensor x, int dim, int rank, int world_size) -> Tensor")
def _all_gather_op(handle: int, x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    comm = _lookup_group("all_gather", handle, rank, world_size)
    capture.before_call(comm, signature(f"all_gather(dim={dim})", x))
    return comm.all_gather(x, dim).contiguous()  # contiguous as the fake says (a no-op unless dim != 0)


@_all_gather_op.register_fake
def _(handle, x, dim, rank, world_size):
    dim = _norm_dim("all_gather", x, dim)
    shape = list(x.shape)
    shape[dim] = shape[dim] * world_size
    return x.new_empty(shape)


@torch.library.custom_op("tpcomm::reduce_scatter", mutates_args=(),
                         schema="(int handle, Tensor x, int dim, int rank, int world_size) -> Tensor")
def _reduce_scatter_op(handle: int, x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    comm = _lookup_group("reduce_scatter", handle, rank, world_size)
    capture.before_call(comm, signature(f"reduce_scatter(dim={dim})", x))
    return comm.reduce_scatter(x, dim).contiguous()


@_reduce_scatter_op.register_fake
def _(handle, x, dim, rank, world_size):
    dim = _norm_dim("reduce_scatter", x, dim)
    shape = list(x.shape)
    # rank's share of T rows as torch.tensor_split cuts them (reference.share_bounds):
    # T // W + (1 if rank < T % W else 0), as one expression; a branch on a symbolic T would add a guard
    shape[dim] = (shape[dim] + world_size - 1 - rank) // world_size
    return x.new_empty(shape)


# -- wrappers -------------------------------------------------------------------------------------------
def all_reduce(comm, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``comm.all_reduce(x, out)`` through the op ``tpcomm::all_reduce`` (or ``all_reduce_out`` with
    ``out``): the sum of ``x`` over the ranks, same bits as the method, safe under ``torch.compile``
    (fullgraph) and in CUDA graphs.

    Collective: every rank calls it with the same shape and dtype.

    Args:
        comm: a :class:`tpcomm.Communicator` (or its handle from :func:`register`).
        x: any shape; bf16 / fp16 / fp32, or an integer dtype (as ``Communicator.all_reduce``: gathered
            by the all-gather kernel and summed exactly).
        out: optional output of ``x``'s shape and dtype; may be ``x`` itself (in place). Eagerly it may
            also overlap ``x`` otherwise (as ``Communicator.all_reduce``); the op's schema does not
            declare that aliasing, so under ``torch.compile`` pass ``x`` itself or a separate tensor.
    Returns:
        ``out``, or a new contiguous tensor shaped like ``x``.
    Raises:
        As :meth:`tpcomm.Communicator.all_reduce` (``TypeError`` / ``ValueError`` naming the argument,
        ``PeerTimeoutError``); ``LookupError`` for an unknown handle.
    """
    handle = handle_of(comm)
    if out is None:
        return torch.ops.tpcomm.all_reduce(handle, x)
    torch.ops.tpcomm.all_reduce_out(handle, x, out)
    return out


def fused_add_rmsnorm(comm, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float = 1e-6, gemma: bool = False, quant: str | None = None,
                      fp8_dtype: torch.dtype = torch.float8_e4m3fn, group_size: int = DEFAULT_GROUP_SIZE,
                      column_major_scales: bool = False, emit_unquantized: bool = False, *,
                      scale: torch.Tensor | None = None, swizzled_scales: bool = False,
                      out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                      q_out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None):
    """``comm.fused_add_rmsnorm(...)`` through the op ``tpcomm::fused_add_rmsnorm`` (or
    ``tpcomm::fused_add_rmsnorm_fp8`` with ``quant``): all-reduce ``x``, add ``residual``, RMSNorm, and
    optionally quantise to FP8, in one kernel; the method's bits.

    Plain torch: ``s = all_reduce(x); residual_out = s + residual; out = rms_norm(residual_out, w, eps)``
    (``w`` replaced by ``1 + w`` when ``gemma``), with the numerics contract (docs/numerics.md); with
    ``quant``, ``q, scales = per_token_quant_fp8(out)`` (or per group; ``q = static_quant_fp8(out, scale)``
    for ``fp8_static``).

    Collective: every rank calls it with the same shapes, dtypes and arguments.

    Args:
        comm: a :class:`tpcomm.Communicator` (or its handle from :func:`register`).
        x: ``(T, H)`` (or ``(..., H)``), bf16 / fp16 / fp32.
        residual: like ``x``, or None (then ``s`` itself is normalised).
        weight: ``(H,)``, a float dtype.
        eps: >= 0, added to the mean square (default 1e-6, the Communicator's default).
        gemma: use ``1 + w`` (Gemma-style norms).
        quant, fp8_dtype, group_size, column_major_scales, emit_unquantized, scale, swizzled_scales: as
            :meth:`tpcomm.Communicator.fused_add_rmsnorm` (defaults are its defaults; ``scale``, the
            input of ``fp8_static`` and ``nvfp4``, is an argument of the op, so a compiled graph or a CUDA
            graph reads its current value).
        out, residual_out, q_out, scales_out: outputs to write, as the method takes them
            (``residual_out=residual`` updates the residual in place); with any of them the call goes
            through ``tpcomm::fused_add_rmsnorm_out`` (or ``fused_add_rmsnorm_fp8_out``), which mutates
            them, and the others are allocated here.
    Returns:
        Without ``quant``: ``(out, residual_out)`` shaped like ``x`` (``residual_out`` None without a
        residual). With ``quant``: ``(q, scales, residual_out, out)`` (``out`` None unless
        ``emit_unquantized``; ``scales`` is ``scale`` itself for ``fp8_static``), as the method returns them.
    Raises:
        As :meth:`tpcomm.Communicator.fused_add_rmsnorm`; ``LookupError`` for an unknown handle.
    """
    handle = handle_of(comm)
    if out is not None or residual_out is not None or q_out is not None or scales_out is not None:
        return _fused_out(handle, x, residual, weight, eps, gemma, quant, fp8_dtype, group_size,
                          column_major_scales, emit_unquantized, out, residual_out, q_out, scales_out, scale,
                          swizzled_scales)
    if quant is None:  # the method refuses these options too; the op has no slot for them
        check_unquantized_call("fused_add_rmsnorm", fp8_dtype, group_size, column_major_scales, emit_unquantized,
                               scale, swizzled_scales)
        outs = torch.ops.tpcomm.fused_add_rmsnorm(handle, x, residual, weight, eps, gemma)
        return (outs[0], None) if residual is None else (outs[0], outs[1])
    outs = torch.ops.tpcomm.fused_add_rmsnorm_fp8(handle, x, residual, weight, eps, gemma, quant, fp8_dtype,
                                                  group_size, column_major_scales, emit_unquantized, scale,
                                                  swizzled_scales)
    if quant == "fp8_static":  # the op returns no scales: they are the input scale
        q, scales, rest = outs[0], scale, list(outs[1:])
    else:
        q, scales, rest = outs[0], outs[1], list(outs[2:])
    residual_out = rest.pop(0) if residual is not None else None
    out = rest.pop(0) if emit_unquantized else None
    return q, scales, residual_out, out


def _fused_out(handle, x, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales,
               emit_unquantized, out, residual_out, q_out, scales_out, scale=None, swizzled_scales=False):
    """:func:`fused_add_rmsnorm` with given outputs: the missing ones allocated here, as the method would
    (so the op always has every output to mutate)."""
    # Outputs that are inputs themselves (the method refuses them; under torch.compile the op would get a
    # functional copy, and the overlap would go unseen): refused here, where the objects are still known.
    for name, t in (("out", out), ("residual_out", residual_out), ("q_out", q_out), ("scales_out", scales_out)):
        for other_name, other in (("x", x), ("weight", weight)) + ((("residual", residual),) if name != "residual_out"
                                                                    else ()):
            if t is not None and t is other:
                raise ValueError(f"fused_add_rmsnorm: {name} shares memory with {other_name}; outputs may overlap "
                                 "no input and no other output (residual_out may be residual itself)")
    given = [(n, t) for n, t in (("out", out), ("residual_out", residual_out), ("q_out", q_out),
                                 ("scales_out", scales_out)) if t is not None]
    for i, (name, t) in enumerate(given):
        for other_name, other in given[i + 1:]:
            if t is other:
                raise ValueError(f"fused_add_rmsnorm: {name} shares memory with {other_name}; outputs may overlap "
                                 "no input and no other output (residual_out may be residual itself)")
    # residual_out that is the residual's own memory (the object, or eagerly a view of all of it): in place,
    # so the op never gets two mutable arguments that alias
    in_place = residual is not None and residual_out is not None and (
        residual_out is residual or (not torch.compiler.is_compiling()
                                     and residual_out.data_ptr() == residual.data_ptr()
                                     and residual_out.shape == residual.shape
                                     and residual_out.stride() == residual.stride()
                                     and residual_out.dtype == residual.dtype))
    if residual_out is None and residual is not None:
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    passed_residual_out = None if in_place else residual_out
    if quant is None:
        check_unquantized_call("fused_add_rmsnorm", fp8_dtype, group_size, column_major_scales, emit_unquantized,
                               scale, swizzled_scales)
        if q_out is not None or scales_out is not None:
            raise ValueError(f"fused_add_rmsnorm: q_out and scales_out need quant= (one of {', '.join(QUANT_MODES)})")
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        torch.ops.tpcomm.fused_add_rmsnorm_out(handle, x, residual, weight, eps, gemma, out, passed_residual_out)
        return out, residual_out
    from ..quant import fp8_outputs

    if out is not None and not emit_unquantized:  # as the method refuses it
        raise ValueError(f"fused_add_rmsnorm: out with quant={quant!r} needs emit_unquantized=True (otherwise no "
                         "unquantised output is written)")
    if out is None and emit_unquantized:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if quant == "fp8_static":  # no scales to write
        fresh = fp8_outputs("fused_add_rmsnorm", x, quant, fp8_dtype, group_size, column_major_scales, q_out,
                            scales_out, scale, swizzled_scales)  # the method's validation, where the objects are known
        torch.ops.tpcomm.fused_add_rmsnorm_fp8_out(handle, x, residual, weight, eps, gemma, quant, fp8_dtype,
                                                   group_size, column_major_scales, fresh.q_fp8, None,
                                                   passed_residual_out, out, scale)
        return fresh.q_fp8, scale, residual_out, out
    if q_out is None or scales_out is None:  # the method's own allocation (and validation) of the rest
        fresh = fp8_outputs("fused_add_rmsnorm", x, quant, fp8_dtype, group_size, column_major_scales, q_out,
                            scales_out, scale, swizzled_scales)
        q_out, scales_out = fresh.q_fp8, fresh.scales_view
    torch.ops.tpcomm.fused_add_rmsnorm_fp8_out(handle, x, residual, weight, eps, gemma, quant, fp8_dtype,
                                               group_size, column_major_scales, q_out, scales_out,
                                               passed_residual_out, out, scale, swizzled_scales)
    return q_out, scales_out, residual_out, out


def all_gather(comm, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``comm.all_gather(x, dim)`` through the op ``tpcomm::all_gather``: every rank's ``x``
    concatenated along ``dim`` in rank order.

    Collective: every rank calls it with the same shape and dtype.

    Args:
        comm: a :class:`tpcomm.Communicator` (or its handle from :func:`register`).
        x: at least one dimension, any dtype.
        dim: the dimension to concatenate along (negative counts from the end).
    Returns:
        A new contiguous tensor: ``x``'s shape with ``dim`` multiplied by the world size.
    Raises:
        As :meth:`tpcomm.Communicator.all_gather`; ``LookupError`` for an unknown handle.
    """
    handle, rank, world_size = group_of(comm)
    return torch.ops.tpcomm.all_gather(handle, x, dim, rank, world_size)


def reduce_scatter(comm, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``comm.reduce_scatter(x, dim)`` through the op ``tpcomm::reduce_scatter``: the sum over the ranks,
    this rank's share along ``dim`` (cut as ``torch.tensor_split(sum, world_size, dim)``: the first
    ``T % W`` ranks get one row more). Under ``torch.compile`` the output's shape depends on the rank,
    which this wrapper passes to the op (its fake implementation computes the shape from it).

    Collective: every rank calls it with the same shape and dtype.

    Args:
        comm: a :class:`tpcomm.Communicator` (or its handle from :func:`register`).
        x: at least one dimension; bf16 / fp16 / fp32 or an integer dtype.
        dim: the dimension to scatter along (negative counts from the end).
    Returns:
        A new contiguous tensor, this rank's share.
    Raises:
        As :meth:`tpcomm.Communicator.reduce_scatter`; ``LookupError`` for an unknown handle.
    """
    handle, rank, world_size = group_of(comm)
    return torch.ops.tpcomm.reduce_scatter(handle, x, dim, rank, world_size)


def fused_qk_rmsnorm(comm, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: float = 1e-6, *, kv_replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``comm.fused_qk_rmsnorm(q, k, q_weight, k_weight, eps, kv_replicas=kv_replicas)`` through the op
    ``tpcomm::fused_qk_rmsnorm``: RMSNorm of this rank's ``q`` ``(T, Nq / W)`` and ``k``
    ``(T, Nk * kv_replicas / W)`` columns over their full width (``k``'s distinct columns counted once
    where groups of ``kv_replicas`` ranks hold the same ones), the method's bits; new contiguous outputs.

    Collective: every rank calls it with the same ``T``, widths, dtype, ``eps`` and ``kv_replicas``.

    Raises:
        TypeError, ValueError, PeerTimeoutError: as :meth:`tpcomm.Communicator.fused_qk_rmsnorm`.
        LookupError: an unknown handle.
    """
    q_out, k_out = torch.ops.tpcomm.fused_qk_rmsnorm(handle_of(comm), q, k, q_weight, k_weight, eps, kv_replicas)
    return q_out, k_out
