"""Exceptions raised by tpcomm."""

from __future__ import annotations


class TpcommError(RuntimeError):
    """Base class of tpcomm's run-time errors."""


class SetupTimeoutError(TpcommError):
    """A rank waited longer than ``timeout_s`` for its peers to create a :class:`~tpcomm.Communicator` of
    the group (creation is collective): a peer never created it, or created it later than that.

    Raised by the constructor on every rank that got there, naming the ranks that had not arrived when the
    first rank gave up; a rank that arrives after its peers gave up raises it too, after its own timeout
    (it waited for their next creation). No communicator exists on any rank and nothing was sent through
    the process group, which stays usable: create the communicators again, on every rank.

    A rank that arrives after the rank holding the group's store (rank 0 of the default group) gave up and
    ended raises it too, saying the store could not be reached (``missing`` is then empty).

    Attributes:
        rank: the rank that raised.
        missing: the group ranks that had not arrived when the first rank gave up.
        timeout_s: that rank's timeout.
    """

    def __init__(self, rank: int, missing: list[int], timeout_s: float, store_lost: str | None = None):
        self.rank, self.missing, self.timeout_s = rank, list(missing), timeout_s
        what = (f"the group's store could not be reached ({store_lost}): the rank that holds it has ended, "
                "most likely after its own timeout_s passed waiting for this rank" if store_lost else
                f"rank(s) {self.missing} did not create the communicator within {timeout_s:g} s of their peers")
        super().__init__(f"Communicator: rank {rank}: {what} (creating it is collective: every rank of the "
                         "group creates it at the same point of its program; for ranks whose start-up differs by "
                         "more than that, pass a longer timeout_s or synchronise them first). No rank has a "
                         "communicator" + ("." if store_lost else "; the process group is still usable."))

    def __reduce__(self):
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls, args, state):
    """Unpickle a :class:`PeerTimeoutError` (or subclass) or a :class:`SetupTimeoutError` without calling
    its ``__init__``."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class PeerTimeoutError(TpcommError):
    """A kernel waited longer than the timeout for a peer's data or flag.

    Raised on the rank that waited, by the next call on its communicator (or by
    :meth:`~tpcomm.Communicator.check`). The communicator is unusable afterwards: its epochs no longer
    agree with the peer's, so every later call raises this error again; create a new communicator.

    Attributes:
        op: the op whose kernel timed out (e.g. ``"fused_add_rmsnorm"``).
        rank: the rank that waited.
        peer: the rank that never arrived.
        epoch: the failing launch's epoch: the number of kernel launches on this communicator up to it,
            from 1 (one launch per call; several for a call cut into chunks).
        program: the program index that waited.
    """

    def __init__(self, op: str, rank: int, peer: int, epoch: int, program: int, timeout_s: float):
        self.op, self.rank, self.peer, self.epoch, self.program = op, rank, peer, epoch, program
        super().__init__(self._message(timeout_s))

    def __reduce__(self):
        # pickled as it is (message included), so that a rank can return the error it caught to the
        # process that started it (tpcomm.launch.launch)
        return _rebuild, (type(self), self.args, self.__dict__)

    def _message(self, timeout_s: float) -> str:
        return (f"{self.op}: rank {self.rank} waited more than {timeout_s:g} s for rank {self.peer} at epoch "
                f"{self.epoch} (program {self.program}); rank {self.peer} skipped the call, called another op or "
                "size, ran another kind of kernel (another algorithm, or the torch.distributed fallback), or is "
                "stuck. This communicator is unusable now; create a new one.")


class PeerMismatchError(PeerTimeoutError):
    """A peer arrived at the same epoch with a different call: another op, size, dtype or algorithm.

    Raised like :class:`PeerTimeoutError` (a subclass, so code that catches that catches this too), at
    once rather than after the timeout, on every rank that saw the other's flags. The outputs of that call
    are undefined. The communicator is unusable afterwards; create a new one.
    """

    def _message(self, timeout_s: float) -> str:
        return (f"{self.op}: rank {self.peer} made a different call at epoch {self.epoch} (another op, shape, "
                f"dim, dtype, eps, gemma, residual, FP8 mode, format or group size, or algorithm; seen by rank "
                f"{self.rank}, program {self.program}). Every rank must make the same calls in the same order. "
                "This communicator is unusable now; create a new one.")


class PeerAbortedError(PeerTimeoutError):
    """A peer gave up waiting for this rank's part of a call before this rank's kernel of that call ran:
    this rank arrived late (later than the peer's timeout), or skipped a call, so that its call of that
    epoch is the peer's next one.

    Raised like :class:`PeerTimeoutError` (a subclass), on the late rank, for the same call (the same
    epoch) for which the peer raised :class:`PeerTimeoutError`, so every rank's call of that epoch
    fails (docs/reliability.md, "What each rank sees"). ``peer`` is the rank that gave up; this rank is
    the one it waited for. The communicator is unusable afterwards; create a new one.
    """

    def _message(self, timeout_s: float) -> str:
        return (f"{self.op}: rank {self.peer} gave up waiting for rank {self.rank} at epoch {self.epoch} (its "
                f"timeout passed before rank {self.rank}'s call of that epoch ran; program {self.program}): rank "
                f"{self.rank} was late, or skipped a call. This communicator is unusable now; create a new one.")
