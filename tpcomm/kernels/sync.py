"""Sync primitives shared by every tpcomm kernel.

Problem: programs on different GPUs (or CPU processes under the interpreter) exchange data through a
symmetric workspace and must know when a peer's data has landed, without ever hanging.

Protocol:
  * A *flag* is an int64 in a rank's signal pad. Only one program of one peer ever writes a given flag,
    and it writes ``signature << 32 | epoch`` (the epoch is a per-call sequence number kept in device
    memory; the signature a hash of the call's op and shape, the same on every rank that makes the same
    call) with a ``release`` exchange at system scope, after a program-wide barrier, so the release
    covers the data stores of every thread of the program.
  * The owner polls its own flag with an ``acquire`` load at system scope (``atomic_add(p, 0)``, which
    Triton lowers to ``ld.acquire.sys``) until its low 32 bits equal the epoch, then runs a program-wide
    barrier before any thread loads the data. Flags are matched by equality (a slot left unwritten for
    2**32 calls matches again: docs/reliability.md, after the fault table); flags are doubled by epoch
    parity (and by phase: two-shot exchanges twice), so a peer one call ahead never overwrites a flag
    that is still awaited. A flag of the right epoch but
    another signature means the peer made a different call: the waiter records ``ERR_MISMATCH`` (the
    call's outputs are then undefined, and the call raises).
  * Every wait is bounded in nanoseconds: ``%globaltimer`` on NVIDIA, the host's monotonic clock under
    the interpreter. Every wait decides as one block (docs/design.md, "Every wait decides as one block"):
    a wait with a barrier inside its loop decides on a block-wide value (:func:`waited_ns` here;
    :func:`block_code` for the Lamport tile poll and the QK norm's words, an OR over every thread through
    shared memory), so its loop ends the same round in every thread and its abort store and error records
    are block-uniform branches; Lamport's per-thread vector spin has no barrier, and each thread gives up
    and records on its own with masked stores (:func:`record_lanes`). On
    expiry the waiter records ``(code, peer, epoch, program)`` in the error words, marks the communicator
    broken (``BROKEN_BIT`` of the state word) and returns; the communicator turns that into
    :class:`~tpcomm.errors.PeerTimeoutError`. Once broken, every later wait of the program, and of every
    later launch, gives up at once, so a call of many rows or chunks reports after one timeout.
  * The state word (int64, the first word of a rank's abort region, ``Workspace.state``) holds the
    epoch (bits 0-31), the start counter (bits 32-47), ``BROKEN_BIT`` and ``NOTIFIED_BIT``; a program
    reads all of it in the one atomic that takes its start ticket (:func:`start_program`), so the
    broken flag and the abort check below cost no memory access of their own on a call that succeeds.
  * The same outcome on every rank: a wait of program ``p`` that passes its timeout stores its abort
    word (``1 << 32 | epoch``) in the awaited peer's word for (``p``, this rank), once, sets the peer's
    ``NOTIFIED_BIT`` (it stays set), and waits on for a grace (:func:`grace_ns`), withdrawing the word
    if the peer arrives then. A program that finds ``NOTIFIED_BIT`` in its state word reads its own
    abort words (:func:`check_abort`); one whose epoch a peer gave up on records ``ERR_ABORTED`` and
    sends no flag or call tag, so no rank completes that call (docs/reliability.md, "What each rank
    sees").
  * Epochs advance inside the kernels: each program reads the state word and takes a ticket from the
    start counter in one atomic when it starts; the program with the last ticket resets the counter and
    advances the epoch in one atomic when it ends, whose result nothing waits for. Every other program
    has read the epoch before that program's ticket, and the next launch on the stream sees the new
    value, so a launch of any grid size advances the epoch exactly once. With programmatic dependent
    launch the next launch's programs may start once every program of this one has passed its first
    wait (:func:`release_next`), but they read the state word only after ``griddepcontrol.wait``
    (:func:`start_program`), which returns once this launch has finished.
"""

import time
import zlib

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..env import interpreter_enabled

