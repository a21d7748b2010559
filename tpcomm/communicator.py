"""``Communicator``: the API. Validates inputs, picks a plan, launches, falls back."""

from __future__ import annotations

import contextlib
import itertools
import numbers
import socket
import threading
import weakref

import torch
import torch.distributed as dist

from . import call_cache, dispatch, reference, validate
from .env import interpreter_enabled, interpreter_problem, read_env
from .errors import PeerAbortedError, PeerMismatchError, PeerTimeoutError
from .kernels import chunks
from .kernels.launch import direct_launch_supported
from .kernels.sync import ABORTED_CODE, MISMATCH_CODE, call_signature
from .quant import DEFAULT_GROUP_SIZE, check_unquantized_call, fp8_outputs
from .validate import checked_limits
from .workspace import Workspace, slot_bytes_for

#: Default bytes one launch can carry per rank. 32 MiB on CUDA keeps a 4096 x 4096 bf16 call in one
#: launch; 1 MiB under the CPU interpreter, whose calls are small. Larger messages run in chunks.
DEFAULT_MAX_BYTES_CUDA = 32 << 20
DEFAULT_MAX_BYTES_CPU = 1 << 20
#: How host code writes a call's outputs (the fallback's results, a strided ``out`` staged through a
#: contiguous one): in inference mode, so that, as the kernels' writes, they record no autograd history
#: and go into any output the kernels could write (a view of a leaf that requires grad, a tensor made in
#: inference mode and used outside it).
_HOST_WRITES = torch.inference_mode

#: Every live Communicator by its ``handle`` (weak), for ``tpcomm.ops``: handles start at 1 and are never
#: reused, so a compiled graph that outlives its communicator raises instead of using another one.
_BY_HANDLE: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)


def _check_plan_args(op, nbytes, hidden, dtype) -> None:
    """The arguments of :meth:`Communicator.plan` (its Raises section)."""
    if op not in dispatch.OPS:
        raise ValueError(f"plan: op must be one of {dispatch.OPS}, got {op!r}")
    for name, value in (("nbytes", nbytes), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"plan: {name} must be an int, got {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"plan: {name} must be >= 0, got {value}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"plan: dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")


