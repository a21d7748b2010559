"""Decide once per call shape: the cached path of :class:`~tpcomm.Communicator`'s ops.

A call's **key** holds everything its validation, plan and launches depend on: the op; each tensor
argument's type, shape, dtype, strides and device, and which arguments are one object; every scalar
argument with its type (so ``eps=True`` and ``eps=1`` differ, as validation tells them apart); the
algorithm in force (``use_algorithm``, ``TPCOMM_ALGO``). A call whose arguments give no key (None for a
tensor, an unhashable scalar) takes the full path, which names the argument. The first call
with a key runs the full path: it validates, plans, compiles and launches, and records each launch as a
:class:`~tpcomm.kernels.launch.Replay` whose tensor parameters are slots for the call's tensors. A later
call with the same key checks what two such calls can still differ in (the communicator is open, no
error is recorded, an ``out`` that overlaps ``x`` in part, given outputs that overlap an input),
allocates its outputs, and replays the
launches with its own tensors: the same kernels, grids and parameters, so the same bits. A hit reads
each tensor's address once: the entry holds the recording call's 16-byte alignment pattern (on CUDA
Triton specialises each pointer on it: another pattern takes the full path, which records it) and each
tensor's size in bytes (fixed by the key), from which the overlap checks and the launches work.

Only calls whose validation passed are recorded, so an invalid call never matches a key and raises what
the full path raises, on every call. Calls that are not recorded, and take the full path every time:
non-contiguous tensors (the full path copies them), tensor subclasses and negative-bit views, chunked
launches whose tensors are views, the fallback, integer sums, all-gathers moved as bytes, ``dim != 0``,
empty tensors.

The cache is per communicator and bounded (``MAX_ENTRIES``, oldest first out).
"""

from __future__ import annotations

import torch

from .kernels.launch import Replay

#: Keys a communicator remembers; the oldest goes first.
MAX_ENTRIES = 512

_Tensor = torch.Tensor
_E4M3 = torch.float8_e4m3fn
_INF = float("inf")


def new_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous tensor of ``x``'s shape (row-major strides, whatever ``x``'s are)."""
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


_NEW = torch.empty_strided
_LIKE = torch.empty_like
#: An output whose layout is the input ``x``'s: made by ``torch.empty_like(x)`` (a fraction of a µs less
#: than ``torch.empty_strided``; a repeated call's ``x`` has the recorded one's layout, by its key).
LIKE_X = "like x"


def _new(o, x: torch.Tensor) -> torch.Tensor:
    """A new output of layout ``o`` (:attr:`CachedCall.outputs`) for a call whose input is ``x``."""
    if o is LIKE_X:
        return _LIKE(x)
    return _NEW(o[0], o[1], dtype=o[2], device=o[3])


class CachedCall:
    """The recorded launches of one key and the layout of its new outputs.

    Attributes:
        replays: the launches, in order.
        direct: every replay was confirmed for the compiled kernel's launcher.
        spec: the op's own facts (see the ``*_hit`` functions).
        outputs: per output the op allocates, ``(shape, strides, dtype, device)`` of the first call's
            tensor (``torch.empty_strided`` makes the same), ``LIKE_X`` where that is the layout of the
            call's input ``x`` (``torch.empty_like(x)`` makes it), or None where the caller passed it or
            the call has none.
        alignment: :func:`alignment` of the recording call's tensors (``tensors``, in slot order; 0
            when ``cuda`` is False: only CUDA launches are specialised on it).
        nbytes: each of those tensors' size in bytes (0 for None).
    """

    __slots__ = ("replays", "direct", "spec", "outputs", "alignment", "nbytes")

    def __init__(self, replays: tuple, spec: tuple, outputs: tuple, tensors: tuple = (), cuda: bool = False):
        self.replays = replays
        self.direct = all(r.direct for r in replays)
        self.spec = spec
        x = tensors[0] if tensors else None
        #: the recording call's tensors' alignment pattern (:func:`alignment`; 0 off CUDA) and sizes
        self.alignment = alignment(*(0 if t is None else t.data_ptr() for t in tensors)) if cuda else 0
        self.nbytes = tuple(0 if t is None else t.nbytes for t in tensors)
        like = None if x is None else (tuple(x.shape), x.stride(), x.dtype, x.device)
        layouts = (None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device) for t in outputs)
        self.outputs = tuple(LIKE_X if o is not None and o == like else o for o in layouts)


class CallCache:
    """Bounded map from call keys to :class:`CachedCall` (insertion order; the oldest goes first)."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self._entries: dict = {}
        self.max_entries = max_entries

    def get(self, key):
        """The entry of ``key``, or None (also for a key that cannot be hashed: an argument of the wrong
        type, which the full path then refuses)."""
        if key is None:
            return None
        try:
            return self._entries.get(key)
        except TypeError:  # e.g. eps=[1e-6]: unhashable
            return None

    def put(self, key, entry: CachedCall) -> None:
        entries = self._entries
        entries[key] = entry
        while len(entries) > self.max_entries:
            try:
                entries.pop(next(iter(entries)), None)
            except (StopIteration, RuntimeError):  # emptied or changed by another thread meanwhile
                break

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def record(launched: list, tensors: tuple, constants: tuple, direct: bool,
           device_index: int | None = None) -> tuple | None:
    """The replays of the launches ``launched`` (``(KernelCall, compiled)`` pairs), each tensor
    parameter a slot of ``tensors`` (the caller's own tensors, matched by identity; where one object is
    several of them, the last), or None when a launch takes a tensor that is neither one of them nor one
    of ``constants`` (the workspace's tables: reused as they are; a contiguous copy of an input is
    neither, so such calls are not recorded), or when nothing was launched."""
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
        replays.append(Replay(call, tuple(slots), compiled, direct, device_index))
    return tuple(replays)


