"""PyTorch symmetric memory (``torch.ops.symm_mem``), with the torch epilogue for fused ops.

    symm_one_shot    s = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)      then the epilogue
    symm_two_shot    torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)          (in place), then it
    symm_mem (AG)    torch.ops.symm_mem._low_contention_all_gather(buf, group)           (copy engine, pull)
    symm_mem (RS)    torch.ops.symm_mem.reduce_scatter_out(buf.view(-1), group, False, out.view(-1))

These ops read a symmetric buffer: the input set is copied into one before each call, outside the timed
region (what a caller gets by allocating its activations there). Multicast (``multimem_*``) stays off.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .base import Bound, Contender, NotApplicable, new_outputs, poison
from .torch_epilogue import epilogue


class SymmPool:
    """Symmetric buffers for the input sets of every case of the sweep (buffer ``k`` holds
    :func:`tpcomm.bench.config.set_capacity` bytes). Collective to make."""

    def __init__(self, cfg, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        from ..config import set_capacity

        self.group_name = dist.group.WORLD.group_name
        try:
            with warnings.catch_warnings():  # needed by older torch; deprecated (a no-op) since 2.9
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(self.group_name)
        except Exception:
            pass
        self.buffers, self.handles = [], []
        for k in range(cfg.graph_calls):
            b = symm_mem.empty(max(16, set_capacity(k, max_bytes, cfg)), dtype=torch.uint8, device="cuda")
            self.handles.append(symm_mem.rendezvous(b, self.group_name))
            self.buffers.append(b)

    def view(self, k: int, shape, dtype) -> torch.Tensor:
        """Buffer ``k`` as a ``shape`` tensor of ``dtype`` (storage offset 0)."""
        return view_as(self.buffers[k], shape, dtype)

    def peer_view(self, k: int, peer: int, shape, dtype) -> torch.Tensor:
        """Rank ``peer``'s buffer ``k`` mapped here, as a ``shape`` tensor of ``dtype``."""
        return self.handles[k].get_buffer(peer, tuple(shape), dtype, 0)


def view_as(buffer: torch.Tensor, shape, dtype) -> torch.Tensor:
    """The first bytes of a uint8 ``buffer`` as a ``shape`` tensor of ``dtype`` (storage offset 0)."""
    n = 1
    for s in shape:
        n *= s
    return buffer.view(dtype)[:n].view(shape)


def _ops():
    import torch.distributed._symmetric_memory  # noqa: F401  (registers the symm_mem ops)

    return torch.ops.symm_mem


class _SymmBase(Contender):
    library = "torch symm_mem"
    op_name = ""

    def setup(self, ctx) -> None:
        if not hasattr(_ops(), self.op_name):
            raise RuntimeError(f"torch.ops.symm_mem.{self.op_name} is not in torch {torch.__version__}")
        self.pool = ctx.symm_pool()

    def _inputs(self, case, slots):
        bufs = [self.pool.view(k, tuple(slots.x[k].shape), case.dtype) for k in range(len(slots.x))]
        return bufs, (lambda k: bufs[k].copy_(slots.x[k]))


class _SymmAllReduce(_SymmBase):
    """``torch.ops.symm_mem.<op_name>(buf, "sum", group)`` (its result: a new tensor, or ``buf`` in place),
    then the torch epilogue of the fused ops."""

    ops = ("fused", "fused_fp8", "all_reduce")

    def bind(self, case, slots, ctx) -> Bound:
        bufs, load = self._inputs(case, slots)
        op, g, res, w = getattr(_ops(), self.op_name), self.pool.group_name, slots.residual, slots.weight
        return Bound(call=lambda k: epilogue(case.op, op(bufs[k], "sum", g), res, w, case.eps),
                     outputs=lambda r: r, load=load)


class SymmOneShot(_SymmAllReduce):
    name = "symm_one_shot"
    label = "symm_mem one-shot"
    op_name = "one_shot_all_reduce"


class SymmTwoShot(_SymmAllReduce):
    name = "symm_two_shot"
    label = "symm_mem two-shot"
    op_name = "two_shot_all_reduce_"


class SymmAllGather(_SymmBase):
    """Copy-engine pull all-gather on a side stream (``_low_contention_all_gather``), joined back to the
    caller's stream so the result is ready when the call returns (and the graph capture closes)."""

    name = "symm_all_gather"
    label = "symm_mem (copy engine)"
    ops = ("all_gather",)
    op_name = "_low_contention_all_gather"

    def bind(self, case, slots, ctx) -> Bound:
        import torch.distributed._symmetric_memory as symm_mem

        bufs, load = self._inputs(case, slots)
        ops, g = _ops(), self.pool.group_name
        backend = symm_mem._get_backend_stream()

        wait = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)

        def call(k):
            y = ops._low_contention_all_gather(bufs[k], g)
            torch.cuda.current_stream().wait_stream(backend)
            if wait is not None:  # retires the Work the op registers (else torch warns at exit)
                y = wait(y)
            return y
        return Bound(call=call, outputs=lambda r: {"gathered": r}, load=load)


class SymmReduceScatter(_SymmBase):
    name = "symm_reduce_scatter"
    label = "symm_mem"
    ops = ("reduce_scatter",)
    op_name = "reduce_scatter_out"

    def bind(self, case, slots, ctx) -> Bound:
        if case.op != "reduce_scatter":
            raise NotApplicable(case.op)
        bufs, load = self._inputs(case, slots)
        outs = new_outputs(len(bufs), (case.share[1], case.H), case.dtype, case.device)
        ops, g = _ops(), self.pool.group_name

        def call(k):  # the op takes flat tensors: this rank's share of the rows is a contiguous chunk
            ops.reduce_scatter_out(bufs[k].view(-1), g, False, outs[k].view(-1))
            return outs[k]
        return Bound(call=call, outputs=lambda r: {"share": r}, load=load, poison=lambda: poison(outs),
                     keep=outs)
