"""Decide once per call shape: the cached path of :class:`~tpcomm.Communicator`'s ops.

A call's **key** holds everything its validation, plan and launches depend on: the op; each tensor
argument's type, shape, dtype, layout (strides, or only whether it is contiguous where the kernels read
it flat and the full path copies it otherwise) and device, and which arguments are one object; every
scalar argument with its type (so ``eps=True`` and ``eps=1`` differ, as validation tells them apart); the
algorithm in force (``use_algorithm``, ``TPCOMM_ALGO``). A call whose arguments give no key (None for a
tensor, an unhashable scalar) takes the full path, which names the argument. The first call with a key
runs the full path: it validates, plans, compiles and launches, and records each launch as a
:class:`~tpcomm.kernels.launch.Replay` whose tensor parameters are slots for the call's tensors, with a
:class:`~tpcomm.hit_code.HitSpec` saying where each slot's tensor comes from in a later call. A later
call with the same key runs the entry's :attr:`CachedCall.hit`, straight-line code written for it
(:mod:`tpcomm.hit_code`): it checks what two such calls can still differ in (the communicator is open, no
error is recorded, no given output shares bytes with an input or another given output, on CUDA each
address's 16-byte residue, which Triton specialises pointers on), allocates the outputs with the recorded
layouts, and replays the launches with its own tensors: the same kernels, grids and parameters, so the
same bits.

Only calls whose validation passed are recorded, so an invalid call never matches a key and raises what
the full path raises, on every call. Calls that are not recorded, and take the full path every time:
non-contiguous tensors (the full path copies them), tensor subclasses and negative-bit views, chunked
launches whose tensors are views, the fallback, integer sums, all-gathers moved as bytes, ``dim != 0``,
empty tensors.

The cache is per communicator and bounded (``MAX_ENTRIES``, oldest first out).
"""

from __future__ import annotations

import torch

from .hit_code import LIKE_X, HitSpec, compile_hit
from .kernels.launch import Replay

#: Keys a communicator remembers; the oldest goes first.
MAX_ENTRIES = 512

_Tensor = torch.Tensor
_E4M3 = torch.float8_e4m3fn
#: The tensor types a key accepts (subclasses take the full path).
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
#: The default ``group_size`` (the fp8 part of a fused key is left out while it is this very object).
_GROUP = 128


def new_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous tensor of ``x``'s shape (row-major strides, whatever ``x``'s are)."""
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def layout(t: torch.Tensor, x: torch.Tensor):
    """How a repeat allocates an output like ``t`` of a call whose input is ``x``: ``LIKE_X`` where
    ``torch.empty_like(x)`` makes that layout (a fraction of a µs less than ``torch.empty_strided``; a
    repeated call's ``x`` has the recorded one's layout, by its key), else ``(shape, strides, dtype,
    device)``."""
    mine = (tuple(t.shape), t.stride(), t.dtype, t.device)
    return LIKE_X if mine == (tuple(x.shape), x.stride(), x.dtype, x.device) else mine


class CachedCall:
    """The recorded launches of one key and the code that repeats them.

    Attributes:
        replays: the launches, in order.
        spec: where each slot's tensor comes from (:class:`~tpcomm.hit_code.HitSpec`).
        hit: ``hit(comm, *spec.args)``: the repeat (:func:`~tpcomm.hit_code.compile_hit`); returns the
            call's result, or None where the full path must decide.
        source: the text of ``hit``.
    """

    __slots__ = ("replays", "spec", "hit", "source", "_facts")

    def __init__(self, replays: tuple, spec: HitSpec, tensors: tuple, lock, err, cuda: bool,
                 device_index: int | None = None):
        self.replays, self.spec = replays, spec
        nbytes = tuple(0 if t is None else t.nbytes for t in tensors)
        residues = tuple(0 if t is None else t.data_ptr() & 15 for t in tensors) if cuda else None
        self._facts = (nbytes, residues, lock, err, device_index)  # the recording's: no tensor kept
        self.rebuild()

    def rebuild(self) -> None:
        """Write :attr:`hit` again from the replays as they are now (after a launcher was bound to one,
        :meth:`~tpcomm.kernels.launch.Replay.bind_launcher`, or a replay was sent through ``kernel[grid]``
        by setting its ``direct`` to False)."""
        self.hit, self.source = compile_hit(self.spec, self.replays, *self._facts)

    @property
    def direct(self) -> bool:
        """Every replay launches through the compiled kernel's launcher."""
        return all(r.direct for r in self.replays)


