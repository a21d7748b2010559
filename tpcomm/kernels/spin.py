"""Per-thread Lamport waits: each thread spins on its own 16-byte vectors, with no block-wide step inside
the loop.

Problem: a Lamport receive buffer holds the sentinel 0x8000 in every 16-bit element until a peer's value
lands there. A wait written in Triton's block-level language needs one scalar loop condition, so every
round of its poll ends in a block-wide reduction (a barrier and a shared-memory pass) before the next
load can issue; at decode sizes that round is most of the wait.

Mechanism: :func:`spin_vectors` is one inline-PTX loop per thread over its 16-byte vectors, one or two
(``PACK``; :func:`_spin_asm`). Each round loads the vectors (``ld.volatile.global.v4.b32``, all issued
before any is used, so a second vector costs no round trip of its own) and the sender's 64-bit call tag,
and goes round again while any 16-bit half holds the sentinel or the tag's low word is not this call's,
until ``%globaltimer`` passes the deadline, or the tag is this epoch's with another call's signature.
Past the deadline the thread stores this rank's abort word in the awaited peer and sets its notified flag
(``sync.store_abort``: the peer's base read from its table entry, only then) and spins on until the
grace ends (``sync.grace_ns``). Each vector's words and a status come back: 0 arrived, 1
timed out, 2 another call's tag (at once, whatever arrived). Each thread combines and records its own
statuses after the loops, with no block-wide step (``lamport._spin_row``; timings:
docs/design.md, "Decode synchronisation").
With ``REARM``, the thread then stores the sentinel into the vector it read, inside the same asm: no
other thread reads that vector (the caller guarantees one thread per vector: no replicated layout), so
re-arming needs no barrier.

Call tags: ``tag = signature << 32 | (2 * epoch + 1 mod 2**32)`` (:func:`tag_value`), stored by a sending
program after its data into ``[parity][program][sender]`` of each peer. The low word is odd, so the
buffers' initial fill (0x8000 halves, an even low word) never matches; two calls of one parity are two
epochs apart, so a stale tag matches only after 2**31 calls (docs/reliability.md, after the fault
table), and tags are never re-armed.

Under Triton's interpreter (no PTX) :func:`spin_vectors` is a twin with the same results: the whole
tile is polled with volatile loads until nothing is missing or the host clock passes the deadline (one
thread runs a program there, so a block-wide condition is that thread's own).

The block-wide wait, for tiles not in whole vectors per thread (rows of several tiles; the QK norm's
float32 words): :func:`wait_peer`, one peer at a time, each round decided by ``sync.block_code`` (an OR
over every thread through shared memory), so every branch in and after its loop is block-uniform.
"""

import triton
import triton.language as tl

from ..env import interpreter_enabled
from .sync import (
    ERR_MISMATCH,
    NOTIFIED_FLAG,
    WAIT_DATA,
    WAIT_EXPIRED,
    WAIT_LATE,
    WAIT_OTHER,
    WAIT_TAG,
    abort_index,
    abort_word,
    bit_or,
    block_code,
    now_ns,
    record_error,
    record_timeout,
    store_abort,
    tell_mismatch,
)

#: Two sentinels in one 32-bit word: the re-armed state of a Lamport vector.
SENTINEL_WORD = tl.constexpr(-2147450880)  # 0x80008000

