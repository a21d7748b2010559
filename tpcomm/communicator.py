"""``Communicator``: the API, and the state every op shares.

It sets up the workspace (collective), keeps the group, the workspace, the plans, the failure state and
the call cache, and the helpers every op launches through (:meth:`~Communicator._run`,
:meth:`~Communicator._run_rows`, :meth:`~Communicator._remember`, :meth:`~Communicator._sign`,
:meth:`~Communicator._before_fallback`). Each op is one short method: a repeated call replays its
recorded launches (:mod:`tpcomm.call_cache`); a first call goes to the op's module in
:mod:`tpcomm.collectives`, which checks the arguments, makes the outputs, asks for the plan and launches
or falls back.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref

import torch
import torch.distributed as dist

from . import call_cache, dispatch
from .collectives import all_gather, all_reduce, fused_norm, moe_finalize, qk_norm, reduce_scatter
from .env import EnvConfig
from .errors import PeerAbortedError, PeerMismatchError, PeerTimeoutError
from .kernels import chunks
from .kernels.launch import direct_launch_supported
from .kernels.sync import ABORTED_CODE, MISMATCH_CODE, call_signature
from .quant import DEFAULT_GROUP_SIZE
from .setup import DEFAULT_MAX_BYTES_CPU, DEFAULT_MAX_BYTES_CUDA, SetUp  # noqa: F401  (names of this module)
from .workspace import Workspace

#: Every live Communicator by its ``handle`` (weak), for ``tpcomm.ops``: handles start at 1 and are never
#: reused, so a compiled graph that outlives its communicator raises instead of using another one.
_BY_HANDLE: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)


class Communicator(SetUp):
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
        timeout_s: seconds a kernel waits for a peer before giving up (default ``TPCOMM_TIMEOUT_S`` or 30),
            and this constructor for the other ranks to create theirs (:class:`~tpcomm.SetupTimeoutError`).

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
        SetupTimeoutError: a rank of the group did not create its communicator within ``timeout_s`` of
            this rank (every rank that created one raises it, naming the missing ranks).
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
        why = None if error is None else f"{type(error).__name__}: {str(error).removeprefix('Communicator: ')}"
        # bounded by timeout_s (the default where this rank's own settings were refused before it was read)
        errors = self._arrive(why, getattr(self, "timeout_s", None) or EnvConfig().timeout_s)
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

    # -- ops: each hands a first call to its module (tpcomm.collectives), a repeat to its recorded code ---
    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum ``x`` over the ranks of the group: ``torch.distributed.all_reduce(x.clone())`` with the
        numerics contract (float32 in rank order, the same bits on every rank and algorithm). Collective.

        Args, Returns, Raises: :func:`tpcomm.collectives.all_reduce.all_reduce` (``x`` any shape, bf16 /
        fp16 / fp32 or an integer dtype; ``out`` optional, may be ``x``; returns ``out`` or a new tensor).
        """
        key = call_cache.all_reduce_key(x, out, self.algorithm)
        try:
            entry = self._calls.lookup(key)
        except TypeError:  # an unhashable argument (e.g. a list for a scalar): the full path names it
            entry = None
        if entry is not None and not self._closed:
            y = entry.hit(self, x, out)
            if y is not None:
                return y
        return all_reduce.all_reduce(self, x, out, key)

    def fused_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                          eps: float = 1e-6, gemma: bool = False, quant: str | None = None,
                          fp8_dtype: torch.dtype = torch.float8_e4m3fn, group_size: int = DEFAULT_GROUP_SIZE,
                          column_major_scales: bool = False, emit_unquantized: bool = False, *,
                          scale: torch.Tensor | None = None, swizzled_scales: bool = False,
                          out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                          q_out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None):
        """All-reduce ``x`` (``(T, H)``), add ``residual``, RMSNorm, and optionally quantise, in one kernel:
        ``residual_out = all_reduce(x) + residual; out = rms_norm(residual_out, weight, eps)``. Collective.

        Args, Returns, Raises: :func:`tpcomm.collectives.fused_norm.fused_add_rmsnorm` (returns ``(out,
        residual_out)``, or ``(q, scales, residual_out, out)`` with ``quant``; forms: docs/api.md).
        """
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
        return fused_norm.fused_add_rmsnorm(
            self, x, residual, weight, eps, gemma, quant, fp8_dtype, group_size, column_major_scales,
            emit_unquantized, scale=scale, swizzled_scales=swizzled_scales, out=out, residual_out=residual_out,
            q_out=q_out, scales_out=scales_out, key=key)

    def fused_qk_rmsnorm(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         eps: float = 1e-6, *, q_out: torch.Tensor | None = None,
                         k_out: torch.Tensor | None = None, kv_replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of this rank's query and key columns ``q`` ``(T, Nq / W)`` and ``k`` ``(T, Nk / W)`` over
        their full width (every rank's columns: MiniMax-M2's ``q_norm`` / ``k_norm``), in one kernel: the
        per-token sums of squares summed over the ranks in rank order in float32, so every rank scales a
        token by the same bits. Plain torch: ``rms_norm(q_full, w_q, eps)[:, this rank's columns]``.
        ``kv_replicas``: each group of that many consecutive ranks holds the same ``k`` columns (more
        ranks than key-value heads); ``k``'s mean of squares counts each distinct column once.
        Arguments, returns and raises: :func:`tpcomm.collectives.qk_norm.fused_qk_rmsnorm`."""
        key = call_cache.qk_key(q, k, q_weight, k_weight, eps, q_out, k_out, self.algorithm, kv_replicas)
        try:
            entry = self._calls.lookup(key)
        except TypeError:  # an unhashable argument (e.g. a list for eps): the full path names it
            entry = None
        if entry is not None and not self._closed:
            outs = entry.hit(self, q, k, q_weight, k_weight, q_out, k_out)
            if outs is not None:
                return outs
        return qk_norm.fused_qk_rmsnorm(self, q, k, q_weight, k_weight, eps, q_out=q_out, k_out=k_out,
                                        kv_replicas=kv_replicas, key=key)

    def fused_moe_finalize_add_rmsnorm(self, expert_out: torch.Tensor, topk_weights: torch.Tensor,
                                       residual: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6, *,
                                       index: torch.Tensor | None = None, shared_out: torch.Tensor | None = None,
                                       scaling: float = 1.0, gemma: bool = False, quant: str | None = None,
                                       **quant_and_outputs):
        """MoE finalize, all-reduce, residual add, RMSNorm: in one launch where the fused norm has one.
        Plain torch: ``x = tpcomm.moe_finalize(expert_out, topk_weights, index=index, shared_out=shared_out,
        scaling=scaling)``, then ``self.fused_add_rmsnorm(x, residual, weight, eps, gemma, quant, ...)``,
        whose bits it gives (docs/numerics.md, "MoE finalize"). Collective.

        Args, Returns, Raises: :func:`tpcomm.collectives.moe_finalize.fused_moe_finalize_add_rmsnorm`
        (``expert_out`` ``(T, K, H)``, or ``(M, H)`` with ``index`` ``(T, K)``; ``topk_weights`` ``(T,
        K)``; ``quant_and_outputs``: the quant arguments and given outputs of :meth:`fused_add_rmsnorm`;
        returns what :meth:`fused_add_rmsnorm` returns).
        """
        return moe_finalize.fused_moe_finalize_add_rmsnorm(
            self, expert_out, topk_weights, residual, weight, eps, index=index, shared_out=shared_out,
            scaling=scaling, gemma=gemma, quant=quant, **quant_and_outputs)

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order (``torch.cat`` of
        ``torch.distributed.all_gather``; any dtype, bit for bit). Collective.

        Args, Returns, Raises: :func:`tpcomm.collectives.all_gather.all_gather`.
        """
        key = call_cache.dim_key("all_gather", x, dim, self.algorithm)
        try:
            entry = self._calls.lookup(key)
        except TypeError:  # an unhashable argument (e.g. a list for a scalar): the full path names it
            entry = None
        if entry is not None and not self._closed:
            y = entry.hit(self, x)
            if y is not None:
                return y
        return all_gather.all_gather(self, x, dim, key)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum ``x`` over the ranks and return this rank's share along ``dim``
        (``torch.tensor_split(all_reduce(x), world_size, dim)[rank]``, the all-reduce's bits). Collective.

        Args, Returns, Raises: :func:`tpcomm.collectives.reduce_scatter.reduce_scatter`.
        """
        key = call_cache.dim_key("reduce_scatter", x, dim, self.algorithm)
        try:
            entry = self._calls.lookup(key)
        except TypeError:  # an unhashable argument (e.g. a list for a scalar): the full path names it
            entry = None
        if entry is not None and not self._closed:
            y = entry.hit(self, x)
            if y is not None:
                return y
        return reduce_scatter.reduce_scatter(self, x, dim, key)

    def use_algorithm(self, algorithm: str):
        """Force ``algorithm`` (``auto``, ``lamport``, ``one_shot``, ``two_shot`` or ``fallback``) for the
        calls inside a ``with`` block (``with comm.use_algorithm("two_shot"): ...``), as ``TPCOMM_ALGO``
        does for a whole communicator. Every rank must force the same algorithm for the same calls (it is
        part of the call). For tests, tuning and benchmarks.

        The name is checked here, at the call; the returned context manager forces it while its block runs
        (a call outside a ``with`` forces nothing).

        Raises:
            ValueError: ``algorithm`` is not one of the choices.
        """
        from .env import ALGO_CHOICES

        name = algorithm.strip().lower() if isinstance(algorithm, str) else algorithm  # as TPCOMM_ALGO is read
        if name not in ALGO_CHOICES:
            raise ValueError(f"use_algorithm: algorithm must be one of {ALGO_CHOICES}, got {algorithm!r}")
        return self._forcing(name)

    @contextlib.contextmanager
    def _forcing(self, algorithm: str):
        """:meth:`use_algorithm`'s block: ``algorithm`` (checked) in force, the previous one restored after."""
        before, self.algorithm = self.algorithm, algorithm
        try:
            yield self
        finally:
            self.algorithm = before

    # -- plans and launches -------------------------------------------------------------------------
    def plan(self, op: str, nbytes: int, hidden: int, dtype: torch.dtype) -> dispatch.Plan:
        """The :class:`~tpcomm.dispatch.Plan` a call of this shape takes (the same on every rank), without
        making the call: ``plan.algorithm`` and ``plan.reason`` (the message's size, the thresholds it fell
        between and their source).

        ``nbytes`` is one rank's message; ``hidden`` the row width of ``fused_add_rmsnorm``,
        ``fused_moe_finalize_add_rmsnorm`` (its ``(T, H)`` output) and ``reduce_scatter``. For
        ``all_reduce`` and ``all_gather`` ``hidden`` is ignored (the width is derived from ``nbytes``).
        For ``fused_qk_rmsnorm``, ``nbytes`` is ``q`` and ``k`` together and ``hidden`` is ``Hq + Hk``.
        The MoE finalize takes the fused norm's plan; the QK norm has one kernel, or the fallback.
        :func:`tpcomm.dispatch.plan_call` decides; plans are cached per shape.

        Raises:
            ValueError: ``op`` is not one of ``tpcomm.dispatch.PLANNED_OPS``, or ``nbytes`` or ``hidden``
                is negative.
            TypeError: ``nbytes`` or ``hidden`` is not an int, or ``dtype`` not a ``torch.dtype``.
        """
        key = (op, nbytes, hidden, dtype, self.algorithm)
        plan = self._plans.get(key)
        if plan is None:
            dispatch.check_plan_args(op, nbytes, hidden, dtype)
            plan = self._plans[key] = self._make_plan(op, nbytes, hidden, dtype)
            if len(self._plans) > 4096:
                self._plans.pop(next(iter(self._plans)))
        return plan

    def _make_plan(self, op: str, nbytes: int, hidden: int, dtype: torch.dtype) -> dispatch.Plan:
        """:meth:`plan` without the cache."""
        return dispatch.plan_call(op, self.world_size, nbytes, hidden, dtype, self.algorithm, self.table,
                                  self.workspace)

    def _run_rows(self, op, plan, x, out, residual, residual_out, weight, n_rows, H, eps, norm, gemma,
                  quant=None, call=(), record=None, moe=None):
        """Launch ``plan`` over ``n_rows`` rows of ``H`` (:func:`tpcomm.kernels.chunks.row_launches`).
        ``call`` is what tells the user's call apart beyond the flat sizes (its shape; with ``dim`` for
        gathers and scatters): part of every launch's signature. ``record``: a list that receives each
        launch (:meth:`_launch`). ``moe``: the MoE finalize that makes the rows in the kernels' prologue
        (:attr:`tpcomm.dispatch.Plan.prologue`)."""
        self._run(op, chunks.row_launches(plan.algorithm, self.workspace, self.world_size, x, out, residual,
                                          residual_out, weight, n_rows, H, eps, norm, gemma, quant,
                                          self._signer(op), call, moe=moe), record)

    def _run(self, op: str, launches, record=None) -> None:
        """Launch ``launches`` (KernelCalls) under :meth:`_launching`. A call of several launches (chunks)
        compiles and loads every launch's kernel before it launches the first: a chunk of other sizes is
        another specialisation, and loading a module while this rank's first chunk already waits for its
        peers can wait for that chunk (CUDA's lazy loading may synchronise the context), which holds back
        the launches a host thread issues for the other ranks after this one (loopback ranks) until the
        peer timeout (docs/design.md, "A call of several launches")."""
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
        elif self.workspace is not None and self.workspace.error_code():
            how = "failed: every call raises the recorded error (check()); create a new communicator"
        elif self.workspace is None:
            how = f"fallback ({self.fallback_reason})"
        elif self.algorithm == "fallback":
            how = "fallback (TPCOMM_ALGO=fallback, or use_algorithm)"
        else:
            how = "kernels" + ("" if self.algorithm == "auto" else f", algorithm forced to {self.algorithm}")
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, {how})"