# -- keys -------------------------------------------------------------------------------------------
# Keys are flat tuples (hashing and comparing nested ones cost about a µs more on the hit path). A tensor
# contributes (shape, dtype, strides, device); None contributes None.
_PARAMETER = torch.nn.Parameter


def _plain(*tensors) -> bool:
    """Whether every non-None argument is a plain tensor or a Parameter without a lazy negation
    (subclasses, negative-bit views and anything else take the full path)."""
    for t in tensors:
        if t is not None and (type(t) is not _Tensor and type(t) is not _PARAMETER or t.is_neg()):
            return False
    return True


def _tensor(t) -> bool:
    """Whether ``t``, a required tensor argument, is a plain tensor or a Parameter."""
    return (type(t) is _Tensor or type(t) is _PARAMETER) and not t.is_neg()


def alignment(*ptrs: int) -> int:
    """Each address modulo 16, four bits an address (0 for a missing tensor): Triton specialises
    pointer parameters on 16-byte alignment, so a replay must see its recording's pattern (0: all
    aligned)."""
    a = 0
    for p in ptrs:
        a = a << 4 | p & 15
    return a


def all_reduce_key(x, out, algorithm: str) -> tuple | None:
    if not _tensor(x) or not _plain(out):
        return None
    if out is None or out is x:
        return ("all_reduce", x.shape, x.dtype, x.stride(), x.device, out is x, algorithm)
    return ("all_reduce", x.shape, x.dtype, x.stride(), x.device, out.shape, out.dtype, out.stride(), out.device,
            algorithm)


def fused_key(x, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales,
              emit_unquantized, out, residual_out, q_out, scales_out, algorithm: str,
              scale=None, swizzled_scales=False) -> tuple | None:
    """Key of ``fused_add_rmsnorm``; ``scale``: the input scale of ``quant='fp8_static'`` or ``'nvfp4'``
    (or None)."""
    if not _tensor(x) or not _tensor(weight) or not _plain(residual):
        return None
    if scale is not None:  # a static scale: its layout
        if not _tensor(scale):
            return None
        scale_key = ("scale", scale.shape, scale.dtype, scale.stride(), scale.device)
    else:
        scale_key = ()
    # which arguments are one object: the recorded slots follow that pattern
    key = (x.shape, x.dtype, x.stride(), x.device, weight.shape, weight.dtype, weight.stride(), weight.device,
           eps.__class__, eps, gemma.__class__, gemma, quant, algorithm, residual is x, weight is x,
           weight is residual) + scale_key
    key += (None,) if residual is None else (residual.shape, residual.dtype, residual.stride(), residual.device)
    if quant is not None or fp8_dtype is not _E4M3 or group_size.__class__ is not int or group_size != 128 \
            or column_major_scales is not False or emit_unquantized is not False or swizzled_scales is not False:
        key += ("fp8", fp8_dtype, group_size.__class__, group_size, column_major_scales.__class__, column_major_scales,
                emit_unquantized.__class__, emit_unquantized, swizzled_scales.__class__, swizzled_scales)
    if out is None and residual_out is None and q_out is None and scales_out is None:
        return key
    if not _plain(out, residual_out, q_out, scales_out):
        return None
    key += ("outputs",)
    for t in (out, q_out, scales_out):
        key += (None,) if t is None else (t.shape, t.dtype, t.stride(), t.device)
    if residual_out is not None and residual_out is residual:
        key += ("residual in place",)
    else:
        key += (None,) if residual_out is None else (residual_out.shape, residual_out.dtype, residual_out.stride(),
                                                     residual_out.device)
    return key


def dim_key(op: str, x, dim, algorithm: str) -> tuple | None:
    """Key of ``all_gather`` / ``reduce_scatter``."""
    if not _tensor(x):
        return None
    return (op, x.shape, x.dtype, x.stride(), x.device, dim.__class__, dim, algorithm)


# -- hits -------------------------------------------------------------------------------------------
def all_reduce_hit(comm, entry: CachedCall, x, out):
    """A repeated ``all_reduce``, or None: take the full path (an ``out`` that overlaps ``x`` in part,
    which the full path reduces from a copy, or another alignment)."""
    px = x.data_ptr()
    if out is None:
        out = _new(entry.outputs[0], x)
    elif out is not x and 0 < abs(out.data_ptr() - px) < entry.nbytes[0]:
        return None
    ptrs = (px, out.data_ptr())
    if entry.alignment != (alignment(*ptrs) if comm._cuda else 0):
        return None
    comm._replay("all_reduce", entry, (x, out), ptrs)
    return out