def _spin_asm(n: int, rearm: bool) -> str:
    """The PTX of the spin over ``n`` (1 or 2) vectors of one thread at once (``pack=n``: operand ``k`` of
    element ``e`` is ``$(k * n + e)``). Outputs: the vectors' words (w0-w3) and a status per vector;
    inputs: the vector's address, the tag's address, the tag's expected low word, the deadline
    (``%globaltimer`` ns), active (0: skip, zeros), the signature (the tag's expected high word), the
    address of the awaited peer's entry in the address table, the byte offset of its abort word for
    this rank (negative: store none, the wait of a timeout of 0), the abort word, the end of the grace,
    the byte offset of the peer's state word; all but the address and active are the same for the
    ``n`` vectors (one peer), and are read from the first. All vectors' loads and the tag's are issued
    together every round, so a second vector costs no round trip of its own. Past the deadline the word
    is stored once (%told), then the peer's ``sync.NOTIFIED_BIT`` set (a release), and the word
    withdrawn (0 stored) if the vectors then arrive. The tag is read as one 64-bit access (no torn
    read); a tag of this epoch with another signature ends the spin at once (status 2, nothing
    re-armed). A vector that has arrived is not loaded again. Outputs are early-clobber (``=&r``): they are
    written while the inputs are still read."""
    out = lambda k, e: f"${k * n + e}"  # noqa: E731
    inp = lambda k, e=0: f"${5 * n + k * n + e}"  # noqa: E731
    es = range(n)
    lines = ["{", ".reg .pred %pm, %pt, %pa<2>, %pp<2>;", ".reg .b32 %h, %tl, %th, %told;",
             ".reg .u64 %now, %tag, %a, %s;"]
    lines += [f"mov.b32 {out(k, e)}, 0;" for e in es for k in range(5)] + ["mov.b32 %told, 0;"]
    lines += [f"setp.ne.s32 %pa{e}, {inp(4, e)}, 0; mov.pred %pp{e}, %pa{e};" for e in es]
    lines += ["mov.pred %pm, %pa0;"] + [f"or.pred %pm, %pm, %pa{e};" for e in es if e] + ["@!%pm bra DONE;", "SPIN:"]
    # %pp{e}: vector e still holds a sentinel half, so it is loaded again (a vector that has arrived does
    # not change until it is re-armed); an inactive vector's words stay 0, no sentinel half
    lines += [f"@%pp{e} ld.volatile.global.v4.b32 {{{', '.join(out(k, e) for k in range(4))}}}, [{inp(0, e)}];"
              for e in es]
    lines += [f"ld.volatile.global.u64 %tag, [{inp(1)}];", "mov.b64 {%tl, %th}, %tag;",
              f"setp.eq.u32 %pt, %tl, {inp(2)};", f"setp.ne.and.u32 %pt, %th, {inp(5)}, %pt;", "@%pt bra OTHER;",
              f"setp.ne.u32 %pm, %tl, {inp(2)};"]
    for e in es:
        for k in range(4):
            first = "setp.eq.u32 %pt, %h, 32768;" if k == 0 else "setp.eq.or.u32 %pt, %h, 32768, %pt;"
            lines += [f"and.b32 %h, {out(k, e)}, 65535; {first}",
                      f"shr.u32 %h, {out(k, e)}, 16; setp.eq.or.u32 %pt, %h, 32768, %pt;"]
        lines += [f"mov.pred %pp{e}, %pt; or.pred %pm, %pm, %pt;"]
    lines += ["@!%pm bra ARRIVED;", "mov.u64 %now, %globaltimer;", f"setp.lt.u64 %pt, %now, {inp(3)};",
              "@%pt bra SPIN;", "setp.ne.u32 %pt, %told, 0;", f"setp.lt.or.s64 %pt, {inp(7)}, 0, %pt;",
              "@%pt bra GRACE;", f"ld.global.u64 %a, [{inp(6)}];", f"add.u64 %s, %a, {inp(10)};",
              f"add.u64 %a, %a, {inp(7)};", f"st.global.u64 [%a], {inp(8)};",
              f"mov.u64 %tag, {NOTIFIED_FLAG};", "red.release.sys.global.or.b64 [%s], %tag;", "mov.b32 %told, 1;",
              "GRACE:", f"setp.lt.u64 %pt, %now, {inp(9)};", "@%pt bra SPIN;"]
    lines += [f"selp.b32 {out(4, e)}, 1, 0, %pa{e};" for e in es] + ["bra DONE;", "OTHER:"]
    lines += [f"selp.b32 {out(4, e)}, 2, 0, %pa{e};" for e in es] + ["bra DONE;", "ARRIVED:",
              "setp.eq.u32 %pt, %told, 0;", "@%pt bra ARMED;", "mov.u64 %tag, 0;", "st.global.u64 [%a], %tag;",
              "ARMED:"]
    if rearm:
        lines += ["mov.b32 %h, -2147450880;"]
        lines += [f"@%pa{e} st.global.v4.b32 [{inp(0, e)}], {{%h, %h, %h, %h}};" for e in es]
    lines += ["DONE:", "}"]
    return "\n".join(lines)


