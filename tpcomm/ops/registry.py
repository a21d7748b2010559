"""The ops' registry of communicators (an ``int`` handle per communicator: :mod:`tpcomm.ops`, "Why a
handle") and the signatures that :func:`tpcomm.capture.before_call` keys a call by."""

from __future__ import annotations

import torch


# -- registry -------------------------------------------------------------------------------------------
def register(comm) -> int:
    """``comm``'s handle for the ops (every Communicator gets one at construction: ``comm.handle``).

    Handles are local to the process (two ranks may hold different handles for their communicators of
    one group); they start at 1 and are never reused, and the registry holds communicators weakly.

    Args:
        comm: a :class:`tpcomm.Communicator`.
    Returns:
        The handle, an ``int >= 1``.
    Raises:
        TypeError: ``comm`` is not a Communicator.
    """
    from ..communicator import Communicator

    if not isinstance(comm, Communicator):
        raise TypeError(f"tpcomm ops: comm must be a tpcomm.Communicator or an int handle, got "
                        f"{type(comm).__name__}")
    return comm.handle


def lookup(handle: int):
    """The communicator registered under ``handle``.

    Raises:
        TypeError: ``handle`` is not an int.
        LookupError: no live communicator has this handle (garbage-collected, or never created here).
    """
    from ..communicator import _BY_HANDLE

    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(f"tpcomm ops: handle must be an int from tpcomm.ops.register, got {type(handle).__name__}")
    comm = _BY_HANDLE.get(handle)
    if comm is None:
        raise LookupError(f"tpcomm ops: no communicator is registered under handle {handle} (garbage-collected "
                          "since, or never created in this process)")
    return comm


def _is_handle(comm) -> bool:
    return isinstance(comm, int) and not isinstance(comm, bool)


@torch.compiler.assume_constant_result
def _group_of_handle(handle: int) -> tuple[int, int, int]:
    c = lookup(handle)
    return handle, c.rank, c.world_size


def group_of(comm) -> tuple[int, int, int]:
    """``(handle, rank, world_size)`` of a communicator or handle.

    Under torch.compile these become constants: a communicator's are plain int attributes, which Dynamo
    reads while tracing and guards on (a model holding another communicator, with another handle,
    recompiles: ``tests/ops/test_compile.py::test_compiled_code_follows_the_communicator``). An earlier
    ``assume_constant_result`` function of the communicator itself failed to trace with torch 2.11
    ("UserDefinedObjectVariable(Communicator) is not a constant", 2 H200s)."""
    if _is_handle(comm):
        return _group_of_handle(comm)
    return register(comm), comm.rank, comm.world_size


def handle_of(comm) -> int:
    """``comm``'s handle: ``comm`` itself if it is an int handle, else ``comm.handle`` (:func:`register`)."""
    if _is_handle(comm):
        return comm
    return register(comm)


# -- signatures --------------------------------------------------------------------------------------------
def tensor_sig(t: torch.Tensor | None):
    return None if t is None else (tuple(t.shape), t.dtype, t.data_ptr() % 16 == 0)


def signature(op: str, *tensors) -> tuple:
    """What decides which kernels a call compiles (the key of :func:`tpcomm.capture.before_call`): the
    op, and the shape, dtype and 16-byte alignment of each tensor argument (Triton specialises pointers
    on 16-byte alignment). A new output counts as an aligned tensor of the input's shape and dtype, so
    ``all_reduce(x)`` and ``all_reduce(x, out=aligned)`` share a signature."""
    return (op,) + tuple(tensor_sig(t) for t in tensors)


def scale_sig(scale: torch.Tensor | None):
    """The signature entry of a static or global ``scale``: its dtype and alignment, not its shape. The
    kernels read its one element through a pointer, so ``()``, ``(1,)`` and ``(1, 1)`` compile the same
    kernels (and a warm-up with one covers the others)."""
    return None if scale is None else ((1,), scale.dtype, scale.data_ptr() % 16 == 0)
