"""``Communicator``: the API. Validates inputs, picks a plan, launches, falls back."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from . import dispatch, reference
from .env import interpreter_enabled, read_env
from .errors import PeerTimeoutError
from .workspace import Workspace

#: Default bytes one launch can carry per rank. 32 MiB on CUDA keeps a 4096 x 4096 bf16 call in one
#: launch; 1 MiB under the CPU interpreter, whose calls are small. Larger messages run in chunks.
DEFAULT_MAX_BYTES_CUDA = 32 << 20
DEFAULT_MAX_BYTES_CPU = 1 << 20
#: Kernels index a launch's elements with int32: one launch stays under 2**31 elements.
MAX_MAX_BYTES = 1 << 30


class Communicator:
    """Tensor-parallel collectives for one process group, on the GPUs of one node or on CPU ranks.

    Collective: every rank of ``group`` constructs it, and calls every op in the same order with the same
    shapes, dtypes and arguments (as with ``torch.distributed``).

    Plain-torch equivalent::

        comm.all_reduce(x)                        == torch.distributed.all_reduce(x.clone())
        comm.fused_add_rmsnorm(x, r, w, eps)      == rms_norm(all_reduce(x) + r, w, eps), all_reduce(x) + r

    but with the numerics contract of DESIGN.md: float32 accumulation in rank order, identical bits on
    every rank, for every algorithm and number of rows.

    Args:
        group: a ``torch.distributed`` process group (default: the world). An NCCL group runs the CUDA
            kernels on the current CUDA device; a gloo group runs the same kernels under Triton's CPU
            interpreter (``TRITON_INTERPRET=1`` must be set before tpcomm is imported).
        max_bytes: bytes of one rank's message that one launch carries (default 32 MiB on CUDA, 1 MiB on
            CPU). Larger messages run in chunks of whole rows through the same kernels: no size limit.
        timeout_s: seconds a kernel waits for a peer before giving up (default ``TPCOMM_TIMEOUT_S`` or 30).

    Falls back to ``torch.distributed`` (on every rank together) when the group spans hosts, the
    workspace cannot be mapped, or the world size is 1; per call for dtypes without a kernel.

    Safe in CUDA graphs: the workspace is armed here, epochs live in device memory and advance inside
    the kernels, and no call depends on a host value that changes.

    Raises:
        ValueError: ``max_bytes`` or ``timeout_s`` is out of range, or ``max_bytes`` differs between ranks.
    """

    def __init__(self, group=None, max_bytes: int | None = None, timeout_s: float | None = None):
        if not dist.is_initialized():
            raise RuntimeError("Communicator: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first (or use tpcomm.launch)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.env = read_env()
        backend = str(dist.get_backend(self.group))
        if "nccl" in backend and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if max_bytes is None:
            max_bytes = DEFAULT_MAX_BYTES_CUDA if self.device.type == "cuda" else DEFAULT_MAX_BYTES_CPU
        if not 0 < max_bytes <= MAX_MAX_BYTES:
            raise ValueError(f"Communicator: max_bytes must be in (0, {MAX_MAX_BYTES}], got {max_bytes}")
        self.timeout_s = self.env.timeout_s if timeout_s is None else float(timeout_s)
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"Communicator: timeout_s must be positive and finite, got {timeout_s}")
        self.max_bytes = max_bytes
        self.workspace: Workspace | None = None
        self.fallback_reason = self._set_up()
        self._closed = False

    # -- set-up -------------------------------------------------------------------------------------
    def _set_up(self) -> str | None:
        """Create the workspace if every rank can; returns why not (None when it exists). Collective."""
        info = (socket.gethostname(), self._local_programs(), self.max_bytes)
        infos: list = [None] * self.world_size
        dist.all_gather_object(infos, info, group=self.group)
        if len({m for _, _, m in infos}) > 1:
            raise ValueError(f"Communicator: max_bytes differs between ranks ({[m for _, _, m in infos]}); "
                             "every rank must pass the same value")
        reason = None
        if self.world_size < 2:
            reason = "a group of one rank needs no communication"
        elif len({h for h, _, _ in infos}) > 1:
            reason = "the group spans several hosts"
        elif self.device.type == "cpu" and not interpreter_enabled():
            reason = "CPU ranks need TRITON_INTERPRET=1 set before tpcomm is imported"
        if reason is not None:
            return reason
        max_programs = min(p for _, p, _ in infos)
        error = None
        try:
            ws = Workspace(self.group, self.device, self.max_bytes, max_programs, self.timeout_s,
                           lamport_slot_bytes=min(self.max_bytes, dispatch.LAMPORT_MAX_BYTES))
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
            # Two programs per SM: on 2 H200s the one-shot fused call at 4096 x 6144 bf16 took 228 us with
            # 264 programs against 252 us with 132 (docs/data/dev_fused_2xH200_run2.log).
            return 2 * torch.cuda.get_device_properties(self.device).multi_processor_count
        return 4

    # -- public ops ---------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum ``x`` over the ranks of the group.

        Collective: every rank calls it with the same shape and dtype.

        Args:
            x: any shape, bf16 / fp16 / fp32 (kernels) or an integer dtype (``torch.distributed``), on
                this communicator's device. Non-contiguous inputs are copied first.
            out: optional output of ``x``'s shape, dtype and device; may be ``x`` itself (in place).
        Returns:
            ``out`` (or a new tensor): ``T(+0.0 + f32(x_0) + ... + f32(x_{W-1}))``, the same bits on
            every rank. Safe in CUDA graphs.
        Raises:
            TypeError: ``x`` is not a tensor, or its dtype has no sum (bool, FP8, complex).
            ValueError: ``x`` or ``out`` is on another device, or ``out`` does not match ``x``.
            PeerTimeoutError: a peer did not arrive within the timeout (this or an earlier call).
        """
        op = "all_reduce"
        self._check_open(op)
        self._check_tensor(op, "x", x)
        if x.dtype not in dispatch.KERNEL_DTYPES and (x.is_floating_point() or x.is_complex()
                                                      or x.dtype == torch.bool):
            raise TypeError(f"{op}: x has dtype {x.dtype}; expected bfloat16, float16, float32 or an "
                            "integer dtype")
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        else:
            self._check_tensor(op, "out", out)
            if out.shape != x.shape or out.dtype != x.dtype:
                raise ValueError(f"{op}: out has shape {tuple(out.shape)} and dtype {out.dtype} but x has "
                                 f"{tuple(x.shape)} and {x.dtype}")
        if x.numel() == 0:
            return out
        n = x.numel()
        width = self._all_reduce_width(n, x.element_size())
        plan = self.plan(op, n * x.element_size(), n, x.dtype)
        if plan.algorithm == "fallback":
            out.copy_(reference.all_reduce_reference(x, self.group))
            return out
        src = x.contiguous().view(-1)
        dst = out.view(-1) if out.is_contiguous() else torch.empty(n, dtype=x.dtype, device=x.device)
        self._run_rows(op, plan, src, dst, None, None, None, -(-n // width), width, 0.0, norm=False,
                       gemma=False)
        if dst.data_ptr() != out.data_ptr():
            out.copy_(dst.view(out.shape))
        return out

    def fused_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                          eps: float = 1e-6, gemma: bool = False):
        """All-reduce ``x``, add ``residual``, RMSNorm — in one kernel.

        Plain torch: ``s = all_reduce(x); residual_out = s + residual;
        out = residual_out * rsqrt(mean(residual_out^2) + eps) * w`` (``w`` replaced by ``1 + w`` when
        ``gemma``), with the numerics contract of DESIGN.md.

        Collective: every rank calls it with the same shapes, dtypes, ``eps`` and ``gemma``.

        Args:
            x: ``(T, H)`` (or ``(..., H)``: leading dims are flattened), bf16 / fp16 / fp32, this device.
            residual: like ``x`` (same shape and dtype), or None for the no-residual form.
            weight: ``(H,)`` norm weight, float dtype (the input's or float32).
            eps: >= 0, added to the mean square.
            gemma: use ``1 + w`` (Gemma-style norms).
        Returns:
            ``(out, residual_out)``: new tensors shaped like ``x``; ``residual_out`` is None without a
            residual. Identical bits on every rank. Safe in CUDA graphs. Messages larger than
            ``max_bytes`` run in chunks of rows.
        Raises:
            TypeError: a tensor argument is not a tensor or has an unsupported dtype.
            ValueError: shapes disagree (x vs residual vs weight), a tensor is on another device, or
                ``eps`` is negative or not finite (TypeError if it is not a number).
            PeerTimeoutError: a peer did not arrive within the timeout (this or an earlier call).
        """
        op = "fused_add_rmsnorm"
        self._check_open(op)
        self._check_tensor(op, "x", x)
        if x.dtype not in dispatch.KERNEL_DTYPES:
            raise TypeError(f"{op}: x has dtype {x.dtype}; expected bfloat16, float16 or float32")
        if x.dim() < 1:
            raise ValueError(f"{op}: x must have at least one dimension (..., H), got a scalar")
        H = x.shape[-1]
        if residual is not None:
            self._check_tensor(op, "residual", residual)
            if residual.shape != x.shape:
                raise ValueError(f"{op}: residual has shape {tuple(residual.shape)} but x has "
                                 f"{tuple(x.shape)}")
            if residual.dtype != x.dtype:
                raise TypeError(f"{op}: residual has dtype {residual.dtype} but x has {x.dtype}")
        self._check_tensor(op, "weight", weight)
        if weight.shape != (H,):
            raise ValueError(f"{op}: weight has shape {tuple(weight.shape)}; expected ({H},) to match "
                             f"x's last dimension")
        if not weight.is_floating_point():
            raise TypeError(f"{op}: weight has dtype {weight.dtype}; expected a float dtype")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"{op}: eps must be a float, got {type(eps).__name__}")
        eps = float(eps)
        if not (eps >= 0.0 and eps != float("inf")):
            raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        residual_out = torch.empty_like(out) if residual is not None else None
        if x.numel() == 0:
            return out, residual_out
        if H == 0:
            return out, residual_out
        T = x.numel() // H
        plan = self.plan(op, x.numel() * x.element_size(), H, x.dtype)
        if plan.algorithm == "fallback":
            o, ro = reference.fused_add_rmsnorm_reference(x, residual, weight, eps, gemma, self.group)
            out.copy_(o)
            if residual_out is not None:
                residual_out.copy_(ro)
            return out, residual_out
        self._run_rows(op, plan, x.contiguous().view(-1), out.view(-1),
                       residual.contiguous().view(-1) if residual is not None else None,
                       residual_out.view(-1) if residual_out is not None else None,
                       weight.contiguous(), T, H, eps, norm=True, gemma=gemma)
        return out, residual_out

    # -- plans and launches -------------------------------------------------------------------------
    def _all_reduce_width(self, n: int, element_size: int) -> int:
        """Row width of a plain all-reduce of ``n`` elements: ``ALL_REDUCE_ROW``, or less so that one
        row fits a slot of a small workspace (then the call runs in chunks instead of falling back)."""
        width = max(1, min(n, dispatch.ALL_REDUCE_ROW))
        if self.workspace is not None:
            width = min(width, max(16, self.workspace.slot_elems(element_size) // 16 * 16))
        return width

    def plan(self, op: str, nbytes: int, hidden: int, dtype: torch.dtype) -> dispatch.Plan:
        """The :class:`~tpcomm.dispatch.Plan` a call of this shape takes (the same on every rank).

        ``hidden`` is the row width of ``fused_add_rmsnorm``; for ``all_reduce`` it is ignored (the
        width is derived from ``nbytes``, see ``_all_reduce_width``).
        """
        if op == "all_reduce":
            hidden = self._all_reduce_width(nbytes // _elsize(dtype), _elsize(dtype))
        plan = dispatch.choose(op, self.world_size, nbytes, hidden, dtype, self.env.algo,
                               kernels_available=self.workspace is not None)
        if plan.algorithm != "fallback" and self.workspace.rows_per_launch(hidden, _elsize(dtype)) < 1:
            return dispatch.Plan("fallback", f"a row of {hidden} elements exceeds max_bytes")
        return plan

    def _run_rows(self, op, plan, x, out, residual, residual_out, weight, n_rows, H, eps, norm, gemma):
        from .kernels.lamport import lamport
        from .kernels.one_shot import one_shot

        ws = self.workspace
        self.check(op)
        cfg = dispatch.row_config(H, ws.max_programs)
        if plan.algorithm == "lamport" and ws.lamport_rows_per_launch(H, x.element_size()) >= 1:
            launch_rows, per_launch = lamport, ws.lamport_rows_per_launch(H, x.element_size())
        else:
            launch_rows, per_launch = one_shot, ws.rows_per_launch(H, x.element_size())
        numel = x.numel()
        for r0 in range(0, n_rows, per_launch):
            r1 = min(n_rows, r0 + per_launch)
            a, b = r0 * H, min(numel, r1 * H)
            launch_rows(x[a:b], out[a:b],
                     residual[a:b] if residual is not None else None,
                     residual_out[a:b] if residual_out is not None else None,
                     weight, ws, r1 - r0, H, eps, cfg, norm, gemma)
        self.check(op)

    # -- errors, life cycle -------------------------------------------------------------------------
    def check(self, op: str = "check") -> None:
        """Raise :class:`PeerTimeoutError` if a kernel of this communicator recorded a timeout.

        Cheap (no device synchronisation): on CUDA it reads pinned host memory, so a timeout shows at the
        first call (or ``check``) after the kernel that expired has run; synchronise first to be sure.
        """
        if self.workspace is None:
            return
        code, peer, epoch, program = self.workspace.read_error()
        if code:
            raise PeerTimeoutError(op, self.rank, peer, epoch, program, self.timeout_s)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"{op}: this Communicator is closed")

    def _check_tensor(self, op: str, name: str, t) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise ValueError(f"{op}: {name} is on {t.device} but this communicator runs on {self.device}")

    @property
    def uses_kernels(self) -> bool:
        """True when calls run tpcomm's kernels (False: every call falls back to torch.distributed)."""
        return self.workspace is not None

    def close(self) -> None:
        """Free the workspace. Idempotent. Call it on every rank after the last op has completed."""
        if self._closed:
            return
        self._closed = True
        if self.workspace is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.workspace.close()
            self.workspace = None

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        how = "kernels" if self.uses_kernels else f"fallback ({self.fallback_reason})"
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, {how})"


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