def _constraints(n: int) -> str:
    """The operand constraints of :func:`_spin_asm` for ``n`` vectors (outputs early-clobber)."""
    kinds = ["l", "l", "r", "l", "r", "r", "l", "l", "l", "l", "l"]
    return ",".join(["=&r"] * (5 * n) + [k for k in kinds for _ in range(n)])


#: The spins of one and of two vectors a thread, re-arming what they read or leaving it, and their
#: constraint strings.
SPIN_REARM = tl.constexpr(_spin_asm(1, True))
SPIN_KEEP = tl.constexpr(_spin_asm(1, False))
SPIN2_REARM = tl.constexpr(_spin_asm(2, True))
SPIN2_KEEP = tl.constexpr(_spin_asm(2, False))
SPIN_CONSTRAINTS = tl.constexpr(_constraints(1))
SPIN2_CONSTRAINTS = tl.constexpr(_constraints(2))


@triton.jit
def tag_value(epoch, signature):
    """The int64 call tag of ``epoch`` and ``signature`` (module docstring)."""
    low = ((epoch.to(tl.int64) * 2 + 1) & 0xFFFFFFFF)
    return (signature.to(tl.int64) << 32) | low


@triton.jit
def tag_low(epoch):
    """The low word a tag of ``epoch`` carries, as int32 (for the comparison in :func:`spin_vectors`)."""
    return ((epoch.to(tl.int64) * 2 + 1) & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)


if interpreter_enabled():
    @triton.jit
    def spin_vectors(words_ptr, active, tag_ptr, want_low, signature, deadline, abort_at, abort_off, abort_idx,
                     epoch, grace_end, REARM: tl.constexpr, PACK: tl.constexpr = 1):
        """The interpreter's twin of the PTX spin (module docstring): ``words_ptr`` int32 pointers to
        each vector's first word, ``[V]``; ``active`` ``[V]`` bool; ``tag_ptr`` the sender's int64 tag.
        Returns ``(w0, w1, w2, w3, status)``, each ``[V]`` int32. ``PACK`` changes nothing here: the
        twin polls the whole tile each round."""
        tag, w0, w1, w2, w3, missing = _poll(words_ptr, active, tag_ptr, want_low)
        now = now_ns()
        told = now * 0
        while ((tl.max(missing.to(tl.int32), axis=0) > 0) & (now < grace_end)
               & (_other_call(tag, want_low, signature) == 0)):
            if (now >= deadline) & (told == 0) & (abort_idx >= 0):
                store_abort(abort_at, abort_off, abort_idx, abort_word(epoch))
                told = now * 0 + 1
            tag, w0, w1, w2, w3, missing = _poll(words_ptr, active, tag_ptr, want_low)
            now = now_ns()
        if (told != 0) & (tl.max(missing.to(tl.int32), axis=0) == 0):  # arrived within the grace
            store_abort(abort_at, abort_off, abort_idx, now * 0)
        status = tl.where(active & _other_call(tag, want_low, signature), 2, tl.where(missing, 1, 0))
        if REARM:
            arrived = active & (status == 0)
            for k in tl.static_range(4):
                tl.store(words_ptr + k, tl.full(w0.shape, SENTINEL_WORD, tl.int32), mask=arrived)
        return w0, w1, w2, w3, status

    @triton.jit
    def _has_sentinel(w):
        return ((w & 0xFFFF) == 0x8000) | (((w >> 16) & 0xFFFF) == 0x8000)

    @triton.jit
    def _poll(words_ptr, active, tag_ptr, want_low):
        """One round of the twin: the tag, the four words of every vector, and which are missing."""
        tag = tl.load(tag_ptr, volatile=True)
        w0 = tl.load(words_ptr, mask=active, other=0, volatile=True)
        w1 = tl.load(words_ptr + 1, mask=active, other=0, volatile=True)
        w2 = tl.load(words_ptr + 2, mask=active, other=0, volatile=True)
        w3 = tl.load(words_ptr + 3, mask=active, other=0, volatile=True)
        return tag, w0, w1, w2, w3, _missing(w0, w1, w2, w3, active, tag, want_low)

    @triton.jit
    def _other_call(tag, want_low, signature):
        """This epoch's tag with another call's signature."""
        return (_low_word(tag) == want_low) & ((tag >> 32).to(tl.int32) != signature)

    @triton.jit
    def _low_word(tag):
        """The tag's low 32 bits as int32 (what :func:`tag_low` gives)."""
        return (tag & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)

    @triton.jit
    def _missing(w0, w1, w2, w3, active, tag, want_low):
        low = _low_word(tag)
        data = _has_sentinel(w0) | _has_sentinel(w1) | _has_sentinel(w2) | _has_sentinel(w3)
        return active & (data | (low != want_low))