#: Error codes in the error words (host-side values, then the kernels' constants).
TIMEOUT_CODE, MISMATCH_CODE, ABORTED_CODE = 1, 2, 3
#: Error code written when a wait expires.
ERR_TIMEOUT = tl.constexpr(TIMEOUT_CODE)
#: Error code written when a peer's flag carries another call's signature.
ERR_MISMATCH = tl.constexpr(MISMATCH_CODE)
#: Error code written when a peer gave up waiting for this rank at this call's epoch (abort word).
ERR_ABORTED = tl.constexpr(ABORTED_CODE)

#: The state word (module docstring): the flag set when a wait of this rank expired, the flag a peer
#: sets when it stores an abort word here (host-side values, then the kernels'), and the largest launch
#: the start counter counts (``Workspace`` refuses a larger grid cap).
BROKEN_FLAG, NOTIFIED_FLAG, MAX_PROGRAMS = 1 << 48, 1 << 49, (1 << 16) - 1
#: Bits of the state word above the epoch that hold the start counter (``(word >> 32) & COUNTER_BITS``).
COUNTER_BITS = tl.constexpr(0xFFFF)
BROKEN_BIT = tl.constexpr(BROKEN_FLAG)
NOTIFIED_BIT = tl.constexpr(NOTIFIED_FLAG)


def call_signature(*fields) -> int:
    """The 31-bit signature a launch's flags carry: a CRC of ``fields`` (the op, algorithm, shape and
    dtype of the call, everything every rank must agree on), odd and at least 2**30, so Triton never
    specialises it as the constant 1 and peers making the same call compute the same value."""
    crc = zlib.crc32(repr(fields).encode())
    return (crc & 0x3FFFFFFE) | 0x40000001


#: Ranks whose table entries :func:`table_bases` loads at a kernel's start; a larger world (CPU ranks)
#: loads each entry where it is used.
HOISTED_RANKS = tl.constexpr(8)


@triton.jit
def table_bases(table_ptr, WORLD: tl.constexpr):
    """Entries ``0 .. 7`` of an int64 address table (the workspace's: written once at set-up, so a
    kernel may read it before ``griddepcontrol.wait``), as a tuple for :func:`base_ptr` and
    :func:`own_ptr`: those below ``WORLD`` loaded at once, the others entry 0 again (no load). A kernel
    calls it first, so that the loads' latency overlaps its start atomic instead of following it (a
    table entry loaded at its first use waits behind the atomic's round trip and the barrier that
    broadcasts it); with ``WORLD`` above ``HOISTED_RANKS`` it loads only entry 0."""
    b0 = tl.load(table_ptr)
    b1, b2, b3, b4, b5, b6, b7 = b0, b0, b0, b0, b0, b0, b0
    if WORLD <= HOISTED_RANKS:
        if WORLD > 1:
            b1 = tl.load(table_ptr + 1)
        if WORLD > 2:
            b2 = tl.load(table_ptr + 2)
        if WORLD > 3:
            b3 = tl.load(table_ptr + 3)
        if WORLD > 4:
            b4 = tl.load(table_ptr + 4)
        if WORLD > 5:
            b5 = tl.load(table_ptr + 5)
        if WORLD > 6:
            b6 = tl.load(table_ptr + 6)
        if WORLD > 7:
            b7 = tl.load(table_ptr + 7)
    return b0, b1, b2, b3, b4, b5, b6, b7


@triton.jit
def base_ptr(bases, table_ptr, q: tl.constexpr, DTYPE: tl.constexpr, WORLD: tl.constexpr):
    """Typed, 16-byte-aligned pointer to peer ``q``'s buffer (``q`` a constant) from
    :func:`table_bases`'s ``bases`` (from the int64 address table itself past ``HOISTED_RANKS``)."""
    if WORLD <= HOISTED_RANKS:
        p = bases[q].to(tl.pointer_type(DTYPE))
    else:
        p = tl.load(table_ptr + q).to(tl.pointer_type(DTYPE))
    return tl.multiple_of(p, 16)


