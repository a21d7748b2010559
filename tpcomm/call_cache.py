"""Decide once per call shape: the cached path of :class:`~tpcomm.Communicator`'s ops.

A call's **key** holds everything its validation, plan and launches depend on: the op; each tensor
argument's type, shape, dtype, strides and device; every scalar argument with its type (so ``eps=True``
and ``eps=1`` differ, as validation tells them apart); the algorithm in force (``use_algorithm``,
``TPCOMM_ALGO``); on CUDA, each pointer's 16-byte alignment (which Triton specialises on). The first call
with a key runs the full path: it validates, plans, compiles and launches, and records each launch as a
:class:`~tpcomm.kernels.launch.Replay` whose tensor parameters are slots for the call's tensors. A later
call with the same key checks what two such calls can still differ in (the communicator is open, no
error is recorded, an ``out`` that overlaps ``x`` in part), allocates its outputs, and replays the
launches with its own tensors: the same kernels, grids and parameters, so the same bits.

Only calls whose validation passed are recorded, so an invalid call never matches a key and raises what
the full path raises, on every call. Calls that are not recorded, and take the full path every time:
non-contiguous tensors (the full path copies them), tensor subclasses, chunked launches whose tensors
are views, the fallback, integer sums, all-gathers moved as bytes, ``dim != 0``, empty tensors.

The cache is per communicator and bounded (``MAX_ENTRIES``, oldest first out).
"""

from __future__ import annotations

import torch

from .kernels.launch import KernelCall, Replay
from .validate import overlapping

#: Keys a communicator remembers; the oldest goes first.
MAX_ENTRIES = 512

_Tensor = torch.Tensor
_CONTIGUOUS = torch.contiguous_format


def _tensor_key(t) -> tuple | None:
    """``(shape, dtype, strides, device)`` of a plain tensor, or None for anything else."""
    if type(t) is not _Tensor and type(t) is not torch.nn.Parameter:
        return None
    return t.shape, t.dtype, t.stride(), t.device


class CachedCall:
    """The recorded launches of one key and what its outputs look like.

    Attributes:
        replays: the launches, in order.
        direct: every replay launches through the compiled kernel's launcher (then pointer slots may hold
            any tensor with the right address, e.g. FP8 outputs as they are returned).
        spec: the op's own allocation facts (see the ``*_hit`` functions).
    """

    __slots__ = ("replays", "direct", "spec")

    def __init__(self, replays: tuple, spec: tuple):
        self.replays = replays
        self.direct = all(r.direct for r in replays)
        self.spec = spec


