"""Several ranks in one process on one GPU: tpcomm's kernels and protocol without a second GPU.

Problem: a machine with one GPU cannot run tpcomm's kernels the usual way (one process per GPU, an NCCL
group). Here every rank is a :class:`~tpcomm.Communicator` of the same process on the same GPU: each
rank's workspace is a plain device allocation, every rank's peer tables hold all of their addresses (in
rank order, as ``torch.distributed._symmetric_memory`` gives them on several GPUs), and rank ``r``'s
kernels are issued on its own stream, so the ranks' kernels run side by side as they would on separate
GPUs. The flags, the Lamport buffers, the waits and the bits of every output are the real ones; the
peers' stores land in the same GPU's memory instead of crossing NVLink, so timings show the kernels'
own costs, not a multi-GPU machine's.

For tests and kernel experiments on a one-GPU machine (``tests/collectives/test_gpu_loopback.py``,
``dev/dev_loopback.py``); not for models.

Limits:
  * The ranks' programs must be resident together, since a program that waits for a peer holds its SM
    until the peer's same program has run. A kernel's programs take up to one SM each (16 warps at 128
    registers fill an H200 SM's register file) and no launch has more programs than the grid cap
    (two-shot, which may run twice the cap on several GPUs, ``dispatch.row_config``, runs the cap here).
    With programmatic dependent launch a rank's next kernel takes SMs only once every rank's programs
    of the current call have started (``kernels/sync.release_next``), so ``max_programs`` defaults to
    the SM count over ``world_size``.
  * Every rank must run the same kernel binaries: a rank whose launch loaded a new CUDA module while a
    peer's kernel was spinning would wait for that kernel to end (module loading waits for the GPU),
    and that kernel waits for it. So the kernels never specialise on ``rank`` (``do_not_specialize``),
    and nothing else a launch passes differs between ranks (give every rank inputs of the same 16-byte
    alignment: Triton specialises on it). A call of several chunks loads every chunk's kernel before
    its first launch, for the same reason (docs/design.md, "A call of several launches").
  * No process group: a call whose plan is the ``torch.distributed`` fallback raises ``RuntimeError``.
  * Issue every rank's part of a collective before the next collective, and before waiting for any of
    it (:func:`run_ranks`): a rank's kernel spins on the GPU until its peers' kernels run.
  * A rank must not make a call whose kernel is not loaded yet while its previous call still waits for
    its peers (say a fused call, then an all-reduce of another size, in one :func:`run_ranks` function):
    loading the new module waits for the GPU's running kernels, among them this rank's own, which waits
    for peers this thread has not issued yet, and the calls end in ``PeerTimeoutError``. Make every
    call of a new shape, dtype or op once on every rank first, one call per :func:`run_ranks` (or
    capture them into a CUDA graph: nothing runs while a capture loads them); after that a rank may run
    ahead of its peers by several calls. The timeout errors of a loopback rank say so (:data:`LOAD_HINT`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import dispatch
from .communicator import DEFAULT_MAX_BYTES_CUDA, Communicator
from .env import read_env
from .errors import PeerMismatchError, PeerTimeoutError
from .validate import checked_limits
from .workspace import Workspace, pdl_supported

#: Appended to a loopback rank's timeout errors: how a loopback program with no missing peer times out.
LOAD_HINT = ("On loopback ranks this also happens when a rank makes a call whose kernel is not loaded yet "
             "while its previous call waits for peers that the same thread has not issued: make each new "
             "call once on every rank first, one call per run_ranks (tpcomm.loopback).")


class LoopbackRank(Communicator):
    """One rank of a loopback group (:func:`loopback_group`): a Communicator whose peers are other
    communicators of this process on the same GPU. Its kernels run on :attr:`stream` (use
    :func:`run_ranks`, or ``torch.cuda.stream(rank.stream)``). Ops and arguments as
    :class:`~tpcomm.Communicator`; what a real group would send to ``torch.distributed`` raises
    ``RuntimeError`` instead. ``TPCOMM_ALGO``, ``TPCOMM_DISPATCH_TABLE`` and ``TPCOMM_PDL`` apply; the
    timeout and the grid cap are :func:`loopback_group`'s arguments (``TPCOMM_TIMEOUT_S`` and
    ``TPCOMM_MAX_PROGRAMS`` are checked, as every ``TPCOMM_*`` variable, but not used)."""

    def __init__(self, rank: int, world_size: int, workspace: Workspace, max_bytes: int):
        self.group = None
        self.rank = rank
        self.world_size = world_size
        self.env = read_env()
        self.device = workspace.device
        self.max_bytes = max_bytes
        self.timeout_s = workspace.timeout_s
        self.algorithm = self.env.algo
        self._init_calls()
        self.table = dispatch.load_table(self.env.table) if self.env.table else dispatch.DEFAULT_TABLE
        self.workspace = workspace
        self.fallback_reason = None
        self.stream = torch.cuda.Stream(self.device)
        self._register()

    def check(self, op: str = "check") -> None:
        """As :meth:`Communicator.check`; a :class:`~tpcomm.PeerTimeoutError` (not a mismatch) also says
        how a loopback program times out without a missing peer (:data:`LOAD_HINT`)."""
        try:
            super().check(op)
        except PeerMismatchError:
            raise
        except PeerTimeoutError as e:
            if LOAD_HINT not in e.args[0]:
                e.args = (f"{e.args[0]} {LOAD_HINT}",)
            raise

    def _make_plan(self, op: str, nbytes: int, hidden: int, dtype: torch.dtype) -> dispatch.Plan:
        plan = super()._make_plan(op, nbytes, hidden, dtype)
        if plan.algorithm == "fallback":
            raise RuntimeError(f"{op}: a loopback group has no torch.distributed fallback, and this call "
                               f"would take it ({plan.reason})")
        return plan


def loopback_group(world_size: int, device: torch.device | str | None = None,
                   max_bytes: int = DEFAULT_MAX_BYTES_CUDA, timeout_s: float = 10.0,
                   max_programs: int | None = None, pdl: bool | None = None) -> list[LoopbackRank]:
    """``world_size`` ranks on one GPU, in rank order.

    Args:
        world_size: ranks (>= 2).
        device: the GPU (default: the current CUDA device).
        max_bytes: bytes one launch carries per rank (the Communicator's ``max_bytes``).
        timeout_s: seconds a kernel waits for a peer.
        max_programs: grid cap; default ``SMs // world_size``, so every rank's programs of one call fit
            the GPU at once (module docstring).
        pdl: programmatic dependent launch; default: on where ``TPCOMM_PDL`` and the GPU allow it.
    Returns:
        ``world_size`` :class:`LoopbackRank`; close them with :func:`close_group` when done.
    Raises:
        TypeError / ValueError: an argument out of range (``world_size`` < 2, ``max_programs`` < 1,
            ``max_bytes`` or ``timeout_s`` as for :class:`~tpcomm.Communicator`, a device that is not a
            CUDA device, ``pdl=True`` on a GPU without programmatic dependent launch).
        RuntimeError: CUDA is not available.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"loopback_group: world_size must be an int >= 2, got {world_size!r}")
    max_bytes, timeout_s = checked_limits("loopback_group", max_bytes, timeout_s)
    if not torch.cuda.is_available():
        raise RuntimeError("loopback_group: needs a CUDA GPU (the CPU interpreter runs one kernel at a time)")
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        raise ValueError(f"loopback_group: device must be a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if pdl is None:
        pdl = read_env().pdl and pdl_supported(device)
    elif pdl and not pdl_supported(device):
        raise ValueError(f"loopback_group: pdl=True, but {device} cannot launch with programmatic dependent "
                         "launch (needs compute capability 9.0+ and compiled kernels)")
    if max_programs is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        max_programs = max(1, sms // world_size)
    if isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1:
        raise ValueError(f"loopback_group: max_programs must be an int >= 1, got {max_programs!r}")
    workspaces = Workspace.loopback(world_size, device, max_bytes, max_programs, timeout_s,
                                    min(max_bytes, dispatch.LAMPORT_MAX_BYTES), pdl)
    torch.cuda.synchronize(device)
    return [LoopbackRank(r, world_size, ws, max_bytes) for r, ws in enumerate(workspaces)]


def run_ranks(ranks: list[LoopbackRank], fn: Callable[[LoopbackRank], Any]) -> list:
    """Issue ``fn(rank)`` for every rank on that rank's stream, after the work already on the current
    stream (and inside a CUDA graph capture, into the graph); the current stream then waits for every
    rank. Returns ``fn``'s results in rank order (tensors are ready once the current stream gets there).

    ``fn`` should make one collective call: rank 0's kernel waits on the GPU while the host issues the
    other ranks' launches, so several calls in one ``fn`` (each compiling its kernel on first use) can
    keep the peers' launches of the first call back past the timeout. When ``fn`` raises for a rank, the
    later ranks are still issued (a rank that raised after its launch then has its peers; one that raised
    before launching leaves them waiting until the timeout, as a skipped call would) and the first
    exception is raised after every stream is joined."""
    current = torch.cuda.current_stream(ranks[0].device)
    results, error = [], None
    try:
        for rank in ranks:
            rank.stream.wait_stream(current)
            with torch.cuda.stream(rank.stream):
                try:
                    results.append(fn(rank))
                except Exception as e:  # noqa: BLE001 -- re-raised below, once every rank is issued
                    results.append(None)
                    error = error or e
    finally:
        for rank in ranks:
            current.wait_stream(rank.stream)
    if error is not None:
        raise error
    return results


def close_group(ranks: list[LoopbackRank]) -> None:
    """Close every rank (after their calls have completed)."""
    for rank in ranks:
        rank.close()