@triton.jit
def own_ptr(bases, table_ptr, rank, DTYPE: tl.constexpr, WORLD: tl.constexpr):
    """:func:`base_ptr` of ``rank``, a run-time value (one binary serves every rank): a chain of
    selects over ``bases``, no load (from the table past ``HOISTED_RANKS``)."""
    if WORLD <= HOISTED_RANKS:
        b = bases[0]
        for q in tl.static_range(1, WORLD):
            b = tl.where(rank == q, bases[q], b)
        p = b.to(tl.pointer_type(DTYPE))
    else:
        p = tl.load(table_ptr + rank).to(tl.pointer_type(DTYPE))
    return tl.multiple_of(p, 16)


@triton.jit
def send_flag(flag_ptr, value):
    """Publish ``value`` (:func:`flag_value`) to a flag with release semantics at system scope.

    Precondition: the caller ran ``tl.debug_barrier()`` after its data stores, and is the only writer
    of this flag.
    """
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


#: Lanes of :func:`waited_ns`'s clock tile: at least one per thread of a program of up to 32 warps, so
#: its block-wide max reads every thread's clock (a smaller tile would be replicated over warps, each
#: reducing its own copy, and warps could disagree).
CLOCK_LANES = tl.constexpr(1024)
#: Reads NVIDIA's nanosecond clock into a 64-bit register.
_GLOBALTIMER = tl.constexpr("mov.u64 $0, %globaltimer;")

if interpreter_enabled():
    # The interpreter runs kernels as Python and refuses inline PTX: read the host's clock instead.
    # (TRITON_INTERPRET is itself fixed before the first kernel is defined, so this choice is too.)
    def _host_ns() -> int:
        return time.monotonic_ns()

    @triton.jit
    def now_ns():
        """Nanoseconds from an arbitrary origin (the host's monotonic clock)."""
        return _host_ns()

    @triton.jit
    def waited_ns(start):
        """Nanoseconds since ``start`` (an earlier :func:`now_ns`); one thread runs a program here."""
        return now_ns() - start
