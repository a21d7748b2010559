"""What a contender is: one library's way of doing an op, made ready for one shape.

A :class:`Contender` is set up once per run (workspaces, handles) and bound to each case
(:meth:`Contender.bind`), giving a :class:`Bound`: ``call(k)`` runs the op on input set ``k`` of the
case's :class:`Slots` and returns whatever the library returns; ``outputs(result)`` names the tensors
that are checked (:func:`tpcomm.bench.checks.expected` gives the names). The runner loads inputs into
the slots, checks, captures ``call(0) ... call(K - 1)`` in a CUDA graph, times it, and checks the graph's
last output again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class NotApplicable(Exception):
    """The contender has no row at this case, for a reason that is the same on every rank (an op it lacks,
    a shape it refuses). Reported as ``n/a``; not a failure."""


@dataclass
class Slots:
    """``K`` input sets of one case on this rank: ``x[k]`` of shape ``(case.input_rows, H)``, and the
    replicated ``residual`` ``(T, H)`` and ``weight`` ``(H,)`` of the fused ops (None otherwise)."""

    x: list
    residual: torch.Tensor | None
    weight: torch.Tensor | None

    def load(self, k: int, x: torch.Tensor, residual: torch.Tensor | None = None,
             weight: torch.Tensor | None = None):
        """Copy ``x`` into set ``k``, and ``residual`` / ``weight`` (when given) into the shared ones."""
        self.x[k].copy_(x)
        if residual is not None:
            self.residual.copy_(residual)
        if weight is not None:
            self.weight.copy_(weight)


@dataclass
class Bound:
    """A contender made ready for one case.

    Attributes:
        call: ``call(k)`` runs the op on input set ``k`` (eagerly or under capture) and returns its result.
        outputs: names the result's tensors (``{"sum": y}``, ``{"out": o, "residual_out": r}``, ...); may
            be collective (the peer copy synchronises the ranks before reading what arrived).
        load: after the slots' set ``k`` is loaded, copies it into the contender's own buffers (symmetric
            memory); None when the contender reads the slots directly.
        poison: fills the outputs the caller owns with NaN (before the check).
        after_capture: collective step after a graph capture (vLLM registers the captured inputs).
        note: shown in the JSON (tpcomm's algorithm, a library's setting).
    """

    call: Callable[[int], Any]
    outputs: Callable[[Any], dict]
    load: Callable[[int], None] | None = None
    poison: Callable[[], None] | None = None
    after_capture: Callable[[], None] | None = None
    note: str = ""
    keep: list = field(default_factory=list)  # tensors the calls use, kept alive with the bound


class Contender:
    """One library's way of doing some ops.

    Class attributes:
        name: key in the JSON and ``--contenders``.
        label: column header.
        library: ``tpcomm``, ``NCCL``, ``torch symm_mem``, ``FlashInfer`` or ``torch``.
        ops: ops it implements.
        modes: modes it runs in (``graph``, ``eager``).
        exact: checked against the contract bit for bit (tpcomm) rather than within a tolerance.
        reference: a reference row (no communication, or the peer copy), left out of speed-ups.
    """

    name = ""
    label = ""
    library = ""
    ops: tuple = ()
    modes: tuple = ("graph", "eager")
    exact = False
    reference = False

    def setup(self, ctx) -> None:
        """Once per run, on every rank in the same order (may be collective). Raise to mark the
        contender unavailable for the whole run (the reason is reported)."""

    def bind(self, case, slots: Slots, ctx) -> Bound:
        """Ready for ``case``; raise :class:`NotApplicable` for a shape it does not take."""
        raise NotImplementedError

    def expected(self, case, inputs) -> dict | None:
        """What this contender must produce on ``inputs`` when it differs from the op's result (a
        reference row without communication); None: :func:`tpcomm.bench.checks.expected`."""
        return None

    def close(self) -> None:
        """Release what :meth:`setup` made (collective where setup was)."""


def new_outputs(n: int, shape, dtype, device) -> list:
    """``n`` output tensors the caller passes to a library (poisoned before the check)."""
    return [torch.empty(shape, dtype=dtype, device=device) for _ in range(n)]


def poison(tensors) -> None:
    """Fill float tensors with NaN and others with 0xFF bytes (an FP8 NaN, an impossible scale)."""
    for t in tensors:
        if t is None:
            continue
        if t.dtype.is_floating_point and t.element_size() > 1:
            t.fill_(float("nan"))
        else:
            t.view(torch.uint8).fill_(0xFF)
