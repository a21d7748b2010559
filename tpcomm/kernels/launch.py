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
  is not the kernel the launch returned, if the kernel has pre-run hooks, if the installed Triton's
  ``JITFunction.run`` does not launch this way (read from its source), or any step of that check is
  missing, the replay launches through ``kernel[grid]`` instead. Launch hooks (a profiler's: a hook
  chain with calls in it) and a current device other than the recording one also send a replay through
  ``kernel[grid]``. Behind Triton 3.6's launcher, for a kernel without scratch, the compiled module's own
  ``launch`` is called instead of the launcher (:func:`raw_launch`). What a direct replay does not redo:
  ``JITFunction.run``'s check that the globals a kernel read have not changed (the kernels read only
  module constants), and its reading of ``knobs`` (debug, instrumentation) after the launch was recorded.
* **through** ``kernel[grid](...)`` everywhere else: the interpreter (CPU ranks), other Triton versions.
"""

from __future__ import annotations

import functools
import inspect

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
            raise TypeError(f"KernelCall: missing parameters {missing}" if missing
                            else "KernelCall: too many arguments")
        self.kernel = kernel
        self.grid = grid
        self.params = tuple(params[name] for name in names)
        self.options = options

    def launch(self):
        """Launch it; returns Triton's ``CompiledKernel`` (None under the interpreter)."""
        return self.kernel[(self.grid,)](*self.params, **self.options)

    def load(self) -> None:
        """Compile the kernel for these parameters and load its module onto the current device, launching
        nothing (Triton's ``warmup``, the same specialisation as :meth:`launch`, then the
        ``CompiledKernel``'s handles); nothing under the interpreter, which compiles nothing. Loading a
        module can wait for the device's running kernels (CUDA's lazy loading may synchronise the
        context), so a rank loads what a call needs before its first kernel waits for its peers."""
        warmup = getattr(self.kernel, "warmup", None)
        if warmup is None or interpreter_enabled():
            return
        compiled = warmup(*self.params, grid=(self.grid,), **self.options)
        init_handles = getattr(compiled, "_init_handles", None)
        if init_handles is not None:
            init_handles()


def direct_launch_supported(device: torch.device, enabled: bool = True) -> bool:
    """Whether replays on ``device`` may call the compiled kernel's launcher: ``enabled``
    (``TPCOMM_DIRECT_LAUNCH``), CUDA without the interpreter, and a Triton whose ``JITFunction.run``
    launches as :class:`Replay` does (:func:`_triton_launches_as_replays_do`); each recorded launch is
    checked again against Triton's binder (:func:`_same_kernel`)."""
    if not enabled or device.type != "cuda" or interpreter_enabled():
        return False
    return _triton_launches_as_replays_do()


#: The call ``JITFunction.run`` makes after binding, in the Triton versions whose launch path this module
#: follows (3.5 to 3.9 at least): the compiled kernel's launcher with the grid, the stream, the function,
#: the packed metadata, the launch metadata, the two hooks, then every bound parameter.
_TRITON_LAUNCH = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
                  "launch_metadata,")


@functools.lru_cache(maxsize=1)
def _triton_launches_as_replays_do() -> bool:
    """Whether the installed Triton's ``JITFunction.run`` calls the compiled kernel's launcher exactly
    as :meth:`Replay.launch` does (read from its source once), and has the binder and kernel cache
    :func:`_same_kernel` reads."""
    try:
        from triton import knobs  # noqa: F401  (Replay reads the launch hooks there)
        from triton.runtime.jit import JITFunction, compute_cache_key  # noqa: F401

        source = " ".join(inspect.getsource(JITFunction.run).split())
    except Exception:  # another Triton, or no source: launch through kernel[grid]
        return False
    return _TRITON_LAUNCH in source


def _same_kernel(call: KernelCall, compiled) -> bool:
    """Whether Triton's binder maps ``call``'s parameters and options to ``compiled`` with the
    parameters in ``call.params``'s order: the look-up ``JITFunction.run`` makes before it launches
    (``device_caches[device]`` → binder → ``compute_cache_key`` → kernel cache), with no pre-run hook
    (which a direct replay would skip). False if any step is missing or differs."""
    try:
        from triton import knobs
        from triton.runtime.driver import driver
        from triton.runtime.jit import compute_cache_key

        kernel = call.kernel
        if getattr(kernel, "pre_run_hooks", None):
            return False
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


