"""Sync primitives shared by every tpcomm kernel.

Problem: programs on different GPUs (or CPU processes under the interpreter) exchange data through a
symmetric workspace and must know when a peer's data has landed, without ever hanging.

Protocol:
  * A *flag* is an int32 in a rank's signal pad. Only one program of one peer ever writes a given flag,
    and it writes the call's *epoch* (a per-call sequence number kept in device memory) with a
    ``release`` exchange at system scope, after a program-wide barrier, so the release covers the data
    stores of every thread of the program.
  * The owner polls its own flag with an ``acquire`` load at system scope (``atomic_add(p, 0)``, which
    Triton lowers to ``ld.acquire.sys``) until it equals the epoch, then runs a program-wide barrier before
    any thread loads the data. Flags are matched by equality, so wrap-around of the 32-bit epoch is
    harmless; flags are doubled by epoch parity, so a peer one call ahead never overwrites a flag that is
    still awaited.
  * Every wait is bounded in nanoseconds: ``%globaltimer`` on NVIDIA, the host's monotonic clock under
    the interpreter. On expiry the
    waiter records ``(code, peer, epoch, program)`` in the error words, marks the communicator broken
    (``state[2]``, device memory) and returns; the communicator turns that into
    :class:`~tpcomm.errors.PeerTimeoutError`. Once broken, every later wait of the program, and of every
    later launch, gives up at once, so a call of many rows or chunks reports after one timeout.
  * Epochs advance inside the kernels: each program reads the epoch when it starts and bumps a finish
    counter when it ends; the program that brings the counter to the grid size resets it and advances
    the epoch. That program runs after every other program has read the epoch, and the next launch on the
    stream sees the new value, so a launch of any grid size advances the epoch exactly once.
"""

import time

import triton
import triton.language as tl

from ..env import interpreter_enabled

#: Error code written when a wait expires.
ERR_TIMEOUT = tl.constexpr(1)


@triton.jit
def peer_ptr(table_ptr, peer, DTYPE: tl.constexpr):
    """Typed, 16-byte-aligned pointer to ``peer``'s buffer from an int64 address table."""
    p = tl.load(table_ptr + peer).to(tl.pointer_type(DTYPE))
    return tl.multiple_of(p, 16)


@triton.jit
def send_flag(flag_ptr, epoch):
    """Publish ``epoch`` to a flag with release semantics at system scope.

    Precondition: the caller ran ``tl.debug_barrier()`` after its data stores, and is the only writer
    of this flag.
    """
    tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")


if interpreter_enabled():
    # The interpreter runs kernels as Python and refuses inline PTX: read the host's clock instead.
    # (TRITON_INTERPRET is itself fixed before the first kernel is defined, so this choice is too.)
    def _host_ns() -> int:
        return time.monotonic_ns()

    @triton.jit
    def now_ns():
        """Nanoseconds from an arbitrary origin (the host's monotonic clock)."""
        return _host_ns()
else:
    @triton.jit
    def now_ns():
        """Nanoseconds from an arbitrary origin (NVIDIA ``%globaltimer``)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def wait_flag(flag_ptr, epoch, peer, program, timeout, err_ptr, state_ptr):
    """Spin until ``*flag_ptr == epoch`` (acquire, system scope), at most ``timeout`` nanoseconds.

    On expiry calls :func:`record_timeout` and returns False.
    The caller runs ``tl.debug_barrier()`` before loading the data this flag publishes.
    """
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    start = now_ns()
    waited = start - start
    while (seen != epoch) & (waited < timeout):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        waited = now_ns() - start
    ok = seen == epoch
    if not ok:
        record_timeout(err_ptr, state_ptr, peer, epoch, program)
    return ok


@triton.jit
def record_timeout(err_ptr, state_ptr, peer, epoch, program):
    """Write ``(ERR_TIMEOUT, peer, epoch, program)`` to the error words and mark the state broken."""
    tl.store(err_ptr + 1, peer)
    tl.store(err_ptr + 2, epoch)
    tl.store(err_ptr + 3, program)
    tl.store(err_ptr, ERR_TIMEOUT)
    tl.store(state_ptr + 2, 1)


@triton.jit
def launch_timeout(state_ptr, timeout):
    """``timeout``, or 0 when an earlier wait of this communicator expired (``state[2]``)."""
    broken = tl.load(state_ptr + 2, volatile=True)
    return tl.where(broken != 0, 0, timeout)


@triton.jit
def read_epoch(state_ptr):
    """The epoch of this launch (``state_ptr[0]``), read once at a program's start."""
    return tl.load(state_ptr, volatile=True)


@triton.jit
def finish_program(state_ptr, epoch, num_programs):
    """Count this program as finished; the last one resets the counter and advances the epoch."""
    done = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == num_programs - 1:
        tl.atomic_xchg(state_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state_ptr, epoch + 1, sem="release", scope="gpu")
