"""``fused_qk_rmsnorm``: full-width RMSNorm of the query and key projections of tensor-parallel attention.

Plain torch, with ``q_full`` / ``k_full`` the unsharded ``(T, Nq)`` / ``(T, Nk)`` and rank ``r`` holding
columns ``[r * Nq / W, (r + 1) * Nq / W)`` (its heads)::

    q_out = rms_norm(q_full, w_q, eps)[:, this rank's columns]     # mean of squares over all Nq columns
    k_out = rms_norm(k_full, w_k, eps)[:, this rank's columns]

With ``kv_replicas = R`` (more ranks than key-value heads), the ranks ``g * R .. g * R + R - 1`` hold the same
``k`` columns, ``[g * Nk * R / W, (g + 1) * Nk * R / W)``, and the mean of squares of ``k`` counts each
distinct column once.

Numerics contract (docs/numerics.md, "Full-width QK norm"): each rank's float32 sums of squares of its
columns (the fused norm's order), summed over the ranks in rank order in float32 from +0.0, so every rank
scales a token by the same bits; then the fused norm's item 3 over the full width. With replicated ``k``
only the first rank of each replica group adds its k sum (the others add +0.0, which changes no bit of a
sum that is never negative): the same bits as the call on a group without replication. The kernel
(``tpcomm/kernels/qk_norm.py``) and the fallback below give the same bits.

The host path, top to bottom: check the arguments -> make or check the outputs -> plan (the kernel, or the
fallback: no workspace, or ``fallback`` forced) -> launch in chunks of what a Lamport slot holds, or fall
back (an all-reduce of the ``(T, 2)`` float32 partial sums, then the two norms in torch).
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from .. import call_cache, dispatch
from ..env import interpreter_enabled
from ..kernels.qk_norm import qk_norm_call, rows_per_block
from ..reference import qk_partial_sums_reference, rms_norm_from_total_reference
from ..validate import check_tensor
from .fallback import HOST_WRITES
from .fused_norm import FLOAT32_MAX

OP = "fused_qk_rmsnorm"


def fused_qk_rmsnorm(comm, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: float = 1e-6, *, q_out: torch.Tensor | None = None,
                     k_out: torch.Tensor | None = None, kv_replicas: int = 1,
                     key=None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``q`` and ``k`` over their full width (every rank's columns), on communicator ``comm``.

    Collective: every rank calls it with the same ``T``, widths, dtype, ``eps`` and ``kv_replicas`` (a peer
    with another width, token count, dtype, ``eps`` or ``kv_replicas`` is detected:
    :class:`~tpcomm.PeerMismatchError`).

    Args:
        q: ``(T, Hq)``, this rank's ``Hq = Nq / W`` columns (its heads, ``num_heads / W * head_dim``), bf16 /
            fp16 / fp32, this device. Rows may be strided (a column view of a packed QKV projection
            output is read in place); a column stride other than 1 is copied first.
        k: ``(T, Hk)``, this rank's ``Nk * kv_replicas / W`` columns, ``q``'s dtype, the same ``T``.
        q_weight, k_weight: ``(Hq,)`` and ``(Hk,)``, this rank's slices of the full-width norm weights, of
            the input's dtype or float32 (used as ``f32(w)``).
        eps: >= 0, finite in float32, added to the mean square.
        q_out, k_out: where to write the results instead of new tensors: ``q``'s / ``k``'s shape and
            dtype, unit column stride (rows may be strided). ``q_out`` may be ``q`` itself and ``k_out``
            ``k`` itself (in place); otherwise an output shares no memory with an input or the other
            output.
        kv_replicas: ``R``, a divisor of the world size ``W`` (an int >= 1): each group of ``R``
            consecutive ranks holds the same ``k`` columns (a model with fewer key-value heads than
            ranks replicates each head on ``R = W / num_key_value_heads`` ranks). The k norm's width is
            ``N = W / R * Hk``; the first rank of each group contributes its sum of squares, so the
            others' ``k`` must be the same values (their own columns are normalised with that total).
            1 (the default): every rank holds its own columns.
    Returns:
        ``(q_out, k_out)``: ``T((f32(x) * inv) * f32(w))`` with ``inv = 1 / sqrt(S / N + eps)``, ``S`` the
        row's sum of squares over the ``N = W * H`` columns of every rank (``W / kv_replicas * Hk`` distinct
        columns for ``k``; docs/numerics.md, "Full-width QK norm": the same ``inv`` bits on every rank,
        and with ``kv_replicas`` the same bits as a group without replication; 16-bit outputs take the
        weight first where ``inv`` is finite and non-zero). Safe in CUDA graphs. One launch per call (more
        above ``lamport_slot_bytes / 8`` tokens). No tokens, or no columns in ``q`` and ``k`` (``H = 0``):
        empty outputs, no communication (as the fused norm); one of them without columns: its output is
        empty and the other is normalised through the unfused path.
    Raises:
        TypeError: a tensor argument is not a tensor; ``q`` is not bf16 / fp16 / fp32; ``k`` or an output
            has another dtype than ``q``; a weight is neither its input's dtype nor float32; ``eps`` is not
            a real number; ``kv_replicas`` is not an int.
        ValueError: ``q`` or ``k`` is not 2-D; ``k`` has another ``T`` than ``q``; a weight's shape is not
            its input's width; ``eps`` is negative or not finite in float32; ``kv_replicas`` is < 1 or does
            not divide the world size; a tensor is on another device; an output has the wrong shape, a
            column stride other than 1, or overlaps an input or the other output.
        PeerMismatchError, PeerTimeoutError: a peer made another call (another width or ``kv_replicas``
            included) or did not arrive within the timeout (this or an earlier call).
    """
    comm._check_open(OP)
    given = (q_out is not None, k_out is not None)
    eps = _check_inputs(q, k, q_weight, k_weight, eps, comm.device)
    kv_replicas = check_replicas(kv_replicas, comm.world_size)
    q, k = _readable(q), _readable(k)
    q_weight, k_weight = q_weight.resolve_neg().contiguous(), k_weight.resolve_neg().contiguous()
    q_out, k_out = _outputs(q, k, q_weight, k_weight, q_out, k_out, comm.device)
    if q.shape[0] == 0 or q.shape[1] == k.shape[1] == 0:  # nothing to normalise: no communication
        return q_out, k_out
    if _plan(comm, q, k) == "fallback" or 0 in (q.shape[1], k.shape[1]):  # one side empty: the unfused path
        _fallback(comm, q, k, q_weight, k_weight, eps, q_out, k_out, kv_replicas)
    else:
        _launch(comm, q, k, q_weight, k_weight, eps, q_out, k_out, given, key, kv_replicas)
    return q_out, k_out