@functools.lru_cache(maxsize=1)
def _pointer_attribute():
    """The CUDA driver's ``cuPointerGetAttribute`` (through ``ctypes``), or None where it cannot be
    loaded."""
    import ctypes

    try:
        fn = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64)
    fn.restype = ctypes.c_int
    return fn


#: ``CU_POINTER_ATTRIBUTE_DEVICE_POINTER``: the address a kernel uses for a host or device pointer.
_DEVICE_POINTER = 3


def device_address(t: torch.Tensor) -> int | None:
    """The address a kernel uses for tensor ``t``'s memory, as Triton's launcher translates a tensor
    argument on every launch (``cuPointerGetAttribute``; for pinned host memory under unified
    addressing, the host address itself), or None where the driver does not say."""
    import ctypes

    fn = _pointer_attribute()
    if fn is None or t.data_ptr() == 0:
        return None
    out = ctypes.c_uint64(0)
    if fn(ctypes.byref(out), _DEVICE_POINTER, t.data_ptr()) != 0:
        return None
    return out.value


#: The call a Triton 3.6 ``CudaLauncher.__call__`` makes after allocating its scratch buffers (None for
#: kernels without scratch): the compiled module's ``launch`` with the cooperative and PDL flags and the two
#: scratch pointers inserted before the packed metadata, the launch metadata, the hooks and the parameters.
_RAW_LAUNCH = ("self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
               "global_scratch, profile_scratch, *args)")


@functools.lru_cache(maxsize=8)
def _raw_launch_form(launcher_type) -> bool:
    """Whether ``launcher_type.__call__`` (a compiled kernel's launcher class) has Triton 3.6's signature
    and makes the call :data:`_RAW_LAUNCH` gives (read from its source once per class)."""
    try:
        source = " ".join(inspect.getsource(launcher_type.__call__).split())
    except Exception:
        return False
    return source.startswith("def __call__(self, gridX, gridY, gridZ, stream, function, *args):") and \
        _RAW_LAUNCH in source


def raw_launch(run):
    """``(launch, cooperative, pdl)``: the compiled module's own launch function behind the launcher
    ``run`` and the two flags it inserts, where ``run`` is a launcher of the form :func:`_raw_launch_form`
    recognises for a kernel without global or profile scratch; else None (call ``run`` itself). Calling
    ``launch`` directly skips the launcher's Python frame and its two scratch allocations, which
    return None for such a kernel."""
    try:
        if not _raw_launch_form(type(run)) or run.global_scratch_size or run.profile_scratch_size:
            return None
        return run.launch, run.launch_cooperative_grid, run.launch_pdl
    except Exception:  # another launcher: call it
        return None


def _idle(hook) -> bool:
    """Whether a launch hook of ``triton.knobs.runtime`` runs nothing: None, or (Triton 3.5+, where each
    hook is a ``HookChain``) a chain without calls. Anything else (a profiler's hook) sends a replay
    through ``kernel[grid]``, which calls it."""
    return hook is None or (hook.__class__.__name__ == "HookChain" and not hook.calls)


