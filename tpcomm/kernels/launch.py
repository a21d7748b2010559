"""Kernel launches as values: bound once, replayed with another call's tensors.

A :class:`KernelCall` is one launch of a communication kernel with every parameter bound, in the kernel's
parameter order (constexprs included), plus its grid and launch options. ``KernelCall.launch()`` runs it
through Triton's ``kernel[grid](...)``, which binds, specialises and compiles on a first call.

A :class:`Replay` is a launch recorded from such a call, whose tensor parameters are filled in later
from another call's tensors (the cached path of :mod:`tpcomm.call_cache`). It launches one of two ways:

* **through the compiled kernel's launcher** (CUDA, :func:`direct_launch_supported`): the
  ``CompiledKernel`` that Triton's first launch returned is called as Triton's own ``JITFunction.run``
  calls it after binding, ``compiled.run(gx, gy, gz, stream, function, packed_metadata,
  launch_metadata, enter_hook, exit_hook, *params)``, with pointer parameters passed as integers (the
  launcher takes an ``int`` as the device address). Binding, specialisation and the cache look-up are
  skipped: they are a function of the call's key (shapes, dtypes, strides, flags, and each pointer's
  16-byte alignment, which Triton specialises on), and the key is what selected this replay. When it is
  recorded, the replay asks Triton's own binder which compiled kernel these parameters select; if that
  is not the kernel the launch returned, or any step of that check is missing in the installed Triton,
  the replay launches through ``kernel[grid]`` instead. Launch hooks (a profiler's) also send a launch
  through ``kernel[grid]``, so they see every launch.
* **through** ``kernel[grid](...)`` everywhere else: the interpreter (CPU ranks), other Triton versions.
"""

from __future__ import annotations

import torch

from ..env import interpreter_enabled


class KernelCall:
    """One launch: ``kernel[(grid,)](*params, **options)``.

    Args:
        kernel: the ``@triton.jit`` function (a ``JITFunction``, or an ``InterpretedFunction`` under
            the interpreter).
        grid: programs (a 1-D grid).
        args: the first parameters of ``kernel``, in its order.
        kwargs: the remaining parameters by name (constexprs), and launch options (``num_warps``,
            ``enable_fp_fusion``, ``launch_pdl``): a name that is not a parameter is an option.

    Raises:
        TypeError: a parameter of ``kernel`` is missing, or given twice.
    """

    __slots__ = ("kernel", "grid", "params", "options")

    def __init__(self, kernel, grid: int, args: tuple, kwargs: dict):
        names = kernel.arg_names
        params = dict(zip(names, args))
        options = {}
        for name, value in kwargs.items():
            if name in params:
                raise TypeError(f"KernelCall: parameter {name} given twice")
            (params if name in names else options)[name] = value
        missing = [name for name in names if name not in params]
        if missing or len(args) > len(names):
            raise TypeError(f"KernelCall: missing parameters {missing}" if missing else "KernelCall: too many arguments")
        self.kernel = kernel
        self.grid = grid
        self.params = tuple(params[name] for name in names)
        self.options = options

    def launch(self):
        """Launch it; returns Triton's ``CompiledKernel`` (None under the interpreter)."""
        return self.kernel[(self.grid,)](*self.params, **self.options)


def direct_launch_supported(device: torch.device, enabled: bool = True) -> bool:
    """Whether replays on ``device`` may call the compiled kernel's launcher: ``enabled``
    (``TPCOMM_DIRECT_LAUNCH``), CUDA without the interpreter, and a Triton that has the binder and kernel
    cache :func:`_same_kernel` reads (checked again per recorded launch)."""
    if not enabled or device.type != "cuda" or interpreter_enabled():
        return False
    try:
        from triton import knobs  # noqa: F401  (both are what _same_kernel and Replay use)
        from triton.runtime.jit import compute_cache_key  # noqa: F401
    except ImportError:
        return False
    return True


def _same_kernel(call: KernelCall, compiled) -> bool:
    """Whether Triton's binder maps ``call``'s parameters and options to ``compiled`` with the
    parameters in ``call.params``'s order: the look-up ``JITFunction.run`` makes before it launches
    (``device_caches[device]`` → binder → ``compute_cache_key`` → kernel cache). False if any step is
    missing or differs."""
    try:
        from triton import knobs
        from triton.runtime.driver import driver
        from triton.runtime.jit import compute_cache_key

        kernel = call.kernel
        device = driver.active.get_current_device()
        kernel_cache, key_cache, _target, _backend, binder = kernel.device_caches[device]
        kwargs = dict(call.options)
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, specialization, options = binder(*call.params, **kwargs)
        if len(bound) != len(call.params) or any(a is not b for a, b in zip(bound.values(), call.params)):
            return False
        return kernel_cache.get(compute_cache_key(key_cache, specialization, options)) is compiled
    except Exception:  # another Triton: launch through kernel[grid]
        return False


class Replay:
    """A launch recorded from ``call``, replayed with other tensors in the slots ``slots`` names.

    Args:
        call: the launch as first made (its tensors are the recording call's).
        slots: ``(param_index, tensor_index)`` pairs: parameter ``param_index`` is the call's tensor
            number ``tensor_index`` (see :meth:`launch`); every other parameter is reused as recorded
            (workspace tables, sizes, the signature, constexprs).
        compiled: what ``call.launch()`` returned (Triton's ``CompiledKernel``, or None).
        direct: use the compiled kernel's launcher (:func:`direct_launch_supported` for the device).
    """

    __slots__ = ("call", "slots", "compiled", "direct", "_params", "_function", "_run", "_meta", "_hooks",
                 "_sources", "_targets")

    def __init__(self, call: KernelCall, slots: tuple, compiled, direct: bool):
        self.call = call
        self.slots = slots
        self.compiled = compiled
        self._params = list(call.params)
        self.direct = bool(direct and compiled is not None and _same_kernel(call, compiled))
        if self.direct:  # compiled.run loads the module on first use (done by the recording launch)
            self.bind_launcher(compiled.run, compiled.function, compiled.packed_metadata)

    def bind_launcher(self, run, function, packed_metadata) -> None:
        """Replay through ``run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
        enter_hook, exit_hook, *params)`` (a compiled kernel's launcher and its arguments), pointer
        parameters as addresses."""
        from triton import knobs

        self.direct = True
        self._hooks = knobs.runtime  # launch_enter_hook / launch_exit_hook: a profiler's
        self._run, self._function, self._meta = run, function, packed_metadata
        for i, _ in self.slots:
            self._params[i] = 0
        # each tensor's address read once, however many parameters take it
        self._sources = tuple(dict.fromkeys(j for _, j in self.slots))
        self._targets = tuple(tuple(i for i, j in self.slots if j == src) for src in self._sources)

    def launch(self, tensors: tuple, stream: int | None = None) -> None:
        """Launch with ``tensors[j]`` in each slot ``(i, j)``. ``stream``: the raw CUDA stream
        (``torch._C._cuda_getCurrentRawStream``), needed by a direct replay."""
        if self.direct and self._hooks.launch_enter_hook is None and self._hooks.launch_exit_hook is None:
            params = self._params  # integers only: no tensor stays referenced
            for j, targets in zip(self._sources, self._targets):
                ptr = tensors[j].data_ptr()
                for i in targets:
                    params[i] = ptr
            self._run(self.call.grid, 1, 1, stream, self._function, self._meta, None, None, None, *params)
            return
        params = list(self.call.params)  # a copy: the replay keeps no reference to this call's tensors
        for i, j in self.slots:
            params[i] = tensors[j]
        self.call.kernel[(self.call.grid,)](*params, **self.call.options)