# -- 1. arguments ------------------------------------------------------------------------------------------
def _check_inputs(q, k, q_weight, k_weight, eps, device: torch.device) -> float:
    """The Raises section's input checks; returns ``eps`` as a float (-0.0 as +0.0: one signature)."""
    for name, t in (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(OP, name, t, device)
    if q.dtype not in dispatch.KERNEL_DTYPES:
        raise TypeError(f"{OP}: q has dtype {q.dtype}; expected bfloat16, float16 or float32")
    if k.dtype != q.dtype:
        raise TypeError(f"{OP}: k has dtype {k.dtype} but q has {q.dtype}; expected the same dtype")
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 2:
            raise ValueError(f"{OP}: {name} has shape {tuple(t.shape)}; expected (T, H), this rank's columns")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{OP}: k has {k.shape[0]} rows (tokens) but q has {q.shape[0]}; expected the same T")
    for name, w, x in (("q_weight", q_weight, q), ("k_weight", k_weight, k)):
        if w.shape != (x.shape[1],):
            raise ValueError(f"{OP}: {name} has shape {tuple(w.shape)}; expected ({x.shape[1]},), the width of "
                             f"{name[0]} (this rank's slice of the full-width weight)")
        if w.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"{OP}: {name} has dtype {w.dtype}; expected {x.dtype} (the input's) or float32")
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{OP}: eps must be a real number, got {type(eps).__name__}")
    eps = float(eps) + 0.0
    if not 0.0 <= eps <= FLOAT32_MAX:  # the kernel adds it in float32
        raise ValueError(f"{OP}: eps must be >= 0 and finite in float32 (<= {FLOAT32_MAX:.4g}), got {eps}")
    return eps