else:
    @triton.jit
    def spin_vectors(words_ptr, active, tag_ptr, want_low, signature, deadline, abort_at, abort_off, abort_idx,
                     epoch, grace_end, REARM: tl.constexpr, PACK: tl.constexpr = 1):
        """Spin until the 16-byte vector at each of ``words_ptr`` (int32 pointers, ``[V]``, 16-byte
        aligned) holds no sentinel and the tag at ``tag_ptr`` (the sender's, int64) carries ``want_low``
        (:func:`tag_low`), or ``%globaltimer`` passes ``grace_end``; past ``deadline`` the thread stores
        :func:`~tpcomm.kernels.sync.abort_word` of ``epoch`` in the peer whose base address is at
        ``abort_at``, ``abort_idx`` int64 elements on, and sets the notified flag of its state word,
        ``abort_off`` elements on. Lanes where ``active`` is False skip.
        Returns ``(w0, w1, w2, w3, status)``, each ``[V]`` int32 (module docstring). One thread per
        vector when ``REARM`` (the caller's layout has no replicated lanes); ``PACK=2`` spins a thread's
        two vectors together (the caller's layout gives every thread an even count)."""
        addr = words_ptr.to(tl.int64)
        zero = (addr * 0).to(tl.int32)
        args = [addr, tag_ptr.to(tl.int64) + addr * 0, want_low + zero, deadline + addr * 0,
                active.to(tl.int32), signature + zero, abort_at.to(tl.int64) + addr * 0,
                abort_idx.to(tl.int64) * 8 + addr * 0, abort_word(epoch) + addr * 0, grace_end + addr * 0,
                abort_off.to(tl.int64) * 8 + addr * 0]
        asm: tl.constexpr = ((SPIN2_REARM if REARM else SPIN2_KEEP) if PACK == 2
                             else (SPIN_REARM if REARM else SPIN_KEEP))
        constraints: tl.constexpr = SPIN2_CONSTRAINTS if PACK == 2 else SPIN_CONSTRAINTS
        i32 = tl.int32
        w0, w1, w2, w3, status = tl.inline_asm_elementwise(asm, constraints, args, dtype=(i32, i32, i32, i32, i32),
                                                           is_pure=False, pack=PACK)
        return w0, w1, w2, w3, status


@triton.jit
def words_to_elems(w0, w1, w2, w3, DTYPE: tl.constexpr):
    """The eight 16-bit elements of each vector ``(w0, w1, w2, w3)`` (``[V]`` int32, little-endian) as one
    ``[8 V]`` tensor of ``DTYPE`` in memory order."""
    words = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [V, 2, 2]: [v, i, k] = w_(2i + k)
    V: tl.constexpr = w0.shape[0]
    words = tl.reshape(words, [4 * V])
    halves = tl.join(words & 0xFFFF, (words >> 16) & 0xFFFF)  # [4V, 2]: [j, h] = half h of word j
    bits = tl.reshape(halves, [8 * V]).to(tl.int16)
    return bits.to(DTYPE, bitcast=True)


@triton.jit
def _poll_code(p, mask, tag_ptr, want_low, signature, SENTINEL_BITS: tl.constexpr):
    """One round of :func:`wait_peer`: ``(code, tile)``, the tile as this thread loaded it and the OR over
    its lanes of ``sync.WAIT_DATA`` (the lane holds the sentinel), with ``WAIT_TAG`` (this thread's load
    of the tag is not of this epoch) or ``WAIT_OTHER`` (this epoch with another signature). A tile
    narrower than the program is replicated over warps and each warp reduces its own copy, so ``code``
    is this thread's view; :func:`sync.block_code` makes it the block's."""
    seen = tl.load(tag_ptr, volatile=True)
    low = (seen & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)
    tile = tl.load(p, mask=mask, other=0, volatile=True)
    if tile.dtype.primitive_bitwidth == 16:
        bits = tile.to(tl.int16, bitcast=True)
    else:
        bits = tile.to(tl.int32, bitcast=True)
    data = tl.reduce(tl.where(bits == SENTINEL_BITS, WAIT_DATA, 0), 0, bit_or)
    other = ((seen >> 32).to(tl.int32) != signature) & (low == want_low)
    return data | tl.where(low != want_low, WAIT_TAG, 0) | tl.where(other, WAIT_OTHER, 0), tile