class CallCache:
    """Bounded map from call keys to :class:`CachedCall` (insertion order; the oldest goes first)."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self._entries: dict = {}
        self.max_entries = max_entries
        #: ``lookup(key)``: the entry or None (None for key None); TypeError for a key that cannot be
        #: hashed. The dict's own ``get``: a method around it costs a tenth of a µs a call.
        self.lookup = self._entries.get

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
# contributes (shape, dtype, strides or contiguity, device); None contributes None. Each key function
# returns None for a tensor argument that is not a plain tensor or Parameter, or is a negative-bit view.


def all_reduce_key(x, out, algorithm: str) -> tuple | None:
    """Key of ``all_reduce`` (``out``'s strides: its validation reads them)."""
    if x.__class__ not in _PLAIN or x.is_neg():
        return None
    if out is None or out is x:
        return ("all_reduce", x.shape, x.dtype, x.stride(), x.device, out is x, algorithm)
    if out.__class__ not in _PLAIN or out.is_neg():
        return None
    return ("all_reduce", x.shape, x.dtype, x.stride(), x.device, out.shape, out.dtype, out.stride(), out.device,
            algorithm)


def fused_key(x, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales,
              emit_unquantized, out, residual_out, q_out, scales_out, algorithm: str,
              scale=None, swizzled_scales=False) -> tuple | None:
    """Key of ``fused_add_rmsnorm``; ``scale``: the input scale of ``quant='fp8_static'`` or ``'nvfp4'``
    (or None). ``x``'s strides (the layout of its new outputs), whether every other tensor but
    ``scales_out`` is contiguous (the kernels read and write them flat; validation asks only that), and
    ``scales_out``'s strides (validation compares them)."""
    if x.__class__ not in _PLAIN or weight.__class__ not in _PLAIN or x.is_neg() or weight.is_neg():
        return None
    if residual is None:
        key = (x.shape, x.dtype, x.stride(), x.device, weight.shape, weight.dtype, weight.is_contiguous(),
               weight.device, eps.__class__, eps, gemma.__class__, gemma, quant, algorithm, weight is x, None)
    elif residual.__class__ not in _PLAIN or residual.is_neg():
        return None
    else:  # which arguments are one object: the recorded slots follow that pattern
        key = (x.shape, x.dtype, x.stride(), x.device, weight.shape, weight.dtype, weight.is_contiguous(),
               weight.device, eps.__class__, eps, gemma.__class__, gemma, quant, algorithm, weight is x,
               residual.shape, residual.dtype, residual.is_contiguous(), residual.device, residual is x,
               weight is residual)
    if quant is not None or fp8_dtype is not _E4M3 or group_size is not _GROUP or column_major_scales is not False \
            or emit_unquantized is not False or swizzled_scales is not False:
        key += ("fp8", fp8_dtype, group_size.__class__, group_size, column_major_scales.__class__, column_major_scales,
                emit_unquantized.__class__, emit_unquantized, swizzled_scales.__class__, swizzled_scales)
    if scale is not None:  # a static scale: its layout
        if scale.__class__ not in _PLAIN or scale.is_neg():
            return None
        key += ("scale", scale.shape, scale.dtype, scale.stride(), scale.device, scale is x, scale is residual,
                scale is weight)
    if out is None and residual_out is None and q_out is None and scales_out is None:
        return key
    if q_out is None and scales_out is None and out is not None and residual_out is not None:  # the common form
        if out.__class__ not in _PLAIN or residual_out.__class__ not in _PLAIN or out.is_neg() or residual_out.is_neg():
            return None
        if residual_out is residual:
            return key + ("outputs", out.shape, out.dtype, out.is_contiguous(), out.device, "residual in place")
        return key + ("outputs", out.shape, out.dtype, out.is_contiguous(), out.device, residual_out.shape,
                      residual_out.dtype, residual_out.is_contiguous(), residual_out.device)
    if out is None and residual_out is not None and q_out is not None and scales_out is not None \
            and residual_out is not residual:  # the quantised forms' common one
        if residual_out.__class__ not in _PLAIN or q_out.__class__ not in _PLAIN or scales_out.__class__ not in _PLAIN \
                or residual_out.is_neg() or q_out.is_neg() or scales_out.is_neg():
            return None
        return key + ("quantised outputs", residual_out.shape, residual_out.dtype, residual_out.is_contiguous(),
                      residual_out.device, q_out.shape, q_out.dtype, q_out.is_contiguous(), q_out.device,
                      scales_out.shape, scales_out.dtype, scales_out.stride(), scales_out.device)
    for t in (out, residual_out, q_out, scales_out):
        if t is not None and (t.__class__ not in _PLAIN or t.is_neg()):
            return None
    ro = residual_out is not None and residual_out is not residual  # with its own layout
    return key + ("outputs",
                  None if out is None else out.shape, None if out is None else out.dtype,
                  None if out is None else out.is_contiguous(), None if out is None else out.device,
                  "residual in place" if residual_out is not None and not ro else None,
                  residual_out.shape if ro else None, residual_out.dtype if ro else None,
                  residual_out.is_contiguous() if ro else None, residual_out.device if ro else None,
                  None if q_out is None else q_out.shape, None if q_out is None else q_out.dtype,
                  None if q_out is None else q_out.is_contiguous(), None if q_out is None else q_out.device,
                  None if scales_out is None else scales_out.shape, None if scales_out is None else scales_out.dtype,
                  None if scales_out is None else scales_out.stride(),
                  None if scales_out is None else scales_out.device)


def qk_key(q, k, q_weight, k_weight, eps, q_out, k_out, algorithm: str, kv_replicas=1) -> tuple | None:
    """Key of ``fused_qk_rmsnorm``: contiguous tensors only (a packed QKV view takes the full path, whose
    overlap test knows row strides), their shapes, dtypes and devices, which of them are one object, and
    ``eps`` and ``kv_replicas`` with their types."""
    tensors = (q, k, q_weight, k_weight, q_out, k_out)
    for t in tensors:
        if t is not None and (t.__class__ not in _PLAIN or t.is_neg() or not t.is_contiguous()):
            return None
    ids = [None if t is None else id(t) for t in tensors]
    same = tuple(None if i is None else ids.index(i) for i in ids)  # each tensor's first slot of its object
    return ("fused_qk_rmsnorm", q.shape, q.dtype, q.device, k.shape, k.dtype, q_weight.dtype, k_weight.dtype,
            q_weight.shape, k_weight.shape, q_weight.device, k_weight.device, k.device,
            None if q_out is None else (q_out.shape, q_out.dtype, q_out.device),
            None if k_out is None else (k_out.shape, k_out.dtype, k_out.device),
            eps.__class__, eps, algorithm, same, kv_replicas.__class__, kv_replicas)


def dim_key(op: str, x, dim, algorithm: str) -> tuple | None:
    """Key of ``all_gather`` / ``reduce_scatter``."""
    if x.__class__ not in _PLAIN or x.is_neg():
        return None
    return (op, x.shape, x.dtype, x.stride(), x.device, dim.__class__, dim, algorithm)


# -- what a repeat does -----------------------------------------------------------------------------
def all_reduce_spec(x, out, given: bool) -> HitSpec:
    """The repeat of ``all_reduce(x, out)`` (``given``: the caller passed ``out``). Slots: x, out. A given
    ``out`` other than ``x`` may be ``x``'s very memory (in place) but not overlap it in part (the full
    path reduces from a copy then)."""
    if not given:
        return HitSpec("all_reduce", ("x", "out"), (("arg", "x"), ("new", layout(out, x))), result=(1,),
                       single=True)
    if out is x:
        return HitSpec("all_reduce", ("x", "out"), (("arg", "x"), ("arg", "out")), result=(1,), single=True)
    return HitSpec("all_reduce", ("x", "out"), (("arg", "x"), ("arg", "out")), given=(1,), inputs=(0,),
                   in_place=((1, 0),), result=(1,), single=True)


#: The parameters of a fused call's repeat, which are also its slots 0-7.
FUSED_ARGS = ("x", "residual", "weight", "out", "residual_out", "q_out", "scales_out", "scale")


def fused_spec(tensors: tuple, returned: tuple, given: tuple, quant: str | None, emit_unquantized: bool,
               swizzled_scales: bool, cuda: bool) -> HitSpec:
    """The repeat of a ``fused_add_rmsnorm`` call. ``tensors``: the recording call's slots, ``(x,
    residual, weight, out, residual_out, q, scales, scale)`` as its launches take them (None where the
    call has none); ``returned``: its ``(out, residual_out, q, scales)`` as the call returns them (their
    layouts are what a repeat allocates; None where the call allocates none: ``out`` where the kernels
    write FP8 bytes only and take ``residual_out`` as their out pointer); ``given``: whether the caller
    passed ``out``, ``residual_out``, ``q_out``, ``scales_out``. A static FP8 scale is the kernels' scales
    argument and the returned scales; a new swizzled FP4 scales buffer is zero-filled (its padding), as
    the full path allocates it; a CPU ``scale`` is read, as the full path reads it."""
    x, residual, scale = tensors[0], tensors[1], tensors[7]
    sources = [("arg", "x"), None if residual is None else ("arg", "residual"), ("arg", "weight")]
    for k, t, passed in zip((3, 4, 5, 6), returned, given):
        if passed:
            sources.append(("arg", FUSED_ARGS[k]))
        elif k == 6 and quant == "fp8_static":
            sources.append(("same", 7))
        elif t is None:
            sources.append(None)
        else:
            sources.append(("zeros" if k == 6 and swizzled_scales else "new", layout(t, x)))
    sources.append(None if scale is None else ("arg", "scale"))
    outputs = tuple(k for k, passed in zip((3, 4, 5, 6), given) if passed)
    in_place = ((4, 1),) if given[1] and tensors[4] is residual else ()
    result = (3, 4) if quant is None else (5, 6, 4, 3 if emit_unquantized else None)
    return HitSpec("fused_add_rmsnorm", FUSED_ARGS, tuple(sources), given=outputs,
                   inputs=tuple(j for j in (0, 1, 2, 7) if tensors[j] is not None), in_place=in_place,
                   result=result, positive_scale=7 if scale is not None and not cuda else None,
                   static_scale=quant == "fp8_static")


#: The parameters of a QK norm call's repeat, which are also its slots 0-5.
QK_ARGS = ("q", "k", "q_weight", "k_weight", "q_out", "k_out")


def qk_spec(tensors: tuple, given: tuple) -> HitSpec:
    """The repeat of a ``fused_qk_rmsnorm`` call; ``tensors``: its ``(q, k, q_weight, k_weight, q_out,
    k_out)``, ``given``: whether the caller passed ``q_out`` and ``k_out``. A given output may be its
    input's very memory (in place) and overlap nothing else."""
    sources = [("arg", name) for name in QK_ARGS[:4]]
    for j, passed in ((4, given[0]), (5, given[1])):
        sources.append(("arg", QK_ARGS[j]) if passed else ("new", layout(tensors[j], tensors[0])))
    outputs = tuple(j for j, passed in ((4, given[0]), (5, given[1])) if passed)
    in_place = tuple(pair for pair, passed in (((4, 0), given[0]), ((5, 1), given[1])) if passed)
    return HitSpec("fused_qk_rmsnorm", QK_ARGS, tuple(sources), given=outputs, inputs=(0, 1, 2, 3),
                   in_place=in_place, result=(4, 5))


def dim_spec(op: str, x, out) -> HitSpec:
    """The repeat of ``all_gather`` / ``reduce_scatter`` along dim 0. Slots: x, the new output."""
    return HitSpec(op, ("x",), (("arg", "x"), ("new", layout(out, x))), result=(1,), single=True)
