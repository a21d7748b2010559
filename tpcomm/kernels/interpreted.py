"""The CPU path's launch of an interpreted kernel without the interpreter's repeated work.

Problem: Triton's interpreter (``TRITON_INTERPRET=1``) swaps ``triton.language``'s builtins for NumPy
versions when a kernel launch starts, and restores them when it ends. It does the same again at every
call of a ``@triton.jit`` device function inside the kernel (``InterpretedFunction.__call__`` runs
``_patch_lang``, which walks the language modules with ``inspect.getmembers``), although the launch has
patched those same modules already. tpcomm's kernels call device functions (the sync primitives, the
epilogue, the quantisers) about a thousand times per launch, so that walk took about four tenths of a
CPU rank's call (docs/design.md, "The CPU path").

Mechanism: :func:`install` wraps the interpreter's ``_patch_lang`` and its launcher
(``GridExecutor.__call__``). During a launch, a device function whose language modules (``tl`` or
``tl.core`` among its globals) are patched already skips the walk (an empty patch scope); one that
brings another module is patched as before, and the launch's own restore undoes everything at its end,
as it does without this. Outside a launch nothing changes. If the interpreter's internals are not the
ones expected, :func:`install` leaves them as they are (the kernels then run as slowly as before).
:func:`install` also turns off the overflow sanitiser while assertions are off and memoises the dtype
map, and the host twins below do two of the kernels' bit operations in NumPy (docs/cpu.md, "Interpreter
speed"): none of these changes a result. During a launch of one of tpcomm's kernels NumPy's
floating-point warnings are off: NaN and Inf inputs flow through as on the GPU, silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import numpy as np

from ..env import interpreter_enabled

#: Language modules patched by the launch in progress (``id`` of the module objects), or None outside one.
_patched: set[int] | None = None
#: The language modules among a module's globals, by the ``id`` of its globals dict (a module's imports
#: are done by the time its kernels run).
_langs_of: dict[int, frozenset[int]] = {}


def _lang_ids(fn, langs) -> frozenset[int]:
    key = id(fn.__globals__)
    ids = _langs_of.get(key)
    if ids is None:
        ids = _langs_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                         if inspect.ismodule(v) and v in langs)
    return ids


def install() -> bool:
    """Wrap the interpreter's patching (module docstring); idempotent. Returns whether it is in place."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
        patch_lang, executor = interp._patch_lang, interp.GridExecutor
        empty_scope = interp._LangPatchScope
    except (ImportError, AttributeError):
        return False
    if getattr(patch_lang, "_tpcomm", False):
        return True
    langs = (tl, tl.core)

    def _patch_lang(fn):
        global _patched
        if _patched is None:  # outside a launch: as Triton does it
            return patch_lang(fn)
        ids = _lang_ids(fn, langs)
        if ids <= _patched:  # the launch patched these modules already
            return empty_scope()
        scope = patch_lang(fn)
        _patched |= ids
        return scope

    launch = executor.__call__

    def __call__(self, *args, **kwargs):
        global _patched
        outer, _patched = _patched, set()
        # tpcomm's kernels compute as the GPU does, NaN and Inf without a warning: NumPy's own
        # floating-point warnings are off during their launches (a user's kernels keep NumPy's settings)
        ours = getattr(getattr(self, "fn", None), "__module__", "").startswith("tpcomm.")
        try:
            with np.errstate(all="ignore") if ours else contextlib.nullcontext():
                return launch(self, *args, **kwargs)
        finally:
            _patched = outer

    _patch_lang._tpcomm = True
    interp._patch_lang = _patch_lang
    executor.__call__ = __call__
    _skip_discarded_overflow_checks(interp)
    _cache_numpy_dtypes(interp, tl)
    return True


def _skip_discarded_overflow_checks(interp) -> None:
    """Turn off the interpreter's integer-overflow sanitiser when its assertions are off: without
    ``debug`` each checked ``+``, ``-`` and ``*`` still computes the check (casts to int64, the op again,
    two comparisons) and then drops it, as ``device_assert`` does nothing; that was about a third of a
    CPU rank's call. With ``debug`` on, the checks stay."""
    builder = getattr(interp, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if (dataclasses.is_dataclass(options) and not getattr(options, "debug", True)
            and getattr(options, "sanitize_overflow", False)):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _cache_numpy_dtypes(interp, tl) -> None:
    """Memoise the interpreter's Triton-to-NumPy dtype map, which builds its table at every call (tens
    of thousands of calls per launch): the answer depends on the scalar type alone."""
    original = getattr(interp, "_get_np_dtype", None)
    if original is None or getattr(original, "_tpcomm", False):
        return
    cache: dict = {}

    def _get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return original(tt_dtype)
        key = scalar.name
        found = cache.get(key)
        if found is None:
            found = cache[key] = original(scalar)
        return found

    _get_np_dtype._tpcomm = True
    interp._get_np_dtype = _get_np_dtype


# -- host twins -------------------------------------------------------------------------------------
# Called from a kernel under the interpreter only (``epilogue._bf16_rne``, ``quant.widen``): one NumPy
# step each where the kernel's own bit operations take eight or so interpreted ops, a tenth of a CPU
# rank's call together (docs/cpu.md, "Interpreter speed"). Same bits as those operations.
#: Whether the kernels use the host twins: under the interpreter, when its tensors are as expected.
HOST_TWINS = False
if interpreter_enabled():
    try:
        import triton.language as _tl
        from triton.runtime.interpreter import TensorHandle as _Handle

        HOST_TWINS = (dataclasses.is_dataclass(_Handle)
                      and {"data", "dtype"} <= {f.name for f in dataclasses.fields(_Handle)})
    except ImportError:
        pass


def _like(t, data: np.ndarray, dtype):
    """An interpreter tensor of ``t``'s shape holding ``data`` as ``dtype``."""
    ty = _tl.block_type(dtype, t.type.shape) if isinstance(t.type, _tl.block_type) else dtype
    return _tl.tensor(_Handle(data, dtype), ty)


def bf16_rne(v):
    """float32 ``v`` (an interpreter tensor) rounded to nearest-even bfloat16 on its bits, a NaN kept
    quiet: ``epilogue._bf16_rne``'s operations in NumPy."""
    data = v.handle.data
    b = np.atleast_1d(np.asarray(data, dtype=np.float32)).view(np.uint32)
    r = b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
    r = np.where(np.isnan(b.view(np.float32)), b | np.uint32(0x400000), r)
    return _like(v, (r >> np.uint32(16)).astype(np.uint16).reshape(np.shape(data)), _tl.bfloat16)


def widen_bf16(x):
    """bfloat16 ``x`` (an interpreter tensor) as float32, exactly: its 16 bits shifted up."""
    data = x.handle.data
    w = np.atleast_1d(np.asarray(data, dtype=np.uint16)).astype(np.uint32) << np.uint32(16)
    return _like(x, w.view(np.float32).reshape(np.shape(data)), _tl.float32)