@triton.jit
def wait_peer(p, mask, tag_ptr, q, rank, epoch, program, signature, timeout, limit, err_ptr, state_ptr, table_ptr,
              abort_off, tell_idx, tell_to, SENTINEL_BITS: tl.constexpr, WORLD: tl.constexpr):
    """The block-wide Lamport wait on one peer ``q``: spin until this program's call tag from ``q``
    (``tag_ptr``) carries this epoch and no element of the tile at ``p`` (where ``mask``; 16- or 32-bit
    elements, compared by their bits with ``SENTINEL_BITS``) holds the sentinel, at most ``limit`` ns (the
    timeout and its grace). A tag of this epoch with another signature ends the wait at once, records
    ``ERR_MISMATCH`` and stores this call's tag into ``q``'s tags of the programs this launch does not
    have (``sync.tell_mismatch``: ``tell_idx`` the peer's tag of program 0 from this rank, programs up to
    ``tell_to``); an expired wait records ``ERR_TIMEOUT``. Returns ``(timeout, tile)``: the timeout left
    for later waits (``timeout``, or 0 once a wait failed) and the tile as the last round loaded it
    (every thread's lanes arrived when the wait succeeded).

    Every decision is the block's: each round ends in ``sync.block_code``, the OR over every thread of
    what it loaded and of its own clock, through shared memory, so the loop's exit, the abort store (a
    release whose barrier every thread reaches) and the error records are block-uniform branches, whatever
    the tile's width (the QK norm's two float32 words are replicated over warps). A timeout of 0 (an
    earlier wait failed) records nothing more (the error recorded first stays). Past the timeout the
    program stores this rank's abort word in ``q`` once (``sync.store_abort``: ``table_ptr`` the address
    table, ``abort_off`` the place of a rank's state word from its base), the wait goes on for the grace
    (``sync.grace_ns``), and the word is withdrawn when the peer arrives within the grace."""
    want_low = tag_low(epoch)
    abort_idx = abort_index(abort_off, program, rank, WORLD)
    start = now_ns()
    code, tile = _poll_code(p, mask, tag_ptr, want_low, signature, SENTINEL_BITS)
    code = block_code(code, start, timeout, limit)
    told = code * 0
    while ((code & (WAIT_DATA | WAIT_TAG)) != 0) & ((code & (WAIT_EXPIRED | WAIT_OTHER)) == 0):
        if ((code & WAIT_LATE) != 0) & (timeout > 0) & (told == 0):  # the slow path: tell the peer, once
            store_abort(table_ptr + q, abort_off, abort_idx, abort_word(epoch))
            told = code * 0 + 1
        code, tile = _poll_code(p, mask, tag_ptr, want_low, signature, SENTINEL_BITS)
        code = block_code(code, start, timeout, limit)
    other = (code & WAIT_OTHER) != 0
    missing = (code & (WAIT_DATA | WAIT_TAG)) != 0
    if (not missing) & (not other) & (told != 0):  # arrived within the grace: withdraw the word
        store_abort(table_ptr + q, abort_off, abort_idx, epoch.to(tl.int64) * 0)
    if other & (timeout > 0):  # a mismatch wins over a timeout; timeout 0: an earlier error is recorded
        record_error(err_ptr, state_ptr, ERR_MISMATCH, q, epoch, program, signature)
        tell_mismatch(table_ptr + q, tell_idx, tl.num_programs(0), tell_to, tag_value(epoch, signature), WORLD)
    elif missing & (timeout > 0):
        record_timeout(err_ptr, state_ptr, q, epoch, program, signature)
    return tl.where(missing | other | (timeout == 0), 0, timeout), tile
