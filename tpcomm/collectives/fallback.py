"""What the ops' host code shares around the ``torch.distributed`` fallback and the outputs it writes."""

from __future__ import annotations

from typing import Callable

import torch

#: How host code writes a call's outputs (the fallback's results, a strided ``out`` staged through a
#: contiguous one): in inference mode, so that, as the kernels' writes, they record no autograd history
#: and go into any output the kernels could write (a view of a leaf that requires grad, a tensor made in
#: inference mode and used outside it).
HOST_WRITES = torch.inference_mode


def fall_back(comm, op: str, call: tuple, write: Callable[[], None]) -> None:
    """Run a call of ``op`` through ``torch.distributed``: first the signature check of
    :meth:`~tpcomm.Communicator._before_fallback` (``call``: what the kernels' signatures would hold),
    then ``write()``, which computes the plain-torch reference over the group and writes the outputs,
    under :data:`HOST_WRITES`. Collective."""
    comm._before_fallback(op, call)
    with HOST_WRITES():
        write()
