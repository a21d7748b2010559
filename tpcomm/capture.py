"""The capture guard of :mod:`tpcomm.graphs`: the signatures each communicator ran outside a capture,
the check of every :mod:`tpcomm.ops` call made during a guarded capture (:func:`before_call`), and
:func:`capture_guard` itself. What an engine must do around CUDA graphs, and why, is
:mod:`tpcomm.graphs`' docstring; every name here is importable from ``tpcomm.graphs``.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Sequence

import torch

from .errors import TpcommError


class GraphCaptureError(TpcommError):
    """A tpcomm call inside a CUDA-graph capture that cannot be captured safely (see :func:`capture_guard`)."""


#: communicator -> signatures of the calls it ran outside a capture (see ``tpcomm.ops.registry.signature``)
_WARMED: "weakref.WeakKeyDictionary[object, set]" = weakref.WeakKeyDictionary()
_LOCAL = threading.local()


def _guards() -> list:
    if not hasattr(_LOCAL, "guards"):
        _LOCAL.guards = []
    return _LOCAL.guards


def _capturing(comm) -> bool:
    return comm.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def warmed(comm) -> frozenset:
    """Signatures of the calls ``comm`` ran through :mod:`tpcomm.ops` outside a capture."""
    return frozenset(_WARMED.get(comm, ()))


def before_call(comm, signature: tuple) -> None:
    """Called by every op of :mod:`tpcomm.ops` before it runs: outside a capture, records
    ``signature`` as warmed for ``comm``; during a capture inside :func:`capture_guard`, checks it.

    Raises:
        GraphCaptureError: during a guarded capture, the signature was never run before on ``comm``,
            or ``comm`` is called from a second stream.
    """
    if not _capturing(comm):
        _WARMED.setdefault(comm, set()).add(signature)
        return
    guards = _guards()
    if guards:
        guards[-1].check(comm, signature)


class _Guard:
    def __init__(self, comms: Sequence):
        self.comms = list(comms)
        self.streams: dict[int, tuple[int, object]] = {}  # id(comm) -> (stream handle, comm)

    def check(self, comm, signature: tuple) -> None:
        op = signature[0]
        if signature not in _WARMED.get(comm, ()):
            shapes = ", ".join("None" if s is None else f"{tuple(s[0])} {str(s[1]).replace('torch.', '')}"
                               + ("" if s[2] else " (not 16-byte aligned)") for s in signature[1:])
            raise GraphCaptureError(
                f"{op}: first call of this signature ({shapes}) on {comm!r} happens during CUDA-graph "
                "capture, so its Triton kernels would be compiled and loaded inside the capture. Run the "
                "same call once before capturing (tpcomm.graphs.warmup, or one eager forward per "
                "captured shape).")
        stream = torch.cuda.current_stream(comm.device).cuda_stream
        seen = self.streams.setdefault(id(comm), (stream, comm))[0]
        if seen != stream:
            raise GraphCaptureError(
                f"{op}: {comm!r} is called from a second stream (0x{stream:x}, earlier 0x{seen:x}) during "
                "capture; call each communicator from the capturing stream only (no side streams).")


@contextmanager
def capture_guard(*comms):
    """Check that CUDA-graph captures inside the block use ``comms`` safely. Enter it before capture
    begins (it may hold several ``torch.cuda.graph`` blocks that capture on the same stream, which
    ``torch.cuda.graph``'s default capture stream is).

    On entry, for each communicator: it must be open, and the device is synchronised and
    ``comm.check()`` run, so a peer timeout of the warm-up is reported now rather than from inside a
    graph. Inside, every call through :mod:`tpcomm.ops` made during capture must have been run once
    before on that communicator with the same signature, and all calls of one communicator must come
    from one stream (:func:`before_call`). On a normal exit ``comm.check()`` runs again.

    Args:
        comms: the :class:`tpcomm.Communicator` objects the captured code uses (at least one).
    Raises:
        ValueError: no communicator given, or one is closed.
        TypeError: an argument is not a Communicator.
        GraphCaptureError: entered while the current stream is already capturing (on entry), or a call
            during capture fails the checks above.
        PeerTimeoutError: a communicator recorded a peer timeout before the block or inside it.
    """
    from .communicator import Communicator

    if not comms:
        raise ValueError("capture_guard: pass the communicators the captured code uses")
    for i, comm in enumerate(comms):
        if not isinstance(comm, Communicator):
            raise TypeError(f"capture_guard: comms[{i}] must be a tpcomm.Communicator, got {type(comm).__name__}")
        if comm.closed:
            raise ValueError(f"capture_guard: comms[{i}] ({comm!r}) is closed")
        if _capturing(comm):
            raise GraphCaptureError("capture_guard: the current stream is already capturing; enter the guard "
                                    "before capture begins")
    for comm in comms:
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        comm.check("capture_guard")
    guard = _Guard(comms)
    guards = _guards()
    guards.append(guard)
    try:
        yield guard
    finally:
        guards.remove(guard)
    for comm in comms:
        comm.check("capture_guard")