else:
    @triton.jit
    def now_ns():
        """Nanoseconds from an arbitrary origin (NVIDIA ``%globaltimer``), read by each thread."""
        return tl.inline_asm_elementwise(_GLOBALTIMER, "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def waited_ns(start):
        """Nanoseconds since ``start`` (each thread's own earlier :func:`now_ns`), the largest over the
        program's threads: one block-wide max, so every thread gets the same value (a loop may exit on
        it without its warps parting)."""
        lanes = tl.arange(0, CLOCK_LANES)
        now = tl.inline_asm_elementwise(_GLOBALTIMER, "=l,r", [lanes], dtype=tl.int64,
                                        is_pure=False, pack=1)
        return tl.max(now - start, axis=0)


#: Bits of a block-wide wait's code (:func:`block_code`, ``spin.wait_peer``): the data is missing (a lane
#: holds the sentinel), this epoch's call tag is missing, the wait expired with one of those, the tag is
#: this epoch's with another call's signature, the wait is past its timeout (its grace has begun).
WAIT_DATA = tl.constexpr(1)
WAIT_TAG = tl.constexpr(2)
WAIT_EXPIRED = tl.constexpr(4)
WAIT_OTHER = tl.constexpr(8)
WAIT_LATE = tl.constexpr(16)


@triton.jit
def bit_or(a, b):
    return a | b


if interpreter_enabled():
    @triton.jit
    def block_code(code, start, timeout, limit):
        """The interpreter's :func:`block_code`: one thread runs a program, so its code is the block's."""
        waited = now_ns() - start
        missing = (code & (WAIT_DATA | WAIT_TAG)) != 0
        return (code | tl.where(missing & (waited >= limit), WAIT_EXPIRED, 0)
                | tl.where(waited >= timeout, WAIT_LATE, 0))
else:
    @triton.jit
    def block_code(code, start, timeout, limit):
        """One round's decision of a block-wide wait, the same value in every thread: the bitwise OR over
        the program's threads of ``code`` (int32, this thread's ``WAIT_DATA``, ``WAIT_TAG``, ``WAIT_OTHER``
        bits) with ``WAIT_EXPIRED`` where this thread's clock has passed ``limit`` ns since ``start`` (its
        own earlier :func:`now_ns`) while it misses something, and ``WAIT_LATE`` where it has passed
        ``timeout``. The OR runs over ``CLOCK_LANES`` lanes, at least one per thread, each holding its
        thread's code and its own clock read (an opaque asm over the lanes, which the compiler cannot fold
        into one value): a reduction through shared memory, so warps that loaded different words, or a
        tile replicated over warps (each warp reducing its own copy), still leave the loop together."""
        lanes = tl.arange(0, CLOCK_LANES)
        now = tl.inline_asm_elementwise(_GLOBALTIMER, "=l,r", [lanes], dtype=tl.int64, is_pure=False, pack=1)
        waited = now - start
        missing = (code & (WAIT_DATA | WAIT_TAG)) != 0
        bits = (code | tl.where(missing & (waited >= limit), WAIT_EXPIRED, 0)
                | tl.where(waited >= timeout, WAIT_LATE, 0))
        return tl.reduce(bits, 0, bit_or)


@triton.jit
def tell_mismatch(table_entry_ptr, first_idx, p_from, p_to, value, WORLD: tl.constexpr):
    """Store ``value`` (this rank's flag or call tag of this call, int64) into the slots of programs
    ``p_from .. p_to - 1`` of the peer whose base address is at ``table_entry_ptr``: program ``p``'s slot
    is ``first_idx + p * WORLD`` int64 elements from the base. A program that found the peer's call to be
    another call (``ERR_MISMATCH``) tells the peer's programs that have no partner here (``p_from``: this
    launch's size; a call with another token count has another grid): they find this call's signature
    at once and record the mismatch too, instead of waiting out the timeout. Call it from a block-uniform
    branch, on the error path only; a slot holds this epoch, so no later call matches it."""
    base = tl.load(table_entry_ptr).to(tl.pointer_type(tl.int64))
    lanes = tl.arange(0, CLOCK_LANES)
    for p0 in range(p_from, p_to, CLOCK_LANES):
        p = p0 + lanes
        tl.store(base + first_idx + p.to(tl.int64) * WORLD, value + lanes.to(tl.int64) * 0, mask=p < p_to)


@triton.jit
def flag_value(epoch, signature):
    """The int64 a flag carries: ``signature << 32 | (epoch mod 2**32)``."""
    return (signature.to(tl.int64) << 32) | (epoch.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def flag_offset(par, phase, pid, pad_programs, WORLD: tl.constexpr):
    """Index of ``[par][phase][pid][0]`` in the signal pad ``int64 [2][2][pad_programs][WORLD]``
    (``workspace.PHASES`` is 2; ``pad_programs`` is ``Workspace.pad_programs``)."""
    return ((par * 2 + phase) * pad_programs + pid) * WORLD


#: Rounds of :func:`wait_flag`'s poll between two reads of the block-wide clock.
CLOCK_EVERY = tl.constexpr(8)
#: The most a wait goes on after its timeout, once it has told the peer (:func:`grace_ns`), in ns.
GRACE_MAX_NS = tl.constexpr(1_000_000_000)


#: The grace under the interpreter (:func:`grace_ns`): the timeout again, at least the floor and at
#: most the cap, in ns.
GRACE_MIN_INTERPRETED_NS = tl.constexpr(500_000_000)
GRACE_MAX_INTERPRETED_NS = tl.constexpr(1_000_000_000)

if interpreter_enabled():
    @triton.jit
    def grace_ns(timeout):
        """How long a wait goes on after ``timeout`` (int64 ns) expired and it stored its abort word in
        the awaited peer, under the interpreter: the timeout again, within ``GRACE_MIN_INTERPRETED_NS``
        and ``GRACE_MAX_INTERPRETED_NS`` (0 for a timeout of 0). A program's abort check and its first
        send are Python steps apart there, tens of milliseconds on a busy machine, so a grace of a short
        timeout would let a late peer's part land after the grace although its check ran before the
        abort word landed."""
        grace = tl.minimum(tl.maximum(timeout, GRACE_MIN_INTERPRETED_NS), GRACE_MAX_INTERPRETED_NS)
        return tl.where(timeout > 0, grace, 0)
else:
    @triton.jit
    def grace_ns(timeout):
        """How long a wait goes on after ``timeout`` (int64 ns) expired and it stored its abort word in
        the awaited peer: an eighth of the timeout, at most ``GRACE_MAX_NS`` (0 for a timeout of 0). A
        peer program that ran its abort check before that store landed sends its part of this call right
        after the check, so it lands within the grace."""
        return tl.minimum(timeout >> 3, GRACE_MAX_NS)


@triton.jit
def abort_word(epoch):
    """The int64 a rank stores in a peer's abort word when it gives up waiting for it at ``epoch``:
    ``1 << 32 | (epoch mod 2**32)`` (never 0, the words' initial value)."""
    return (1 << 32) | (epoch.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def abort_index(abort_off, program, rank, WORLD: tl.constexpr):
    """int64 elements from a peer's table base to the abort word that ``program`` of ``rank`` stores in
    it: word ``[program][rank]`` after the peer's state word, which is ``abort_off`` elements on
    (``Workspace.abort_offset``)."""
    return abort_off + 1 + program * WORLD + rank


@triton.jit
def store_abort(table_entry_ptr, abort_off, abort_idx, value):
    """Store ``value`` (:func:`abort_word`, or 0 to withdraw it) into the peer whose base address is at
    ``table_entry_ptr`` (an entry of an int64 address table), ``abort_idx`` int64 elements from that
    base (:func:`abort_index`); with a word, then set ``NOTIFIED_BIT`` in the peer's state word
    (``abort_off`` elements on; a release, after the word) so that its programs read their words. Only
    on a wait's slow path: the table entry is loaded here. A wait that stored the word and then saw the
    peer arrive within the grace withdraws it (the peer's check for this epoch has run by then), so a
    stale word never matches a later epoch of the same low 32 bits; the bit stays."""
    base = tl.load(table_entry_ptr).to(tl.pointer_type(tl.int64))
    tl.store(base + abort_idx, value)
    if value != 0:
        tl.atomic_or(base + abort_off, NOTIFIED_BIT, sem="release", scope="sys")


@triton.jit
def check_abort(state_ptr, word, rank, epoch, program, signature, err_ptr, timeout, WORLD: tl.constexpr):
    """Whether this rank's ``program`` may take part in the call of ``epoch``: False when a peer ``q``
    gave up waiting for it at this epoch (word ``[program][q]`` after the state word ``state_ptr``, in
    this rank's workspace, holds :func:`abort_word` of ``epoch``), after recording ``ERR_ABORTED``
    naming ``q`` (not when ``timeout``, :func:`launch_timeout`'s, is 0: the error recorded first
    stays). The words are read only when ``word`` (:func:`start_program`'s state word) has
    ``NOTIFIED_BIT``: a rank no peer ever gave up on reads nothing here. A program that may not take
    part sends no flag or call tag, so no peer completes the call either (docs/reliability.md, "What
    each rank sees")."""
    aborter = epoch * 0 - 1
    if (word & NOTIFIED_BIT) != 0:
        # the state word again, with acquire: it pairs with the peer's release of the flag, so the words
        # stored before it are seen (the start atomic is relaxed)
        tl.atomic_add(state_ptr, 0, sem="acquire", scope="sys")
        want = abort_word(epoch)
        for q in tl.static_range(WORLD):
            if q != rank:
                # an atomic read: one value for every thread of the program (a plain load is each thread's
                # own, and a word landing meanwhile would split the program at the barriers that follow)
                seen = tl.atomic_add(state_ptr + 1 + program * WORLD + q, 0, sem="relaxed", scope="sys")
                aborter = tl.where(seen == want, q, aborter)
        if (aborter >= 0) & (timeout > 0):
            record_error(err_ptr, state_ptr, ERR_ABORTED, aborter, epoch, program, signature)
    return aborter < 0


@triton.jit
def wait_flag(flag_ptr, epoch, signature, peer, program, timeout, err_ptr, state_ptr, abort_at, abort_off,
              abort_idx, tell_idx, pad_programs, WORLD: tl.constexpr):
    """Spin until the low 32 bits of ``*flag_ptr`` equal ``epoch`` (acquire, system scope), at most
    ``timeout`` nanoseconds, then check the signature.

    Returns True when the peer arrived with this call's signature. Once ``timeout`` has passed, stores
    this rank's abort word in the peer (:func:`store_abort` at ``abort_at``, ``abort_off``,
    ``abort_idx``) and goes on for :func:`grace_ns` (so it waits at most ``timeout`` plus the grace): a
    peer that arrives within it completes the call with this rank, and the word is withdrawn. On expiry
    records ``ERR_TIMEOUT``, on another signature ``ERR_MISMATCH`` (:func:`record_error`; neither when
    ``timeout`` is 0: an earlier failure's error, which names the peer really at fault, stays), and
    returns False. On a mismatch it also stores this call's flag into the peer's slots of the programs
    this launch does not have (:func:`tell_mismatch`: ``tell_idx`` the peer's slot of program 0 for this
    rank, programs up to ``pad_programs``), so that a peer whose call has more programs ends at once.
    The caller runs ``tl.debug_barrier()`` before loading the data this flag publishes.

    The loop exits the same round in every thread: Triton loads a scalar flag in one thread and
    broadcasts it through shared memory, with a barrier inside the loop, so warps leaving after different
    rounds would pair later barriers wrongly. The flag is therefore the same in every thread, and the
    time waited is the block-wide :func:`waited_ns`, read every ``CLOCK_EVERY`` rounds (a block
    reduction per round would delay the poll that sees the flag).
    """
    want = epoch.to(tl.int64) & 0xFFFFFFFF
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    start = now_ns()
    waited = start - start
    limit = timeout + grace_ns(timeout)
    told = timeout * 0
    rounds = 0
    while ((seen & 0xFFFFFFFF) != want) & (waited < limit):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        rounds += 1
        if rounds % CLOCK_EVERY == 0:
            waited = waited_ns(start)
            if (waited >= timeout) & (told == 0) & (timeout > 0):  # the slow path: tell the peer, once
                store_abort(abort_at, abort_off, abort_idx, abort_word(epoch))
                told = timeout * 0 + 1
    arrived = (seen & 0xFFFFFFFF) == want
    if arrived & (told != 0):  # arrived within the grace: withdraw the word
        store_abort(abort_at, abort_off, abort_idx, epoch.to(tl.int64) * 0)
    same_call = (seen >> 32) == signature.to(tl.int64)
    if not arrived:
        if timeout > 0:  # a wait that gave up at once follows an error already recorded: keep that one
            record_error(err_ptr, state_ptr, ERR_TIMEOUT, peer, epoch, program, signature)
    elif (not same_call) & (timeout > 0):  # timeout 0: the error recorded first stays
        record_error(err_ptr, state_ptr, ERR_MISMATCH, peer, epoch, program, signature)
        tell_mismatch(abort_at, tell_idx, tl.num_programs(0), pad_programs, flag_value(epoch, signature), WORLD)
    return arrived & same_call


@triton.jit
def signal_peers(flag_table_ptr, flag_bases, flag_off, epoch, signature, rank, WORLD: tl.constexpr):
    """Publish this program's stores to every peer: a program-wide barrier (so the release covers every
    thread's stores), then one flag per peer, in slot ``flag_off + rank`` of its signal pad
    (``flag_off`` is :func:`flag_offset` of this phase; ``flag_bases`` :func:`table_bases` of
    ``flag_table_ptr``)."""
    tl.debug_barrier()
    value = flag_value(epoch, signature)
    for q in tl.static_range(WORLD):
        if q != rank:
            send_flag(base_ptr(flag_bases, flag_table_ptr, q, tl.int64, WORLD) + flag_off + rank, value)


@triton.jit
def wait_peers(flag_table_ptr, flag_bases, flag_off, epoch, signature, rank, program, timeout, err_ptr, state_ptr,
               abort_off, pad_programs, WORLD: tl.constexpr):
    """Wait for the same program of every peer to signal this phase, then a program-wide barrier (so no
    thread reads before the wait). Returns the timeout left for later waits: ``timeout``, or 0 once a
    wait failed. ``abort_off``: int64 elements from a rank's signal pad to its state word
    (``Workspace.abort_offset("flag")``); ``pad_programs``: the signal pad's programs
    (``Workspace.pad_programs``)."""
    own = own_ptr(flag_bases, flag_table_ptr, rank, tl.int64, WORLD) + flag_off
    for q in tl.static_range(WORLD):
        if q != rank:
            ok = wait_flag(own + q, epoch, signature, q, program, timeout, err_ptr, state_ptr,
                           flag_table_ptr + q, abort_off, abort_index(abort_off, program, rank, WORLD),
                           flag_off - program * WORLD + rank, pad_programs, WORLD)
            timeout = tl.where(ok, timeout, 0)
    tl.debug_barrier()
    return timeout


@triton.jit
def exchange_flags(flag_table_ptr, flag_bases, flag_off, epoch, signature, rank, program, timeout, err_ptr, state_ptr,
                   abort_off, alive, pad_programs, WORLD: tl.constexpr):
    """:func:`signal_peers` (when ``alive``: :func:`check_abort`) then :func:`wait_peers`: publish this
    program's stores and wait for the same program of every peer. Returns the timeout left for later
    waits."""
    if alive:
        signal_peers(flag_table_ptr, flag_bases, flag_off, epoch, signature, rank, WORLD)
    return wait_peers(flag_table_ptr, flag_bases, flag_off, epoch, signature, rank, program, timeout, err_ptr,
                      state_ptr, abort_off, pad_programs, WORLD)


#: Error words (``Workspace.err``, int32): record 0 at words 0-4, ``(code, peer, epoch, program,
#: signature)`` of a timeout or an abort, and record 1 at words 5-9, of a mismatch; word 0 holds the code
#: of any error (what a call checks). A mismatch goes to its own record, so a timeout of another program
#: recorded after it never hides it: the host reports record 1 when it holds one (``Workspace.read_error``).
ERR_WORDS, MISMATCH_RECORD = 10, tl.constexpr(5)


@triton.jit
def record_error(err_ptr, state_ptr, code, peer, epoch, program, signature):
    """Write ``(code, peer, epoch, program, signature)`` to the error words (the signature names the call
    that failed, graph replays included; a mismatch to its own record, ``ERR_WORDS``), the code to word 0,
    and set ``BROKEN_BIT`` in the state word. The caller branches to it on a block-uniform value: the
    stores are thread 0's and the atomic broadcasts through a barrier."""
    at = tl.where(code == ERR_MISMATCH, MISMATCH_RECORD, 0)
    tl.store(err_ptr + at + 1, peer)
    tl.store(err_ptr + at + 2, epoch)
    tl.store(err_ptr + at + 3, program)
    tl.store(err_ptr + at + 4, signature)
    tl.store(err_ptr + at, code)
    tl.store(err_ptr, code)
    tl.atomic_or(state_ptr, BROKEN_BIT, sem="relaxed", scope="sys")


@triton.jit
def record_lanes(err_ptr, state_ptr, code, peer, failed, epoch, program, signature):
    """:func:`record_error` from the lanes where ``failed`` (``code``, ``peer``: int32 tensors of its
    shape), each lane its own stores, with no branch and no block-wide step: for a wait whose lanes finish
    independently. Lanes that record into one record at once must agree on ``peer`` (the words are stored
    one by one, the code last, and any lane's store may land last)."""
    z = peer * 0
    at = tl.where(code == ERR_MISMATCH, MISMATCH_RECORD, 0)
    tl.store(err_ptr + at + 1, peer, mask=failed)
    tl.store(err_ptr + at + 2, epoch + z, mask=failed)
    tl.store(err_ptr + at + 3, program + z, mask=failed)
    tl.store(err_ptr + at + 4, signature + z, mask=failed)
    tl.store(err_ptr + at, code, mask=failed)
    tl.store(err_ptr + z, code, mask=failed)
    tl.atomic_or(state_ptr + z, BROKEN_BIT, mask=failed, sem="relaxed", scope="sys")


@triton.jit
def record_timeout(err_ptr, state_ptr, peer, epoch, program, signature):
    """:func:`record_error` with ``ERR_TIMEOUT``."""
    record_error(err_ptr, state_ptr, ERR_TIMEOUT, peer, epoch, program, signature)


@triton.jit
def launch_timeout(word, timeout):
    """``timeout`` as int64 (Triton passes a small one as a 32-bit argument, and the waits add the grace
    to it), or 0 when an earlier wait of this communicator expired (``BROKEN_BIT`` of ``word``,
    :func:`start_program`'s state word: the same value in every thread of the program)."""
    return tl.where((word & BROKEN_BIT) != 0, 0, timeout.to(tl.int64))


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """With ``PDL`` (the launch carries programmatic dependent launch, ``Workspace.pdl``): wait until
    the previous kernel on the stream has finished and its writes are visible (``griddepcontrol.wait``:
    the epoch, the re-armed buffers, the input). Nothing without ``PDL``. A kernel reads nothing the
    previous one may write (its input, the state word, the buffers) before this; :func:`release_next`
    then lets the next kernel start launching."""
    if PDL:
        gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """With ``PDL``: let the next kernel on the stream start launching (``griddepcontrol.launch_dependents``;
    it launches once every program of this one has called this or ended, and its programs then wait in
    :func:`wait_previous`), so that its set-up overlaps the rest of this kernel. Nothing without ``PDL``.

    A program calls it after its first wait for every peer has ended, never before: the next kernel's
    programs then hold SMs only once every peer's programs of this call have started. Ranks that share
    one GPU (``tpcomm.loopback``) need that: a program released before its wait could hand an SM to the
    next kernel that a peer's program of this call still needs to start, and the call would wait for
    itself. So every rank's programs of one call, and no more, wait at once (docs/design.md, "The next
    kernel released after the first wait")."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def take_ticket(state_ptr):
    """``(epoch, ticket, word)`` of this program: the epoch of this launch, this program's place in the
    order the programs started (``0 .. num_programs - 1``; :func:`finish_program` lets the last one
    advance the epoch), and the whole state word (its flags: :func:`launch_timeout`,
    :func:`check_abort`). All three come from one 64-bit ``atomic_add`` of one start ticket on the
    state word at ``state_ptr``: the epoch a program uses and its ticket come from the same read, so
    the last starter sees every other program's read before its own, and every thread of the program
    gets the same value. The atomic's round trip overlaps the start of the program's work instead of
    following its end (docs/design.md, "Decode synchronisation"). Call it after
    :func:`wait_previous`."""
    word = tl.atomic_add(state_ptr, 1 << 32, sem="relaxed", scope="sys")
    epoch = word.to(tl.int32)
    ticket = ((word >> 32) & COUNTER_BITS).to(tl.int32)
    return epoch, ticket, word


@triton.jit
def start_program(state_ptr, num_programs, PDL: tl.constexpr):
    """:func:`wait_previous`, then :func:`take_ticket`: ``(epoch, ticket, word)``, the start of a kernel
    whose first access after the wait is the state word."""
    wait_previous(PDL)
    return take_ticket(state_ptr)


@triton.jit
def finish_program(state_ptr, epoch, ticket, num_programs):
    """The end of a program that :func:`start_program` gave ``(epoch, ticket)``: the last program to
    start resets the start counter and advances the epoch (mod 2**32, no carry into the counter) in one
    ``atomic_add`` whose result nothing waits for, leaving the flags as they are. Every other program of
    the launch has read the epoch by then (its ticket came before), no program reads it again, and the
    next launch on the stream sees the new word at the kernel boundary (after ``griddepcontrol.wait``
    with PDL), so a launch of any grid size advances the epoch exactly once."""
    if ticket == num_programs - 1:
        delta = 1 - (num_programs.to(tl.int64) << 32)
        delta = tl.where(epoch == -1, delta - (1 << 32), delta)  # 0xFFFFFFFF + 1 carries: take it back
        tl.atomic_add(state_ptr, delta, sem="relaxed", scope="sys")