def check_replicas(kv_replicas, world_size: int) -> int:
    """The Raises section's ``kv_replicas`` checks: an int (not a bool) >= 1 that divides ``world_size``;
    returns it as a Python int (one signature for every integer type)."""
    if isinstance(kv_replicas, (bool, np.bool_)) or not isinstance(kv_replicas, numbers.Integral):
        raise TypeError(f"{OP}: kv_replicas must be an int, got {type(kv_replicas).__name__}")
    if kv_replicas < 1 or world_size % kv_replicas:
        raise ValueError(f"{OP}: kv_replicas must be a divisor of the world size {world_size} (the ranks of a "
                         f"group holding the same k columns), got {kv_replicas}")
    return int(kv_replicas)


def _readable(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel reads it: rows of unit column stride (a lazily negated view made real)."""
    x = x.resolve_neg()
    return x if x.stride(1) == 1 or x.shape[1] == 1 else x.contiguous()


# -- 2. outputs --------------------------------------------------------------------------------------------
def _outputs(q, k, q_weight, k_weight, q_out, k_out, device: torch.device):
    """The given outputs checked (the Raises section), the missing ones made."""
    for name, out, x in (("q_out", q_out, q), ("k_out", k_out, k)):
        if out is None:
            continue
        check_tensor(OP, name, out, device)
        if out.dtype != x.dtype:
            raise TypeError(f"{OP}: {name} has dtype {out.dtype}; expected {x.dtype}")
        if out.shape != x.shape:
            raise ValueError(f"{OP}: {name} has shape {tuple(out.shape)}; expected {tuple(x.shape)}")
        if out.shape[0] and (out.stride(1) != 1 and out.shape[1] > 1 or out.is_neg()):
            raise ValueError(f"{OP}: {name} has strides {out.stride()}; expected a column stride of 1 (rows may "
                             "be strided) and no lazily negated view")
        if out.shape[0] > 1 and abs(out.stride(0)) < out.shape[1]:
            raise ValueError(f"{OP}: {name} has strides {out.stride()}: its rows share memory")
    inputs = {"q": q, "k": k, "q_weight": q_weight, "k_weight": k_weight}
    outputs = {"q_out": q_out, "k_out": k_out}
    for name, out in outputs.items():
        for other, t in list(inputs.items()) + [(n, o) for n, o in outputs.items() if n != name]:
            if out is None or t is None or (name, other) in (("q_out", "q"), ("k_out", "k")) and _same(out, t):
                continue
            if _shares_memory(out, t):
                raise ValueError(f"{OP}: {name} shares memory with {other}; outputs may overlap no input and no "
                                 "other output (q_out may be q itself, k_out k itself)")
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return q_out, k_out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether 2-D ``a`` and ``b`` (unit column stride, or one column) have an element in common: exact for
    column views of one buffer with the same row stride (packed QKV), by byte spans otherwise."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1, sa, wa), (b0, b1, sb, wb) = _rows(a), _rows(b)
    if not (a0 < b1 and b0 < a1):
        return False
    es = a.element_size()
    if a.dim() != 2 or b.dim() != 2 or b.element_size() != es or sb != sa or sa < max(wa, wb) or (b0 - a0) % es:
        return True  # spans meet: assumed to share
    # the same row stride: compare the column intervals inside one row (the offset modulo a row)
    d = ((b0 - a0) // es) % sa
    return d < wa or d + wb > sa  # b's columns start inside a's, or wrap into a's next row


def _rows(t: torch.Tensor) -> tuple[int, int, int, int]:
    """``(first byte, end byte, row stride, width)`` of ``t``: 2-D of unit column stride, or 1-D
    contiguous (one row)."""
    rows, stride, width = (t.shape[0], t.stride(0), t.shape[1]) if t.dim() == 2 else (1, t.numel(), t.numel())
    start = t.data_ptr()
    return start, start + ((rows - 1) * stride + width) * t.element_size(), stride, width


# -- 3. plan -----------------------------------------------------------------------------------------------
def _plan(comm, q: torch.Tensor, k: torch.Tensor) -> str:
    """``"kernel"``, or ``"fallback"`` where the communicator has no workspace (``fallback_reason``) or
    ``fallback`` is forced (``TPCOMM_ALGO``, ``use_algorithm``): what :meth:`~tpcomm.Communicator.plan`
    says (:func:`tpcomm.dispatch.qk_norm_plan`); every other algorithm runs the kernel, the op's only one."""
    width = q.shape[1] + k.shape[1]
    plan = comm.plan(OP, q.shape[0] * width * q.element_size(), width, q.dtype)
    return "fallback" if plan.algorithm == "fallback" else "kernel"


# -- 4. launch ---------------------------------------------------------------------------------------------
def _launch(comm, q, k, q_weight, k_weight, eps, q_out, k_out, given=(False, False), key=None,
            kv_replicas: int = 1) -> None:
    """The kernel over every row, in launches of what one Lamport slot holds (8 bytes a row); a call of one
    launch on the caller's own tensors is recorded under ``key`` (:mod:`tpcomm.call_cache`)."""
    ws = comm.workspace
    T, Hq, Hk = q.shape[0], q.shape[1], k.shape[1]
    in_place = _same(q_out, q) or _same(k_out, k)  # a barrier between a tile's reads and its writes
    cfg_q, cfg_k = dispatch.row_config(Hq, ws.max_programs), dispatch.row_config(Hk, ws.max_programs)
    per_launch = ws.lamport_slot_bytes // 8
    launches = []
    for r0 in range(0, T, per_launch):
        r1 = min(T, r0 + per_launch)
        rows = rows_per_block(r1 - r0, ws.max_programs, interpreter_enabled())
        sig = comm._sign(OP, str(q.dtype), T, r0, r1, Hq, Hk, eps, kv_replicas)
        piece = (lambda t: t) if r0 == 0 and r1 == T else (lambda t: t[r0:r1])
        launches.append(qk_norm_call(piece(q), piece(k), q_weight, k_weight, piece(q_out), piece(k_out), ws, eps,
                                     sig, in_place, cfg_q, cfg_k, rows, kv_replicas))
    launched = [] if key is not None and len(launches) == 1 else None
    comm._run(OP, launches, record=launched)
    if launched:
        tensors = (q, k, q_weight, k_weight, q_out, k_out)
        comm._remember(key, launched, tensors, call_cache.qk_spec(tensors, given))


# -- 5. fallback -------------------------------------------------------------------------------------------
def _fallback(comm, q, k, q_weight, k_weight, eps, q_out, k_out, kv_replicas: int = 1) -> None:
    """The unfused path: first, on a communicator with kernels, one launch signed with this call, so a
    peer making another call (another width or ``kv_replicas`` included) fails on every rank instead of pairing its
    collective with this one; then :func:`unfused_qk_rmsnorm`."""
    comm._before_fallback(OP, (str(q.dtype), q.shape[0], q.shape[1], k.shape[1], eps, kv_replicas))
    qo, ko = unfused_qk_rmsnorm(comm, q, k, q_weight, k_weight, eps, kv_replicas)
    with HOST_WRITES():  # as the other ops' fallbacks write
        q_out.copy_(qo)
        k_out.copy_(ko)


def unfused_qk_rmsnorm(comm, q, k, q_weight, k_weight, eps: float = 1e-6,
                       kv_replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The op without its kernel, on checked arguments: the ``(T, 2)`` float32 partial sums
    (:func:`~tpcomm.reference.qk_partial_sums_reference`; +0.0 for k on a rank that is not the first of
    its ``kv_replicas`` group), ``comm.all_reduce`` of them (rank order, float32 from +0.0), then the two
    norms in torch (the kernel's operations): the same bits as the kernel. Collective. Returns new
    ``(q_out, k_out)``."""
    W = comm.world_size
    sums = qk_partial_sums_reference(q, k)
    if comm.rank % kv_replicas:
        sums[:, 1] = 0.0
    total = comm.all_reduce(sums)
    return (rms_norm_from_total_reference(q, q_weight, total[:, :1], W * q.shape[1], eps),
            rms_norm_from_total_reference(k, k_weight, total[:, 1:], W // kv_replicas * k.shape[1], eps))