class Communicator:
    """Tensor-parallel collectives for one process group, on the GPUs of one node or on CPU ranks.

    Collective: every rank of ``group`` constructs it, and calls every op in the same order with the same
    shapes, dtypes and arguments (as with ``torch.distributed``).

    Plain-torch equivalent::

        comm.all_reduce(x)                        == torch.distributed.all_reduce(x.clone())
        comm.fused_add_rmsnorm(x, r, w, eps)      == rms_norm(all_reduce(x) + r, w, eps), all_reduce(x) + r

    but with the numerics contract (docs/numerics.md): float32 accumulation in rank order, identical bits on
    every rank, for every algorithm and number of rows.

    Args:
        group: a ``torch.distributed`` process group (default: the world). An NCCL group runs the CUDA
            kernels on the current CUDA device; a gloo group runs the same kernels under Triton's CPU
            interpreter (``TRITON_INTERPRET=1``, which importing tpcomm sets on a machine without CUDA; on
            a machine with CUDA, set it before tpcomm and Triton are imported).
        max_bytes: bytes of one rank's message that one launch carries (default 32 MiB on CUDA, 1 MiB on
            CPU), rounded up to a multiple of 256 (``comm.max_bytes`` is the rounded value). Larger
            messages run in chunks of whole rows through the same kernels: no size limit.
        timeout_s: seconds a kernel waits for a peer before giving up (default ``TPCOMM_TIMEOUT_S`` or 30).

    Falls back to ``torch.distributed`` (on every rank together) when the group spans hosts, the
    workspace cannot be mapped, or the world size is 1; per call for dtypes without a kernel.

    Safe in CUDA graphs: the workspace is armed here, epochs live in device memory and advance inside
    the kernels, and no call depends on a host value that changes.

    ``handle`` (an ``int >= 1``, unique in this process, never reused) names it in the ``torch.library``
    ops of :mod:`tpcomm.ops`, which find it through a weak registry.

    Raises:
        TypeError: ``group`` is not a ``torch.distributed.ProcessGroup`` (nor None), on this rank alone
            (nothing is exchanged before the check).
        TypeError, ValueError: ``max_bytes`` or ``timeout_s`` is out of range or of the wrong type, or a
            ``TPCOMM_*`` variable is invalid, on this rank; on the other ranks a ValueError naming the
            rank that refused (every rank raises, none waits for it); or this process is not a member of
            ``group`` (the placeholder ``new_group`` returns on the ranks it leaves out; with
            ``use_local_synchronization=True`` those ranks get None, which means the default group here,
            as everywhere in torch.distributed).
        ValueError: on every rank, when a setting the ranks must agree on differs (``max_bytes``,
            ``TPCOMM_ALGO``, the tpcomm and Triton versions, the workspace layout): the message names it and
            each rank's value.
    """

    def __init__(self, group=None, max_bytes: int | None = None, timeout_s: float | None = None):
        if not dist.is_initialized():
            raise RuntimeError("Communicator: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first (or use tpcomm.launch)")
        given = group
        group = group if group is not None else dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup) and group is not dist.GroupMember.NON_GROUP_MEMBER:
            raise TypeError(f"Communicator: group must be a torch.distributed ProcessGroup (or None: the default "
                            f"group), got {type(given).__name__} {given!r}")
        if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on other ranks
            raise ValueError("Communicator: this process is not a member of group (torch.distributed.new_group "
                             "returns a placeholder on the ranks it leaves out); create the Communicator only "
                             "on the group's ranks")
        self.group = group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        # Arguments and TPCOMM_* variables are checked on every rank, and a rank that refuses them tells
        # the others before anyone waits in a set-up collective for it.
        error = None
        try:
            self._configure(max_bytes, timeout_s)
        except Exception as e:  # any failure must reach every rank (they wait in the exchange below)
            error = e
        errors: list = [None] * self.world_size
        why = None if error is None else f"{type(error).__name__}: {str(error).removeprefix('Communicator: ')}"
        dist.all_gather_object(errors, why, group=self.group)
        if error is not None:
            raise error
        refused = [f"rank {r} (global rank {dist.get_global_rank(self.group, r)}): {e}"
                   for r, e in enumerate(errors) if e]
        if refused:
            raise ValueError(f"Communicator: refused on another rank, so on every rank: {'; '.join(refused)}")
        self._init_calls()
        self.table = self._load_table()
        self.fallback_reason = self._set_up()
        self._register()

    @property
    def group(self):
        """The ``torch.distributed`` process group (None for a :mod:`tpcomm.loopback` rank). Held weakly:
        a communicator never keeps its group alive past ``torch.distributed.destroy_process_group`` (a
        gloo group that is freed only when the interpreter exits can abort the process then).

        Raises:
            RuntimeError: the group was destroyed (a call that would use it: the fallback).
        """
        ref = self._group_ref
        if ref is None:
            return None
        group = ref()
        if group is None:
            raise RuntimeError("Communicator: its process group was destroyed "
                               "(torch.distributed.destroy_process_group); create a Communicator on a live group")
        return group

    @group.setter
    def group(self, group) -> None:
        self._group_ref = None if group is None else weakref.ref(group)

    def _init_calls(self) -> None:
        """The state calls keep (local): no workspace yet, the lock, the caches."""
        self.workspace: Workspace | None = None
        self._lock = threading.Lock()
        self._last_stream = None
        self._signatures: dict[int, str] = {}  # signature -> op, for error messages
        self._sig_by_key: dict[tuple, int] = {}  # (op, fields) -> signature
        self._plans: dict = {}  # plan() per call shape: the plan is a pure function of it
        self._calls = call_cache.CallCache()  # recorded launches per call key (tpcomm.call_cache)
        self._record: list | None = None  # while a call records: its (KernelCall, compiled) launches
        self._cuda = self.device.type == "cuda"
        self._direct = direct_launch_supported(self.device, self.env.direct_launch)
        self._closed = False

    def _register(self) -> None:
        """Give this communicator its handle, its name in the torch.library ops (:mod:`tpcomm.ops`)."""
        self.handle = next(_NEXT_HANDLE)
        _BY_HANDLE[self.handle] = self

    def _configure(self, max_bytes: int | None, timeout_s: float | None) -> None:
        """Read ``TPCOMM_*``, pick the device and check ``max_bytes`` and ``timeout_s``. Local (no
        collective); raises TypeError or ValueError."""
        self.env = read_env()
        backend = str(dist.get_backend(self.group))
        if "nccl" in backend and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if max_bytes is None:
            max_bytes = DEFAULT_MAX_BYTES_CUDA if self.device.type == "cuda" else DEFAULT_MAX_BYTES_CPU
        self.max_bytes, self.timeout_s = checked_limits("Communicator", max_bytes,
                                                        self.env.timeout_s if timeout_s is None else timeout_s)
        self.max_bytes = slot_bytes_for(self.max_bytes)  # what a launch carries: the plans and peers compare it
        self.algorithm = self.env.algo

    # -- set-up -------------------------------------------------------------------------------------
    def _load_table(self) -> dispatch.CrossoverTable:
        """Rank 0's crossover table (``TPCOMM_DISPATCH_TABLE``, else the defaults), on every rank. Collective.

        Raises:
            ValueError: rank 0's file cannot be read or is not a table (raised on every rank).
        """
        text, error = None, None
        if self.rank == 0 and self.env.table:
            try:
                text = dispatch.load_table(self.env.table).to_json()
            except Exception as e:  # any failure must reach every rank (they wait in the broadcast)
                error = f"TPCOMM_DISPATCH_TABLE={self.env.table!r} on rank 0: {e}"
        box = [(text, error)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        text, error = box[0]
        if error:
            raise ValueError(f"Communicator: {error}")
        return dispatch.CrossoverTable.from_json(text) if text else dispatch.DEFAULT_TABLE

    def _agreed_settings(self) -> dict:
        """The settings every rank must share, by name: a peer with another value would run other kernels,
        another workspace layout or another protocol. (Settings that may differ: ``timeout_s`` and
        ``TPCOMM_TIMEOUT_S``, each rank waiting its own; ``TPCOMM_MAX_PROGRAMS``, the smallest is used;
        ``TPCOMM_DISPATCH_TABLE``, rank 0's is used; ``TPCOMM_PDL`` and ``TPCOMM_DIRECT_LAUNCH``, how a
        rank launches on its own stream.)"""
        import triton

        from . import __version__

        return {"max_bytes": self.max_bytes, "TPCOMM_ALGO": self.algorithm, "tpcomm version": __version__,
                "Triton version": triton.__version__,
                "workspace layout": (f"LAMPORT_MAX_BYTES={dispatch.LAMPORT_MAX_BYTES}, "
                                     f"TWO_SHOT_GRID_FACTOR={dispatch.TWO_SHOT_GRID_FACTOR}, "
                                     f"ALL_REDUCE_ROW={dispatch.ALL_REDUCE_ROW}, MAX_BLOCK_H={dispatch.MAX_BLOCK_H}")}

    def _set_up(self) -> str | None:
        """Check that the ranks agree on :meth:`_agreed_settings`, then create the workspace if every rank
        can; returns why not (None when it exists). Collective.

        Raises:
            ValueError: on every rank, when a setting differs between ranks: its name and each rank's value.
        """
        info = (socket.gethostname(), self._local_programs(), interpreter_enabled(), interpreter_problem(),
                self._agreed_settings())
        infos: list = [None] * self.world_size
        dist.all_gather_object(infos, info, group=self.group)
        hosts, programs, interpreted, problems, settings = zip(*infos)
        differ = [name for name in settings[0] if any(s.get(name) != settings[0][name] for s in settings)]
        if differ:
            raise ValueError("Communicator: the ranks must agree on " + "; ".join(
                f"{name} (" + ", ".join(f"rank {r}: {s.get(name)!r}" for r, s in enumerate(settings)) + ")"
                for name in differ))
        reason = None
        if self.world_size < 2:
            reason = "a group of one rank needs no communication"
        elif len(set(hosts)) > 1:
            reason = "the group spans several hosts"
        elif self.device.type == "cpu" and not all(interpreted):  # every rank decides alike
            without = [r for r, i in enumerate(interpreted) if not i]
            reason = (f"CPU ranks need Triton's interpreter, and group rank(s) {without} run without it: set "
                      "TRITON_INTERPRET=1 before Python starts on every rank (importing tpcomm sets it only on "
                      "a machine without CUDA, and only where it is unset)")
        elif self.device.type == "cpu" and any(p for p in problems):
            at = [r for r, p in enumerate(problems) if p]
            reason = f"on group rank(s) {at}: " + next(p for p in problems if p).replace("this process", "that process")
        if reason is not None:
            return reason
        max_programs = min(programs)
        error = None
        try:
            ws = Workspace(self.group, self.device, self.max_bytes, max_programs, self.timeout_s,
                           lamport_slot_bytes=min(self.max_bytes, dispatch.LAMPORT_MAX_BYTES),
                           pdl=self.env.pdl)  # the workspace keeps it only where pdl_supported
        except Exception as e:  # any rank's failure sends every rank to the fallback
            ws, error = None, f"workspace set-up failed on rank {self.rank}: {e}"
        errors: list = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        failed = [e for e in errors if e]
        if failed:
            if ws is not None:
                ws.close()
            return failed[0]
        self.workspace = ws
        return None

    def _local_programs(self) -> int:
        if self.env.max_programs is not None:
            return self.env.max_programs
        if self.device.type == "cuda":
            # Two programs per SM (docs/design.md, "Two programs per SM").
            return 2 * torch.cuda.get_device_properties(self.device).multi_processor_count
        return 4

    # -- public ops ---------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum ``x`` over the ranks of the group.

        Collective: every rank calls it with the same shape and dtype.

        Args:
            x: any shape, bf16 / fp16 / fp32 (kernels) or an integer dtype (gathered through the
                all-gather kernel and summed exactly in int64, wrapping like a native sum; through
                ``torch.distributed`` when the group has no workspace), on this communicator's device.
                Non-contiguous inputs are copied first.
            out: optional output of ``x``'s shape, dtype and device; may be ``x`` itself (in place), or
                overlap ``x`` in any other way (then ``x`` is copied first, so the result is still exact).
        Returns:
            ``out`` (or a new tensor): ``T(+0.0 + f32(x_0) + ... + f32(x_{W-1}))``, the same bits on
            every rank and for every algorithm. Safe in CUDA graphs.
        Raises:
            TypeError: ``x`` is not a tensor, or its dtype has no sum (bool, FP8, complex).
            ValueError: ``x`` or ``out`` is on another device, ``out`` does not match ``x``, ``out``'s
                strides let two elements share memory (a stride of 0, or e.g. strides ``(1, 1)``), or
                ``out`` is a lazily negated view (``torch._neg_view``).
            PeerTimeoutError: a peer did not arrive within the timeout (this or an earlier call);
                :class:`PeerMismatchError` when it made a different call.
        """
        op = "all_reduce"
        key = call_cache.all_reduce_key(x, out, self.algorithm)
        try:
            entry = self._calls.lookup(key)
        except TypeError:  # an unhashable argument (e.g. a list for a scalar): the full path names it
            entry = None
        if entry is not None and not self._closed:
            y = entry.hit(self, x, out)
            if y is not None:
                return y
        self._check_open(op)
        validate.check_tensor(op, "x", x, self.device)
        validate.check_summable(op, x)
        x = x.resolve_neg()  # a lazily negated view: the kernels read memory, so the negation is made real
        overlap = False
        given = out is not None
        if out is None:
            out = call_cache.new_like(x)
        else:
            validate.check_all_reduce_out(op, x, out, self.device)
            overlap = x.is_contiguous() and out.is_contiguous() and validate.partly_overlaps(out, x)
        if x.numel() == 0:
            return out
        n = x.numel()
        plan = self.plan(op, n * x.element_size(), n, x.dtype)
        if plan.algorithm == "push":  # an integer sum
            with _HOST_WRITES():
                out.copy_(self._integer_sum(op, x, (tuple(x.shape),)).view(x.shape))
            return out
        width = dispatch.all_reduce_width(n, x.element_size(), self.workspace, plan.algorithm)
        if plan.algorithm == "fallback":
            self._before_fallback(op, (tuple(x.shape), str(x.dtype)))
            with _HOST_WRITES():
                out.copy_(reference.all_reduce_reference(x, self.group))
            return out
        # an out that overlaps x other than in place would be written while peers and this rank still
        # read x: reduce from a copy. The kernels address x and out flat, whatever their shape.
        src = x.clone() if overlap else x.contiguous()
        dst = out if out.is_contiguous() else torch.empty(n, dtype=x.dtype, device=x.device)
        launched = [] if key is not None and not overlap else None
        self._run_rows(op, plan, src, dst, None, None, None, -(-n // width), width, 0.0, norm=False,
                       gemma=False, call=(tuple(x.shape),), record=launched)
        if dst.data_ptr() != out.data_ptr():
            with _HOST_WRITES():
                out.copy_(dst.view(out.shape))
        elif launched is not None:
            self._remember(key, launched, (x, out), call_cache.all_reduce_spec(x, out, given))
        return out

    def fused_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                          eps: float = 1e-6, gemma: bool = False, quant: str | None = None,
                          fp8_dtype: torch.dtype = torch.float8_e4m3fn, group_size: int = DEFAULT_GROUP_SIZE,
                          column_major_scales: bool = False, emit_unquantized: bool = False, *,
                          scale: torch.Tensor | None = None, swizzled_scales: bool = False,
                          out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                          q_out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None):
        """All-reduce ``x``, add ``residual``, RMSNorm — in one kernel.

        Plain torch: ``s = all_reduce(x); residual_out = s + residual;
        out = residual_out * rsqrt(mean(residual_out^2) + eps) * w`` (``w`` replaced by ``1 + w`` when
        ``gemma``), with the numerics contract (docs/numerics.md).

        Collective: every rank calls it with the same shapes, dtypes, ``eps`` and ``gemma``.

        Args:
            x: ``(T, H)`` (or ``(..., H)``: leading dims are flattened), bf16 / fp16 / fp32, this device.
            residual: like ``x`` (same shape and dtype), or None for the no-residual form.
            weight: ``(H,)`` norm weight, any float dtype (used as ``f32(w)``; typically the input's or
                float32).
            eps: >= 0, added to the mean square.
            gemma: use ``1 + w`` (Gemma-style norms).
            quant: None, or one of ``"fp8_per_token"``, ``"fp8_per_group"``, ``"fp8_per_group_ue8m0"``,
                ``"fp8_static"`` (FP8), ``"mxfp4"``, ``"nvfp4"`` (FP4): also quantise ``out`` in the same
                kernel. The per-token and per-group FP8 forms (docs/numerics.md item 4):
                ``scale = amax / MAX`` over the row (or group) of the rounded ``out`` (1 where that is 0;
                with ``_ue8m0`` rounded up to a power of two), ``q = fp8(out / scale)`` saturated to +-MAX;
                the bytes and scales equal :func:`tpcomm.quant.per_token_quant_fp8` /
                :func:`~tpcomm.quant.per_group_quant_fp8` (``ue8m0=True`` for the third form) applied to
                the unquantised ``out``. ``"fp8_static"``: one calibrated ``scale`` for the whole tensor,
                ``q = fp8(out * f32(1 / scale))`` (docs/numerics.md, "Static per-tensor FP8"), the bytes
                of :func:`tpcomm.quant.static_quant_fp8` applied to ``out``. ``"mxfp4"`` / ``"nvfp4"``:
                E2M1 codes packed two to a byte with a scale per block of 32 (E8M0) or 16 (e4m3fn, from
                the global ``scale``), the bytes and scales of :func:`tpcomm.quant.mxfp4_quant` (the
                spec's ``"floor"`` rule) / :func:`~tpcomm.quant.nvfp4_quant` applied to ``out``
                (docs/numerics.md, "MXFP4", "NVFP4"); H a multiple of the block.
            fp8_dtype: the FP8 forms only: ``torch.float8_e4m3fn`` (MAX 448) or ``torch.float8_e4m3fnuz``
                (MAX 240).
            group_size: elements per scale of the per-group forms (default 128, DeepSeek-V3's 1 x 128);
                a power of two that divides H. Another value with ``fp8_per_token`` raises ValueError.
            column_major_scales: the per-group forms only, ``x`` 2-D: return the scales as the transpose
                view of a contiguous ``(H / group_size, T)`` tensor (the layout grouped GEMMs read).
            emit_unquantized: with ``quant``, also return ``out`` in the input dtype.
            scale: with ``quant="fp8_static"`` (the calibrated scale) or ``"nvfp4"`` (the global scale,
                TensorRT-LLM's ``448 * 6 / amax``) only, and then required: float32 tensor of one element
                (shape ``()``, ``(1,)`` or ``(1, 1)``) on this device, finite and positive (a static one
                also more than 2**-128, so that its float32 reciprocal is finite), the same on every rank;
                read by the kernel, so a CUDA graph replays with its current value. Its
                value is checked on CPU only (a CUDA scale is not read on the host: a bad one gives NaN,
                zero or saturated bytes).
            swizzled_scales: the FP4 forms only, ``x`` 2-D: return the block scales in the 128x4 layout
                of SM100 FP4 GEMMs (a zero-padded contiguous ``(ceil(T / 128) * 128, ceil(H / block /
                4) * 4)`` tensor, :func:`tpcomm.reference.swizzle_128x4`); a given ``scales_out`` keeps
                its padding as it is.
            out, residual_out: where to write ``out`` and ``residual_out`` instead of new tensors:
                contiguous, ``x``'s shape and dtype; ``residual_out`` may be ``residual`` itself (the
                residual updated in place, as engines call ``fused_add_rms_norm``). With ``quant``,
                ``out`` needs ``emit_unquantized``.
            q_out, scales_out: with ``quant``, where to write ``q`` and the scales: contiguous, the shape
                and dtype this call would return (FP8: ``x``'s shape in ``fp8_dtype``; FP4: ``(..., H / 2)``
                uint8), the scales also with its strides (FP8: float32; MXFP4: uint8; NVFP4:
                ``torch.float8_e4m3fn``; none with ``fp8_static``). No given output may share memory with
                an input or another output.
        Returns:
            Without ``quant``: ``(out, residual_out)``, shaped like ``x`` (the given tensors, or new ones);
            ``residual_out`` is None without a residual. With ``quant``: ``(q, scales, residual_out,
            out)``: ``q`` shaped like ``x`` in ``fp8_dtype``; ``scales`` float32 ``(..., 1)`` per token
            or ``(..., H / group_size)`` per group, ``scale`` itself (the same object) for
            ``fp8_static``; FP4: ``q`` ``(..., H / 2)`` uint8 and the block scales, uint8 E8M0 bytes
            (MXFP4) or ``torch.float8_e4m3fn`` (NVFP4), ``(..., H / block)`` or swizzled; ``out`` None
            unless ``emit_unquantized``. Identical
            bits on every rank, for every algorithm. Safe in CUDA graphs. Messages larger than
            ``max_bytes`` run in chunks of rows.
        Raises:
            TypeError: a tensor argument is not a tensor or has an unsupported dtype.
            TypeError: ``gemma``, ``emit_unquantized``, ``column_major_scales`` or ``swizzled_scales`` is
                not a bool; ``group_size`` is not an int; ``scale`` is not a float32 tensor.
            ValueError: shapes disagree (x vs residual vs weight), a tensor is on another device,
                ``eps`` is negative or not finite (TypeError if it is not a number), a quant argument
                is invalid (unknown ``quant`` or ``fp8_dtype``, H not a multiple of ``group_size``, ``scale``
                missing, of more than one element, on another device or, on CPU, not finite and positive,
                ``scale`` without ``fp8_static`` or ``nvfp4``, ``scales_out`` with ``fp8_static``), or a
                given output has the wrong shape, dtype or layout, is a lazily negated view, or overlaps an
                input or another output.
            PeerTimeoutError: a peer did not arrive within the timeout (this or an earlier call).
        """
        op = "fused_add_rmsnorm"
        key = call_cache.fused_key(x, residual, weight, eps, gemma, quant, fp8_dtype, group_size,
                                   column_major_scales, emit_unquantized, out, residual_out, q_out, scales_out,
                                   self.algorithm, scale, swizzled_scales)
        try:
            entry = self._calls.lookup(key)
        except TypeError:  # an unhashable argument (e.g. a list for a scalar): the full path names it
            entry = None
        if entry is not None and not self._closed:
            outs = entry.hit(self, x, residual, weight, out, residual_out, q_out, scales_out, scale)
            if outs is not None:
                return outs
        self._check_open(op)
        eps = validate.check_fused_inputs(op, x, residual, weight, eps, gemma, emit_unquantized,
                                          column_major_scales, self.device)
        x, weight = x.resolve_neg(), weight.resolve_neg()  # lazily negated views made real (as all_reduce)
        if residual is not None and residual.is_neg():
            residual = residual.resolve_neg()
        if quant is None:
            check_unquantized_call(op, fp8_dtype, group_size, column_major_scales, emit_unquantized, scale,
                                   swizzled_scales)
        validate.check_fused_outputs(op, x, residual, weight, quant, emit_unquantized, out, residual_out,
                                     self.device)
        H = x.shape[-1]
        T = x.numel() // H if H else 0
        qout = None
        if quant is not None:
            qout = fp8_outputs(op, x, quant, fp8_dtype, group_size, column_major_scales, q_out, scales_out, scale,
                               swizzled_scales)
        else:
            validate.check_fp8_outputs(op, x, None, q_out, scales_out, None, fp8_dtype, self.device)
        plan = self.plan(op, x.numel() * x.element_size(), H, x.dtype) if x.numel() else None
        # Only FP8 asked for, with a residual, from a kernel that stages nothing in out (one-shot, Lamport):
        # out is not written, and the kernels take residual_out as their out pointer (for its dtype).
        no_out = (qout is not None and not emit_unquantized and residual is not None and plan is not None
                  and plan.algorithm in ("one_shot", "lamport"))
        static = quant == "fp8_static"  # its scales are the input scale: neither given nor new
        given = (out, residual_out) + ((q_out, scales_out) if qout is not None else ())
        if residual_out is None and residual is not None:
            residual_out = call_cache.new_like(x)
        if out is None:
            out = residual_out if no_out else call_cache.new_like(x)
        outputs = (None if no_out else out, residual_out) + ((qout.q_fp8, None if static else qout.scales_view)
                                                             if qout is not None else ())
        # the kernels read x, residual, weight and a static scale in place: a given output may not share
        # their bytes (residual_out may be residual itself)
        xc, rc, wc = x.contiguous(), residual.contiguous() if residual is not None else None, weight.contiguous()
        if any(t is not None for t in given):
            clash = validate.overlapping(outputs, (xc, rc, wc, scale), allowed=((1, 1),))
            if clash is not None:
                names = ("out", "residual_out", "q_out", "scales_out")
                other = ("x", "residual", "weight", "scale") + names
                raise ValueError(f"{op}: {names[clash[0]]} shares memory with {other[clash[1]]}; outputs may "
                                 "overlap no input and no other output (residual_out may be residual itself)")

        def result():
            if qout is None:
                return out, residual_out
            return qout.q_fp8, qout.scales_view, residual_out, (out if emit_unquantized else None)

        if x.numel() == 0:
            return result()
        if plan.algorithm == "fallback":
            # what the kernels' signatures hold (column_major_scales and emit_unquantized may differ)
            self._before_fallback(op, (tuple(x.shape), str(x.dtype), residual is None, eps, gemma, quant,
                                       str(fp8_dtype), group_size, swizzled_scales))
            with _HOST_WRITES():
                o, ro = reference.fused_add_rmsnorm_reference(x, residual, weight, eps, gemma, self.group)
                out.copy_(o)
                if residual_out is not None:
                    residual_out.copy_(ro)
                if qout is not None:
                    qout.fill_from(out)
            return result()
        launch_quant = qout.launch_args(self.device, emit_unquantized) if qout else None
        # contiguous, any number of dimensions: the kernels take flat pointers (_run_rows flattens a
        # tensor only to cut it into launches)
        launched = [] if key is not None else None
        self._run_rows(op, plan, xc, out, rc, residual_out, wc, T, H, eps, norm=True, gemma=gemma,
                       quant=launch_quant, record=launched)
        if launched is not None:
            tensors = (x, residual, weight, out, residual_out, launch_quant and launch_quant.q,
                       launch_quant and launch_quant.scales, scale)
            passed = tuple(g is not None for g in given) + (False,) * (4 - len(given))
            self._remember(key, launched, tensors, call_cache.fused_spec(
                tensors, (outputs + (None, None))[:4], passed, quant, emit_unquantized, swizzled_scales, self._cuda))
        return result()

    def fused_qk_rmsnorm(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         eps: float = 1e-6, *, q_out: torch.Tensor | None = None,
                         k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of this rank's query and key columns ``q`` ``(T, Nq / W)`` and ``k`` ``(T, Nk / W)`` over
        their full width (every rank's columns: MiniMax-M2's ``q_norm`` / ``k_norm``), in one kernel: the
        per-token sums of squares summed over the ranks in rank order in float32, so every rank scales a
        token by the same bits. Plain torch: ``rms_norm(q_full, w_q, eps)[:, this rank's columns]``.
        Arguments, returns and raises: :func:`tpcomm.collectives.qk_norm.fused_qk_rmsnorm`."""
        from .collectives.qk_norm import fused_qk_rmsnorm

        return fused_qk_rmsnorm(self, q, k, q_weight, k_weight, eps, q_out=q_out, k_out=k_out)

    def fused_moe_finalize_add_rmsnorm(self, expert_out: torch.Tensor, topk_weights: torch.Tensor,
                                       residual: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6, *,
                                       index: torch.Tensor | None = None, shared_out: torch.Tensor | None = None,
                                       scaling: float = 1.0, gemma: bool = False, quant: str | None = None,
                                       **quant_and_outputs):
        """MoE finalize, all-reduce, residual add, RMSNorm: in one launch where the fused norm has one.

        Plain torch: ``x = tpcomm.moe_finalize(expert_out, topk_weights, index=index, shared_out=shared_out,
        scaling=scaling)``, then ``self.fused_add_rmsnorm(x, residual, weight, eps, gemma, quant, ...)``;
        the outputs are that composition's bits (docs/numerics.md, "MoE finalize"), the same on every rank
        for every algorithm and number of tokens.

        Collective: every rank calls it with the same shapes, K, layout, ``scaling``, ``eps`` and quant
        arguments; a peer with another K, H, layout (``index`` or not), ``shared_out`` or not, or
        ``scaling`` is a :class:`PeerMismatchError` (a timeout if it ran another algorithm).

        Args:
            expert_out: this rank's partial expert outputs: ``(T, K, H)`` in token order, or ``(M, H)`` in
                the experts' permuted order with ``index``; bf16 / fp16 / fp32, this device.
            topk_weights: ``(T, K)`` routing weights, float32 / bf16 / fp16 (the same on every rank).
            residual: ``(T, H)`` of ``expert_out``'s dtype, or None.
            weight, eps, gemma, quant: as :meth:`fused_add_rmsnorm`.
            index: ``(T, K)`` int32 / int64, the row of ``expert_out`` of each slot (TensorRT-LLM's
                ``expanded_idx_to_permuted_idx``). Out of ``[0, M)``: ValueError for CPU tensors; on CUDA
                the slot adds nothing and nothing outside ``expert_out`` is read.
            shared_out: ``(T, H)`` partial shared-expert output, ``expert_out``'s dtype, added after the
                scaling.
            scaling: the routed scaling factor (a finite Python float, used rounded to float32).
            quant_and_outputs: ``fp8_dtype``, ``group_size``, ``column_major_scales``,
                ``emit_unquantized``, ``scale``, ``swizzled_scales``, ``out``, ``residual_out``, ``q_out``,
                ``scales_out``, as :meth:`fused_add_rmsnorm` (``(T, H)`` shapes).
        Returns:
            What :meth:`fused_add_rmsnorm` returns for ``x`` ``(T, H)``. Safe in CUDA graphs.
        Raises:
            TypeError, ValueError: a bad argument (named, with what was expected), nothing written:
                :func:`tpcomm.collectives.moe_finalize.check_moe_inputs`, and the errors of
                :meth:`fused_add_rmsnorm`.
            PeerTimeoutError: a peer did not arrive within the timeout; :class:`PeerMismatchError` when
                it made another call.
        """
        from .collectives.moe_finalize import fused_moe_finalize_add_rmsnorm

        return fused_moe_finalize_add_rmsnorm(self, expert_out, topk_weights, residual, weight, eps, index=index,
                                              shared_out=shared_out, scaling=scaling, gemma=gemma, quant=quant,
                                              **quant_and_outputs)

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order.

        Collective: every rank calls it with the same shape and dtype (a peer with another shape is
        detected: :class:`PeerMismatchError`).

        Args:
            x: any shape with at least one dimension, any dtype (the kernel copies it; dtypes other than
                bf16 / fp16 / fp32 move as bytes), this device.
            dim: the dimension to concatenate along (negative counts from the end).
        Returns:
            A new tensor: ``x``'s shape with ``dim`` multiplied by the world size; the slice of rank
            ``q`` holds ``x_q`` bit for bit. Safe in CUDA graphs.
        Raises:
            TypeError: ``x`` is not a tensor, or ``dim`` is not an int.
            ValueError: ``x`` is on another device or a scalar, or ``dim`` is out of range.
            PeerTimeoutError: a peer did not arrive within the timeout (this or an earlier call).
        """
        op = "all_gather"
        key = call_cache.dim_key(op, x, dim, self.algorithm)
        try:
            entry = self._calls.lookup(key)
        except TypeError:  # an unhashable argument (e.g. a list for a scalar): the full path names it
            entry = None
        if entry is not None and not self._closed:
            y = entry.hit(self, x)
            if y is not None:
                return y
        self._check_open(op)
        validate.check_tensor(op, "x", x, self.device)
        dim = validate.check_dim(op, x, dim)
        return self._gather(op, x.resolve_neg(), dim, (tuple(x.shape), dim), key)

    def _gather(self, op: str, x: torch.Tensor, dim: int, call: tuple, key=None) -> torch.Tensor:
        """:meth:`all_gather` of checked arguments. ``op`` and ``call`` (the user's call: its shape and
        ``dim``) go into every launch's signature, so an error names the op the user called and peers
        that called with another ``dim`` (same gathered bytes, other meaning) raise instead of returning
        wrong values. ``key``: the call's key (:mod:`tpcomm.call_cache`), recorded when the launches
        take ``x`` and the output whole."""
        W = self.world_size
        if dim != 0:
            y = x.movedim(dim, 0)  # (S, *pre, *post)
            g = self._gather(op, y, 0, call).view(W, *y.shape).movedim((0, 1), (dim, dim + 1))
            # contiguous, as torch.cat returns it (reshape may give a strided view here)
            return g.reshape(*x.shape[:dim], W * x.shape[dim], *x.shape[dim + 1:]).contiguous()
        n = x.numel()
        out = torch.empty((W * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        if n == 0:
            return out
        plan = self.plan("all_gather", n * x.element_size(), n, x.dtype)  # whichever op it serves
        as_bytes = x.dtype not in dispatch.KERNEL_DTYPES  # a copy: move the bytes (integers, FP8, bool, float64)
        if as_bytes:
            n *= x.element_size()  # from here on, n counts what the kernel moves
        if plan.algorithm == "fallback":
            self._before_fallback(op, call + (str(x.dtype),))
            with _HOST_WRITES():
                out.copy_(reference.all_gather_reference(x, self.group))
            return out
        src, dst = x.contiguous(), out  # addressed flat
        if as_bytes:
            src, dst = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
        launched = [] if key is not None and not as_bytes else None
        self._run(op, chunks.gather_launches(self.workspace, src, dst, n, str(x.dtype), self._signer(op), call),
                  launched)
        if launched is not None:
            self._remember(key, launched, (x, out), call_cache.dim_spec(op, x, out))
        return out

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum ``x`` over the ranks and return this rank's share along ``dim``.

        Shares are cut as ``torch.tensor_split(sum, world_size, dim)`` cuts them: when the size of
        ``dim`` (``T``) is not divisible by the world size, the first ``T % W`` ranks get one row more
        and the last ranks may get none (an empty tensor).

        Collective: every rank calls it with the same shape and dtype.

        Args:
            x: at least one dimension; bf16 / fp16 / fp32 (the two-shot kernel; rows under 16 elements
                through the all-gather kernel and the rank-order sum here) or an integer dtype (the
                all-gather kernel and an exact int64 sum), this device.
            dim: the dimension to scatter along (negative counts from the end).
        Returns:
            A new tensor: rank ``r``'s share of ``T(+0.0 + f32(x_0) + ... + f32(x_{W-1}))``, the same bits
            as the matching rows of :meth:`all_reduce`. Safe in CUDA graphs.
        Raises:
            TypeError: ``x`` is not a tensor, its dtype has no sum (bool, FP8, complex), or ``dim`` is not
                an int.
            ValueError: ``x`` is on another device or a scalar, or ``dim`` is out of range.
            PeerTimeoutError: a peer did not arrive within the timeout (this or an earlier call).
        """
        op = "reduce_scatter"
        key = call_cache.dim_key(op, x, dim, self.algorithm)
        try:
            entry = self._calls.lookup(key)
        except TypeError:  # an unhashable argument (e.g. a list for a scalar): the full path names it
            entry = None
        if entry is not None and not self._closed:
            y = entry.hit(self, x)
            if y is not None:
                return y
        self._check_open(op)
        validate.check_tensor(op, "x", x, self.device)
        validate.check_summable(op, x)
        dim = validate.check_dim(op, x, dim)
        return self._scatter(op, x.resolve_neg(), dim, (tuple(x.shape), dim), key)

    def _scatter(self, op: str, x: torch.Tensor, dim: int, call: tuple, key=None) -> torch.Tensor:
        """:meth:`reduce_scatter` of checked arguments; ``call`` and ``key`` as in :meth:`_gather`."""
        if dim != 0:
            return self._scatter(op, x.movedim(dim, 0), 0, call).movedim(0, dim).contiguous()
        T, W = x.shape[0], self.world_size
        start, length = reference.share_bounds(T, W, self.rank)
        out = torch.empty((length, *x.shape[1:]), dtype=x.dtype, device=x.device)
        if x.numel() == 0:
            return out
        H = x.numel() // T
        plan = self.plan(op, x.numel() * x.element_size(), H, x.dtype)
        if plan.algorithm == "push" and dispatch.is_integer(x.dtype):
            out.copy_(self._integer_sum(op, x, call).view(x.shape)[start:start + length])
            return out
        if plan.algorithm == "push":
            # Narrow rows: every rank's input through the all-gather kernel, then the contract's
            # rank-order sum here (the same bits; and a peer making another call raises, as in a kernel).
            g = self._gather(op, x.reshape(-1), 0, call).view(self.world_size, -1)
            s = reference.reduce_in_rank_order(list(g.unbind(0))).view(x.shape)
            out.copy_(s[start:start + length])
            return out
        if plan.algorithm == "fallback":
            self._before_fallback(op, call + (str(x.dtype),))
            with _HOST_WRITES():
                out.copy_(reference.reduce_scatter_reference(x, self.group))
            return out
        xc = x.contiguous()  # addressed flat
        launched = [] if key is not None else None
        self._run(op, chunks.two_shot_launches(self.workspace, self.world_size, xc, out, None, None, None, T, H, 0.0,
                                               False, False, None, self._signer(op), scatter_only=True, call=call),
                  launched)
        if launched is not None:
            self._remember(key, launched, (x, out), call_cache.dim_spec(op, x, out))
        return out

    def _integer_sum(self, op: str, x: torch.Tensor, call: tuple) -> torch.Tensor:
        """Flat sum over the ranks of integer ``x``: every rank's input through the all-gather kernel
        (signed as ``op``'s ``call``), summed in int64 (exact; wraps modulo 2**64, then modulo the
        dtype's range like a native sum)."""
        g = self._gather(op, x.reshape(-1), 0, call)
        return g.view(self.world_size, -1).to(torch.int64).sum(0).to(x.dtype)

    @contextlib.contextmanager
    def use_algorithm(self, algorithm: str):
        """Force ``algorithm`` (``auto``, ``lamport``, ``one_shot``, ``two_shot`` or ``fallback``) for the
        calls inside the ``with`` block, as ``TPCOMM_ALGO`` does for a whole communicator. Every rank
        must force the same algorithm for the same calls (it is part of the call). For tests, tuning and
        benchmarks.

        Raises:
            ValueError: ``algorithm`` is not one of the choices.
        """
        from .env import ALGO_CHOICES

        if isinstance(algorithm, str):
            algorithm = algorithm.strip().lower()  # as TPCOMM_ALGO is read
        if algorithm not in ALGO_CHOICES:
            raise ValueError(f"use_algorithm: algorithm must be one of {ALGO_CHOICES}, got {algorithm!r}")
        before, self.algorithm = self.algorithm, algorithm
        try:
            yield self
        finally:
            self.algorithm = before

    # -- plans and launches -------------------------------------------------------------------------
    def plan(self, op: str, nbytes: int, hidden: int, dtype: torch.dtype) -> dispatch.Plan:
        """The :class:`~tpcomm.dispatch.Plan` a call of this shape takes (the same on every rank).

        ``hidden`` is the row width of ``fused_add_rmsnorm`` and ``reduce_scatter``; for
        ``all_reduce`` and ``all_gather`` it is ignored (the width is derived from ``nbytes``, see
        :func:`tpcomm.dispatch.all_reduce_width`). :func:`tpcomm.dispatch.plan_call` decides; plans are
        cached per shape.

        Raises:
            ValueError: ``op`` is not one of ``tpcomm.dispatch.OPS``, or ``nbytes`` or ``hidden`` is
                negative.
            TypeError: ``nbytes`` or ``hidden`` is not an int, or ``dtype`` not a ``torch.dtype``.
        """
        key = (op, nbytes, hidden, dtype, self.algorithm)
        plan = self._plans.get(key)
        if plan is None:
            _check_plan_args(op, nbytes, hidden, dtype)
            plan = self._plans[key] = self._make_plan(op, nbytes, hidden, dtype)
            if len(self._plans) > 4096:
                self._plans.pop(next(iter(self._plans)))
        return plan

    def _make_plan(self, op: str, nbytes: int, hidden: int, dtype: torch.dtype) -> dispatch.Plan:
        """:meth:`plan` without the cache."""
        return dispatch.plan_call(op, self.world_size, nbytes, hidden, dtype, self.algorithm, self.table,
                                  self.workspace)

    def _run_rows(self, op, plan, x, out, residual, residual_out, weight, n_rows, H, eps, norm, gemma,
                  quant=None, call=(), record=None):
        """Launch ``plan`` over ``n_rows`` rows of ``H`` (:func:`tpcomm.kernels.chunks.row_launches`).
        ``call`` is what tells the user's call apart beyond the flat sizes (its shape; with ``dim`` for
        gathers and scatters): part of every launch's signature. ``record``: a list that receives each
        launch (:meth:`_launch`)."""
        self._run(op, chunks.row_launches(plan.algorithm, self.workspace, self.world_size, x, out, residual,
                                          residual_out, weight, n_rows, H, eps, norm, gemma, quant,
                                          self._signer(op), call), record)

    def _run(self, op: str, launches, record=None) -> None:
        """Launch ``launches`` (KernelCalls) under :meth:`_launching`. A call of several launches (chunks)
        compiles and loads every launch's kernel before it launches the first: a chunk of other sizes is
        another specialisation, and loading a module while this rank's first chunk already waits for its
        peers can wait for that chunk (CUDA's lazy loading may synchronise the context), which holds back
        the launches a host thread issues for the other ranks after this one (loopback ranks) until the
        peer timeout (docs/reliability.md, "A call of several launches")."""
        with self._launching(op, record):
            launches = list(launches)
            if len(launches) > 1:
                for call in launches:
                    call.load()
            for call in launches:
                self._launch(call)

    def _before_fallback(self, op: str, call: tuple) -> None:
        """Before a call falls back to ``torch.distributed`` on a communicator that has kernels: one launch
        of the all-gather kernel over 8 bytes, signed with the call (``op``, ``call``), which every rank
        making the same call completes. A peer that made another call (a kernel call, or a fallback call
        of another shape) makes it fail on every rank, :class:`PeerMismatchError` or
        :class:`PeerTimeoutError`, before this rank's collective could pair with whatever that peer's
        process group runs next (which returned wrong values, or aborted a process inside gloo). On CUDA
        the stream is synchronised to read the outcome before the collective is issued; during a graph
        capture it cannot be, and a failure shows at the next call."""
        if self.workspace is None:
            return
        src = torch.zeros(8, dtype=torch.uint8, device=self.device)
        dst = torch.empty(8 * self.world_size, dtype=torch.uint8, device=self.device)
        self._run(op, chunks.gather_launches(self.workspace, src, dst, 8, "fallback", self._signer(op), call))
        if self._cuda and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).synchronize()
            self.check(op)

    def _signer(self, op: str):
        """``sign(*fields)``: :meth:`_sign` for ``op``."""
        return lambda *fields: self._sign(op, *fields)

    def _launch(self, call) -> None:
        """Launch ``call`` (a :class:`~tpcomm.kernels.launch.KernelCall`); while a call records
        (:meth:`_launching`), keep it and what Triton returned for :meth:`_remember`."""
        compiled = call.launch()
        if self._record is not None:
            self._record.append((call, compiled))

    def _remember(self, key, launched: list, tensors: tuple, spec) -> None:
        """Cache the launches ``launched`` of the call with ``key`` (:mod:`tpcomm.call_cache`), each tensor
        parameter a slot of ``tensors``; ``spec``: what a repeat does (:class:`~tpcomm.hit_code.HitSpec`).
        A call whose launches take other tensors is not cached."""
        with self._lock:
            ws = self.workspace
            if ws is None:  # closed meanwhile
                return
            replays = call_cache.record(launched, tensors, (ws.buf_table, ws.flag_table, ws.lamport_table,
                                                            ws.state, ws.err), self._direct,
                                        self.device.index)
            if replays is not None:
                self._calls.put(key, call_cache.CachedCall(replays, spec, tensors, self._lock, ws._err_words,
                                                           self._cuda, self.device.index))

    def _sign(self, op: str, *fields) -> int:
        """The signature of one launch of ``op`` (:func:`~tpcomm.kernels.sync.call_signature`), cached per
        call shape and remembered (4096 at most) so that an error recorded by a kernel names the op that
        failed."""
        key = (op,) + fields
        sig = self._sig_by_key.get(key)
        if sig is None:  # a new call shape: compute it once (a CRC of the fields' repr is a few µs)
            sig = self._sig_by_key[key] = call_signature(op, *fields)
            self._signatures[sig] = op
            for d in (self._sig_by_key, self._signatures):
                if len(d) > 4096:  # the oldest goes; a shape still in use comes back at its next call
                    d.pop(next(iter(d)))
        return sig

    @contextlib.contextmanager
    def _launching(self, op: str, record: list | None = None):
        """Around a call's launches: raise a recorded error first and after; one call at a time (a lock);
        on CUDA, order this call after the previous one when it was issued on another stream; while
        inside, :meth:`_launch` appends each launch to ``record`` (when given)."""
        with self._lock:
            self.check(op)
            if self._cuda:
                self._order_streams()
            self._record = record
            try:
                yield
            finally:
                self._record = None
            self.check(op)

    def _order_streams(self) -> int:
        """On CUDA: make the current stream wait for the previous call's when that call was issued on
        another stream (the two share the epoch and the buffers, so they must not run at the same time;
        work queued on the old stream so far includes that call). Not while capturing a graph. Returns
        the current stream's raw handle (what a direct launch takes); reading it is a fraction of a µs,
        against a few µs for ``torch.cuda.current_stream``, which is only asked when the stream changed."""
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        last = self._last_stream
        if last is None or last[0] != raw:
            stream = torch.cuda.current_stream(self.device)
            if last is not None and not torch.cuda.is_current_stream_capturing():
                stream.wait_stream(last[1])
            self._last_stream = (raw, stream)
        return raw

    # -- errors, life cycle -------------------------------------------------------------------------
    def check(self, op: str = "check") -> None:
        """Raise the error a kernel of this communicator recorded: :class:`PeerTimeoutError` for a peer
        that never arrived, :class:`PeerMismatchError` for one that made another call,
        :class:`PeerAbortedError` when a peer had given up on this rank's call before it ran, naming the
        op of the call that failed (``op`` when that call is no longer remembered).

        Cheap (no device synchronisation): on CUDA it reads pinned host memory, so an error shows at the
        first call (or ``check``) after the kernel that recorded it has run; synchronise first to be sure.
        """
        if self.workspace is None or not self.workspace.error_code():
            return
        code, peer, epoch, program, signature = self.workspace.read_error()
        failed = self._signatures.get(signature, op)  # the call that failed (graph replays included)
        error = {MISMATCH_CODE: PeerMismatchError, ABORTED_CODE: PeerAbortedError}.get(code, PeerTimeoutError)
        raise error(failed, self.rank, peer, epoch, program, self.timeout_s)

    def _check_open(self, op: str) -> None:
        """Raise for a closed communicator (RuntimeError) and for an error a kernel recorded (:meth:`check`):
        once a call failed, every later call raises, the empty and the fallback ones too."""
        if self._closed:
            raise RuntimeError(f"{op}: this Communicator is closed")
        if self.workspace is not None and self.workspace.error_code():
            try:
                self.check(op)
            except PeerTimeoutError as e:  # the same error, saying which call meets it now
                e.args = (f"{e.args[0]} (raised again by a later {op} call: a failed call leaves the "
                          "communicator unusable)",)
                raise

    @property
    def uses_kernels(self) -> bool:
        """True when calls run tpcomm's kernels; False when every call falls back to torch.distributed:
        no workspace (``fallback_reason`` says why), or ``fallback`` forced (``TPCOMM_ALGO``, or inside a
        ``use_algorithm("fallback")`` block; another block may still pick a kernel)."""
        return self.workspace is not None and self.algorithm != "fallback"

    def close(self) -> None:
        """Free the workspace. Idempotent. Call it on every rank after the last op has completed; a call
        still running in another thread finishes first (close waits for the lock every call holds)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._calls.clear()
            if self.workspace is not None:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.workspace.close()
                self.workspace = None

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`: every op then raises ``RuntimeError``."""
        return self._closed

    def __repr__(self) -> str:
        if self._closed:
            how = "closed"
        elif self.workspace is None:
            how = f"fallback ({self.fallback_reason})"
        elif self.algorithm == "fallback":
            how = "fallback (TPCOMM_ALGO=fallback, or use_algorithm)"
        else:
            how = "kernels" + ("" if self.algorithm == "auto" else f", algorithm forced to {self.algorithm}")
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, {how})"