class Replay:
    """A launch recorded from ``call``, replayed with other tensors in the slots ``slots`` names.

    It keeps no reference to the recording call's tensors (only the kernel, grid, options, the
    parameters that are not slots, and each slot's dtype), so the cache never holds a caller's memory.

    Args:
        call: the launch as first made (its tensors are the recording call's).
        slots: ``(param_index, tensor_index)`` pairs: parameter ``param_index`` is the call's tensor
            number ``tensor_index`` (see :meth:`launch`); every other parameter is reused as recorded
            (workspace tables, sizes, the signature, constexprs).
        compiled: what ``call.launch()`` returned (Triton's ``CompiledKernel``, or None).
        direct: use the compiled kernel's launcher (:func:`direct_launch_supported` for the device).
        device_index: the CUDA device the launch was recorded on (a direct replay runs only while it is
            current; otherwise ``kernel[grid]`` decides, as for a first call).
    """

    __slots__ = ("kernel", "grid", "options", "slots", "compiled", "direct", "device_index", "_template",
                 "_dtypes", "_params", "_function", "_run", "_raw", "_meta", "_hooks", "_sources", "_targets",
                 "_current_device")

    def __init__(self, call: KernelCall, slots: tuple, compiled, direct: bool, device_index: int | None = None):
        self.kernel, self.grid, self.options = call.kernel, call.grid, call.options
        self.slots = slots
        self.compiled = compiled
        self.device_index = device_index
        template = list(call.params)
        # slots whose recorded tensor is a byte view (FP8 outputs): kernel[grid] gets the same view of the
        # new tensor; every other slot's dtype is fixed by the call's key
        self._dtypes = tuple((i, j, template[i].dtype) for i, j in slots if template[i].dtype == torch.uint8)
        for i, _ in slots:
            template[i] = None
        self._template = tuple(template)
        self._params = list(template)
        self.direct = bool(direct and compiled is not None and _same_kernel(call, compiled))
        if self.direct:  # compiled.run loads the module on first use (done by the recording launch)
            self.bind_launcher(compiled.run, compiled.function, compiled.packed_metadata)

    def bind_launcher(self, run, function, packed_metadata) -> None:
        """Replay through ``run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
        enter_hook, exit_hook, *params)`` (a compiled kernel's launcher and its arguments), pointer
        parameters as addresses: the slots', the workspace's device tables' and the pinned error words'
        (the launcher asks the driver to translate each tensor it is given, a driver call per tensor
        and launch; here the error words are translated once, :func:`device_address`, and stay a
        tensor only where the driver cannot say). Where ``run`` is a launcher whose own launch function
        can be called directly (:func:`raw_launch`), that function is called. The tables and the error
        words outlive the cache, which the communicator clears before it frees them."""
        from triton import knobs

        self.direct = True
        self._hooks = knobs.runtime  # launch_enter_hook / launch_exit_hook: a profiler's
        # the current CUDA device's index (0.1 µs; torch.cuda.current_device is a Python wrapper of it)
        self._current_device = getattr(torch._C, "_cuda_getDevice", lambda: None)
        self._run, self._function, self._meta = run, function, packed_metadata
        self._raw = raw_launch(run)  # (launch, cooperative, pdl): the module's launch, called directly
        for i, _ in self.slots:
            self._params[i] = 0
        for i, p in enumerate(self._params):  # the workspace's tensors: their addresses, read once
            if isinstance(p, torch.Tensor):
                address = p.data_ptr() if p.is_cuda else device_address(p)
                if address is not None:
                    self._params[i] = address
        # each tensor's address read once, however many parameters take it
        self._sources = tuple(dict.fromkeys(j for _, j in self.slots))
        self._targets = tuple(tuple(i for i, j in self.slots if j == src) for src in self._sources)

    def launch(self, tensors, stream: int | None = None, ptrs=None) -> None:
        """Launch with ``tensors[j]`` in each slot ``(i, j)`` (any tensor with the recorded one's memory:
        ``kernel[grid]`` gets it viewed as the recorded dtype, e.g. FP8 bytes as ``uint8``). ``stream``:
        the raw CUDA stream (``torch._C._cuda_getCurrentRawStream``), needed by a direct replay;
        ``ptrs``: the tensors' addresses where the caller has read them (a direct replay takes those)."""
        hooks = self._hooks if self.direct else None
        if (hooks is not None and _idle(hooks.launch_enter_hook) and _idle(hooks.launch_exit_hook)
                and self._current_device() == self.device_index):
            params = self._params  # addresses only: no caller's tensor stays referenced
            for j, targets in zip(self._sources, self._targets):
                ptr = tensors[j].data_ptr() if ptrs is None else ptrs[j]
                for i in targets:
                    params[i] = ptr
            raw = self._raw
            if raw is None:
                self._run(self.grid, 1, 1, stream, self._function, self._meta, None, None, None, *params)
            else:
                raw[0](self.grid, 1, 1, stream, self._function, raw[1], raw[2], None, None, self._meta, None, None,
                       None, *params)
            return
        params = list(self._template)
        for i, j in self.slots:
            params[i] = tensors[j]
        for i, j, dtype in self._dtypes:
            if params[i].dtype is not dtype:
                params[i] = params[i].view(dtype)
        self.kernel[(self.grid,)](*params, **self.options)