def fused_hit(comm, entry: CachedCall, x, residual, weight, out, residual_out, q_out, scales_out, scale=None):
    """A repeated ``fused_add_rmsnorm``, or None: take the full path (a given output overlaps an input or
    another output, or another alignment). ``entry.spec``: ``(quant, emit_unquantized,
    swizzled_scales)``; ``entry.outputs``: out, residual_out, q, scales (None for a static scale:
    ``scale``, the input, is the kernels' scales argument and the returned scales). ``scale`` (static
    FP8's, NVFP4's global one) is the replays' last tensor; on the CPU it is read, as the full path
    reads it: a value that is not finite and positive takes the full path, which raises."""
    if scale is not None and not scale.is_cuda and not 0.0 < float(scale.reshape(())) < _INF:
        return None
    o, ro, qo, so = entry.outputs
    quant, emit, swizzled = entry.spec
    # the tensors in slot order, each address read once (0: no tensor, or one allocated below)
    tensors = [x, residual, weight, out, residual_out, q_out, scales_out, scale]
    ptrs = [0 if t is None else t.data_ptr() for t in tensors]
    if out is not None or residual_out is not None or q_out is not None or scales_out is not None:
        if not _outputs_clear(ptrs, entry.nbytes, residual_out is residual):
            return None
    if out is None and o is not None:  # None: FP8 bytes only, out not written (the kernels take residual_out)
        tensors[3] = out = _new(o, x)
    if ro is not None and residual_out is None:
        tensors[4] = residual_out = _new(ro, x)
    if qo is not None:
        tensors[5] = _new(qo, x)
    if so is not None:  # a new swizzled FP4 buffer's padding is zero, as the full path allocates it
        tensors[6] = torch.zeros(so[0], dtype=so[2], device=so[3]) if swizzled else _new(so, x)
    elif quant == "fp8_static":  # the input scale is the kernels' scales argument and the returned scales
        tensors[6], ptrs[6] = scale, ptrs[7]
    for k in (3, 4, 5, 6):
        if ptrs[k] == 0 and tensors[k] is not None:
            ptrs[k] = tensors[k].data_ptr()
    if entry.alignment != (alignment(*ptrs) if comm._cuda else 0):
        return None
    comm._replay("fused_add_rmsnorm", entry, tensors, ptrs)
    if quant is None:
        return out, residual_out
    return tensors[5], tensors[6], residual_out, (out if emit else None)


#: Slots of a fused call's tensors (``fused_hit``): the inputs and the outputs.
_FUSED_INPUTS, _FUSED_OUTPUTS = (0, 1, 2, 7), (3, 4, 5, 6)


def _outputs_clear(ptrs: list, nbytes: tuple, residual_in_place: bool) -> bool:
    """Whether the given outputs of a fused call share no byte with each other or with the inputs.
    ``ptrs``: the addresses of ``(x, residual, weight, out, residual_out, q, scales, scale)`` (0: not
    given), ``nbytes`` their sizes (every tensor of a recorded call is contiguous, so each is the span
    of its bytes; an empty one shares nothing). An in-place ``residual_out`` is ``residual`` itself,
    which the kernels read and write row by row: only that pair is allowed to share its bytes (it is
    an output, so it may share none with ``x``, the weight or the other outputs).
    :func:`tpcomm.validate.overlapping` on the hit path."""
    outs = [(k, ptrs[k], ptrs[k] + nbytes[k]) for k in _FUSED_OUTPUTS if ptrs[k] and nbytes[k]]
    ins = [(j, ptrs[j], ptrs[j] + nbytes[j]) for j in _FUSED_INPUTS if ptrs[j] and nbytes[j]]
    for i, (k, p, e) in enumerate(outs):
        for j, p0, e0 in ins:
            if p < e0 and p0 < e and not (residual_in_place and k == 4 and j == 1):
                return False
        for _, p0, e0 in outs[i + 1:]:
            if p < e0 and p0 < e:
                return False
    return True


def gather_hit(comm, entry: CachedCall, x):
    """A repeated ``all_gather`` along dim 0, or None (another alignment: the full path)."""
    return _dim_hit(comm, "all_gather", entry, x)


def scatter_hit(comm, entry: CachedCall, x):
    """A repeated ``reduce_scatter`` along dim 0, or None (another alignment: the full path)."""
    return _dim_hit(comm, "reduce_scatter", entry, x)


def _dim_hit(comm, op: str, entry: CachedCall, x):
    out = _new(entry.outputs[0], x)
    ptrs = (x.data_ptr(), out.data_ptr())
    if entry.alignment != (alignment(*ptrs) if comm._cuda else 0):
        return None
    comm._replay(op, entry, (x, out), ptrs)
    return out