class CallCache:
    """Bounded map from call keys to :class:`CachedCall` (insertion order; the oldest goes first)."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self._entries: dict = {}
        self.max_entries = max_entries

    def get(self, key):
        return self._entries.get(key) if key is not None else None

    def put(self, key, entry: CachedCall) -> None:
        entries = self._entries
        entries[key] = entry
        if len(entries) > self.max_entries:
            entries.pop(next(iter(entries)))

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def record(launched: list, tensors: tuple, constants: tuple, direct: bool) -> tuple | None:
    """The replays of the launches ``launched`` (``(KernelCall, compiled)`` pairs), each tensor
    parameter a slot of ``tensors`` (matched by identity), or None when a launch takes a tensor that is
    neither one of them nor one of ``constants`` (the workspace's tables: reused as they are), or when
    nothing was launched."""
    if not launched:
        return None
    by_id = {id(t): j for j, t in enumerate(tensors) if t is not None}
    constant_ids = {id(t) for t in constants}
    replays = []
    for call, compiled in launched:
        slots = []
        for i, p in enumerate(call.params):
            if isinstance(p, _Tensor):
                j = by_id.get(id(p))
                if j is not None:
                    slots.append((i, j))
                elif id(p) not in constant_ids:
                    return None
        replays.append(Replay(call, tuple(slots), compiled, direct))
    return tuple(replays)


# -- keys -------------------------------------------------------------------------------------------
def alignment(*tensors) -> int:
    """One bit per tensor: whether its address is a multiple of 16 bytes (Triton specialises pointer
    parameters on it, so a direct replay must see the same pattern)."""
    bits = 0
    for k, t in enumerate(tensors):
        if t is not None and not t.data_ptr() & 15:
            bits |= 1 << k
    return bits


def all_reduce_key(x, out, algorithm: str, cuda: bool) -> tuple | None:
    kx = _tensor_key(x)
    if kx is None:
        return None
    if out is None:
        ko = None
    elif out is x:
        ko = "x"
    else:
        ko = _tensor_key(out)
        if ko is None:
            return None
    return ("all_reduce", kx, ko, algorithm, alignment(x, out) if cuda else 0)


def _optional_key(t):
    """``_tensor_key`` of an optional tensor: None for None, False for a tensor that has no key."""
    if t is None:
        return None
    return _tensor_key(t) or False


def fused_key(x, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales,
              emit_unquantized, out, residual_out, q_out, scales_out, algorithm: str, cuda: bool) -> tuple | None:
    kx, kw, kr = _tensor_key(x), _tensor_key(weight), _optional_key(residual)
    if kx is None or kw is None or kr is False:
        return None
    given = None
    if out is not None or residual_out is not None or q_out is not None or scales_out is not None:
        given = (_optional_key(out), "residual" if residual_out is residual and residual is not None
                 else _optional_key(residual_out), _optional_key(q_out), _optional_key(scales_out))
        if False in given:
            return None
    return ("fused_add_rmsnorm", kx, kr, kw, eps.__class__, eps, gemma.__class__, gemma, quant, fp8_dtype,
            group_size.__class__, group_size, column_major_scales.__class__, column_major_scales,
            emit_unquantized.__class__, emit_unquantized, given, algorithm,
            alignment(x, residual, weight, out, residual_out, q_out, scales_out) if cuda else 0)


def dim_key(op: str, x, dim, algorithm: str, cuda: bool) -> tuple | None:
    """Key of ``all_gather`` / ``reduce_scatter``."""
    kx = _tensor_key(x)
    if kx is None:
        return None
    return (op, kx, dim.__class__, dim, algorithm, alignment(x) if cuda else 0)


# -- hits -------------------------------------------------------------------------------------------
def all_reduce_hit(comm, entry: CachedCall, x, out):
    """A repeated ``all_reduce`` (``entry.spec`` is unused), or None: take the full path (an ``out`` that
    overlaps ``x`` in part, which the full path reduces from a copy)."""
    if out is None:
        out = torch.empty_like(x, memory_format=_CONTIGUOUS)
    elif out is not x and 0 < abs(out.data_ptr() - x.data_ptr()) < x.numel() * x.element_size():
        return None
    comm._replay("all_reduce", entry, (x, out))
    return out


def fused_hit(comm, entry: CachedCall, x, residual, weight, out, residual_out, q_out, scales_out):
    """A repeated ``fused_add_rmsnorm``, or None: take the full path (a given output overlaps an input or
    another output). ``entry.spec``: ``(quant, fp8_dtype, scale_shape, column_major, emit_unquantized)``,
    ``quant`` None without FP8 output."""
    quant, fp8_dtype, scale_shape, column_major, emit = entry.spec
    if out is not None or residual_out is not None or q_out is not None or scales_out is not None:
        if overlapping((out, residual_out, q_out, scales_out), (x, residual, weight), ((1, 1),)) is not None:
            return None
    if out is None:
        out = torch.empty_like(x, memory_format=_CONTIGUOUS)
    if residual_out is None and residual is not None:
        residual_out = torch.empty_like(x, memory_format=_CONTIGUOUS)
    if quant is None:
        comm._replay("fused_add_rmsnorm", entry, (x, residual, weight, out, residual_out, None, None))
        return out, residual_out
    q = q_out if q_out is not None else torch.empty_like(x, dtype=fp8_dtype, memory_format=_CONTIGUOUS)
    if scales_out is not None:
        scales = scales_out
    elif column_major:
        scales = torch.empty(scale_shape, dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    q_arg = q if entry.direct else q.view(torch.uint8)
    comm._replay("fused_add_rmsnorm", entry, (x, residual, weight, out, residual_out, q_arg, scales))
    return q, scales, residual_out, (out if emit else None)


def gather_hit(comm, entry: CachedCall, x):
    """A repeated ``all_gather`` along dim 0. ``entry.spec``: ``(out_shape,)``."""
    out = torch.empty(entry.spec[0], dtype=x.dtype, device=x.device)
    comm._replay("all_gather", entry, (x, out))
    return out


def scatter_hit(comm, entry: CachedCall, x):
    """A repeated ``reduce_scatter`` along dim 0. ``entry.spec``: ``(out_shape,)``."""
    out = torch.empty(entry.spec[0], dtype=x.dtype, device=x.device)
    comm._replay("reduce_scatter", entry, (x, out))
    return out


__all__ = ["CachedCall", "CallCache", "KernelCall", "MAX_ENTRIES", "record", "all_reduce_key", "fused_key",
           "dim_key", "all_reduce_hit", "fused_hit", "gather_hit", "scatter_hit"]
