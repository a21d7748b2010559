"""Lamport one-shot all-reduce, plain or fused with residual add + RMSNorm: the data is its own flag.

Problem: as ``one_shot.py``, for small 16-bit messages where one flag round trip (a release fence that
waits for the NVLink stores, then a remote flag write, then a poll) is most of the time.

Algorithm: receive buffers hold the sentinel bit pattern 0x8000 (-0.0 in bf16 and fp16) in every element.
Program ``p`` pushes its rows into slot ``rank`` of every peer's buffer, storing +0.0 wherever the input
holds -0.0 (the sum is unchanged: the contract's accumulator starts at +0.0), so no pushed element ever
has the sentinel's bits. It then waits on its own buffer until no element of the row holds the sentinel,
sums in rank order with the same additions as every other algorithm (so the bits are the same; the
peers' rows are summed as the wait loaded them, not read again), runs ``epilogue.py``'s epilogue and
writes the sentinel back into what it read (re-arming the buffer). Rows of one tile in whole 16-byte
vectors (decode) wait in ``spin.py``: every thread spins on its own vectors in inline PTX, with no
block-wide step inside the loop, and re-arms them inside the same asm, so the kernel has no re-arm pass
and no barrier before it; a program's next row's input and residual are loaded before that row's wait.
Other rows wait with a block-wide poll per tile, read the tiles again in the epilogue and re-arm after a
barrier.

Call tags: after its rows, each program stores ``signature << 32 | (2 * epoch + 1)`` (``spin.tag_value``)
into an int64 tag of every peer, indexed by parity, program and sender, and waits for the tags its peers
sent it in the same loop as their rows. A tag of this epoch with another signature means the peer made a
different call (another op, size or dtype of the same bytes): ``ERR_MISMATCH``, or a timeout when its
program never ran, instead of wrong values. Tags carry the epoch, so they are never re-armed.

Sync protocol: no flags, no fences and no barrier across ranks: a peer's 2-byte element is either the
sentinel or the value (elements are checked one by one, so a store can't tear). Polls are volatile loads
(never cached, never hoisted), bounded by the timeout. Buffers alternate by epoch parity; two are enough,
as for ``one_shot.py``: a peer can write into the buffer of call ``e`` again only in call ``e + 2``, after
finishing call ``e + 1``, which needed this rank's call-``e + 1`` data, sent after this rank's call ``e``
(and its re-arming) had completed in stream order.

When it wins: small bf16/fp16 messages (decode); the crossover with ``one_shot.py`` is in
``tpcomm/dispatch.py``, the measurements in ``docs/design.md``. 32-bit
inputs use ``one_shot.py`` (the 16-bit sentinel has no 32-bit counterpart that no input can hold).
"""

import triton
import triton.language as tl

from .epilogue import (
    NO_QUANT,
    SUM_GIVEN,
    SUM_REDUCE,
    no_quant_args,
    preload_row,
    reduce_norm_row,
    round_to,
)
from .launch import KernelCall
from .moe import finalize_kwargs, finalize_tile
from .quant import widen
from .spin import spin_vectors, tag_low, tag_value, wait_peer, words_to_elems
from .sync import (
    ERR_MISMATCH,
    ERR_TIMEOUT,
    abort_index,
    base_ptr,
    check_abort,
    finish_program,
    grace_ns,
    launch_timeout,
    now_ns,
    own_ptr,
    record_lanes,
    release_next,
    table_bases,
    take_ticket,
    wait_previous,
)

#: The sentinel's bits, as int16: 0x8000 (-0.0 in bf16 and fp16).
SENTINEL = tl.constexpr(-32768)


@triton.jit
def _poll_tile(recv_row_ptr, slot_stride, cols, mask, tag_ptr, rank, epoch, program, signature,
               timeout, err_ptr, state_ptr, table_ptr, abort_off, tell_idx, tell_to, WORLD: tl.constexpr):
    """The block-wide wait (rows of several tiles, or not in whole 16-byte vectors): ``spin.wait_peer`` on
    every peer ``q`` in turn (its tag at ``tag_ptr + q``, this tile in its slot), each bounded by the
    timeout it starts with and its grace. Returns the timeout left for later waits: ``timeout``, or 0 once a wait
    failed (a timeout of 0 then leaves at once, and the call counts as failed whatever arrived).
    ``tell_idx``, ``tell_to``: ``spin.wait_peer``'s (the peers' tags of this rank's programs). The
    epilogue then reads the tiles again."""
    for q in tl.static_range(WORLD):
        if q != rank:  # each wait bounded by the timeout it starts with: 0 (and no grace) after a failure
            timeout, tile = wait_peer(recv_row_ptr + q * slot_stride + cols, mask, tag_ptr + q, q, rank, epoch,
                                      program, signature, timeout, timeout + grace_ns(timeout), err_ptr, state_ptr,
                                      table_ptr, abort_off, tell_idx, tell_to, SENTINEL, WORLD)
    return timeout


@triton.jit
def _spin_row(own, recv_words_ptr, slot_words, row_start, numel, H, tag_ptr, rank, epoch, program, signature,
              deadline, grace_end, tell_at, record, err_ptr, state_ptr, table_ptr, abort_off, tell_idx, tell_to,
              WORLD: tl.constexpr, BLOCK_H: tl.constexpr, REARM: tl.constexpr, DTYPE: tl.constexpr,
              PACK: tl.constexpr):
    """The wait of a row of one tile, every thread on its own 16-byte vectors (:func:`spin.spin_vectors`),
    and the row's sum ``acc``: the tile summed over the ranks in rank order in float32 from +0.0 (this
    rank's row ``own``, float32, every peer's as its spin loaded it: the additions of
    ``epilogue.reduce_tile``; -0.0 pushed as +0.0 adds the same); undefined where a wait failed.
    ``recv_words_ptr``: int32 pointer to this row in slot 0 of this rank's receive buffer;
    ``slot_words``: int32 words between slots. ``deadline`` and ``grace_end`` (``%globaltimer`` ns) are
    the call's, shared by every row of the program, so a program of many rows gives up after one
    timeout; past the deadline each spin stores this rank's abort word in the awaited peer once
    (``tell_at``: ``sync.abort_index``, or -1 to store none, the wait of a call that already failed;
    ``table_ptr``, ``abort_off``: ``sync.store_abort``), goes on until ``grace_end`` and withdraws the
    word if the vector then arrives. No block-wide step: each thread combines its own statuses (per
    vector, ``status * 256 + peer``, the largest: a peer that made another call before one that timed
    out) and, with ``record`` (no earlier failure of this call), records its own failure
    (``sync.record_lanes``); the lanes of a program see the same call tags, so they name the same
    peer and code, whatever lane's record lands last. A lane that found another call's tag also stores
    this call's tag into the awaited peer's tags of the programs this launch does not have, lane ``i``
    program ``num_programs + i`` (and on by the tile's lanes, up to ``tell_to``; ``tell_idx`` the peer's
    tag of program 0 from this rank: ``spin.wait_peer``'s tell, as masked stores with no branch), so a
    peer whose call has more programs ends at once. With ``REARM`` each thread re-armed its vectors
    inside its spin; otherwise the caller re-arms after a barrier. Requires ``H``, ``numel`` and the
    row's start to be multiples of 8 elements (whole vectors)."""
    vi = tl.arange(0, BLOCK_H // 8)
    active = (vi * 8 < H) & (row_start + vi * 8 < numel)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    want_low = tag_low(epoch)
    fault = tl.zeros([BLOCK_H // 8], dtype=tl.int32)
    for q in tl.static_range(WORLD):
        if q == rank:
            acc += own
        else:
            w0, w1, w2, w3, status = spin_vectors(recv_words_ptr + q * slot_words + vi * 4, active, tag_ptr + q,
                                                  want_low, signature, deadline, table_ptr + q, abort_off,
                                                  tell_at, epoch, grace_end, REARM, PACK)
            fault = tl.maximum(fault, tl.where(status != 0, status * 256 + q, 0))
            acc += widen(words_to_elems(w0, w1, w2, w3, DTYPE))
    # status 2 (another call's tag): ERR_MISMATCH; 1 (timed out): ERR_TIMEOUT
    code = tl.where(fault >= 512, ERR_MISMATCH, ERR_TIMEOUT)
    failed = (fault != 0) & (fault * 0 + record.to(tl.int32) != 0)  # a tensor mask (the interpreter's too)
    record_lanes(err_ptr, state_ptr, code, fault % 256, failed, epoch, program, signature)
    tell = failed & (fault >= 512)
    peer_base = tl.load(table_ptr + fault % 256, mask=tell, other=0).to(tl.pointer_type(tl.int64))
    tag = tag_value(epoch, signature) + vi.to(tl.int64) * 0
    for p0 in range(tl.num_programs(0), tell_to, BLOCK_H // 8):
        p = p0 + vi
        tl.store(peer_base + tell_idx + p.to(tl.int64) * WORLD, tag, mask=tell & (p < tell_to))
    return acc


@triton.jit(do_not_specialize=["rank"])  # one binary for every rank (tpcomm.loopback)
def _lamport_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr, s_row_stride, s_group_stride,
                    in_scale_ptr, buf_table_ptr, state_ptr, err_ptr,
                    n_rows, H, numel, row_stride, slot_stride, parity_stride,
                    eps, timeout, rank, signature, tag_off, max_programs, abort_off,
                    e_ptr, idx_ptr, tw_ptr, sh_ptr, K, n_expert_rows, scaling,
                    WORLD: tl.constexpr, BLOCK_H: tl.constexpr, NUM_TILES: tl.constexpr,
                    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
                    QUANT: tl.constexpr, STORE_OUT: tl.constexpr, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr,
                    GROUP: tl.constexpr, PDL: tl.constexpr, VECTORS: tl.constexpr, REARM_IN_SPIN: tl.constexpr,
                    PREFETCH: tl.constexpr, SPIN_PACK: tl.constexpr,
                    FINALIZE: tl.constexpr, INDEXED: tl.constexpr, HAS_SHARED: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    bases = table_bases(buf_table_ptr, WORLD)  # before the start atomic: their latencies overlap
    offs = tl.arange(0, BLOCK_H)
    wait_previous(PDL)
    # Rows of one tile: the first row's input, loaded before the start atomic as well (it is pushed as
    # soon as the epoch is known, and is the wait's own term).
    ONE_TILE: tl.constexpr = NUM_TILES == 1
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    # With FINALIZE this rank's rows are made from its expert outputs (kernels/moe.py), never read from x;
    # without the spin's own term (VECTORS), each is kept in this rank's own slot for the epilogue.
    STAGED: tl.constexpr = FINALIZE and not VECTORS
    if FINALIZE and ONE_TILE:
        first = finalize_tile(e_ptr, idx_ptr, tw_ptr, sh_ptr, pid, pid < n_rows, K, n_expert_rows, scaling, H,
                              offs, offs < H, INDEXED, HAS_SHARED, DTYPE)
    elif ONE_TILE:
        first = tl.load(x_ptr + pid * H + offs, mask=(offs < H) & (pid * H + offs < numel), other=0.0)
    else:
        first = offs
    epoch, ticket, word = take_ticket(state_ptr)
    timeout = launch_timeout(word, timeout)
    alive = check_abort(state_ptr, word, rank, epoch, pid, signature, err_ptr, timeout, WORLD)
    timeout = tl.where(alive, timeout, 0)
    par = epoch & 1

    # 1. Push, -0.0 stored as +0.0 so no element carries the sentinel.
    for row in range(pid, n_rows, num_programs):
        row_start = row * H
        dst_off = par * parity_stride + rank * slot_stride + row * row_stride
        for t in tl.static_range(NUM_TILES):
            cols = t * BLOCK_H + offs
            mask = (cols < H) & (row_start + cols < numel)
            if FINALIZE and ONE_TILE:  # the first row was made before the start atomic
                v = tl.where(row == pid, first, finalize_tile(e_ptr, idx_ptr, tw_ptr, sh_ptr, row, row != pid, K,
                                                              n_expert_rows, scaling, H, cols, mask, INDEXED,
                                                              HAS_SHARED, DTYPE))
            elif FINALIZE:
                v = finalize_tile(e_ptr, idx_ptr, tw_ptr, sh_ptr, row, row < n_rows, K, n_expert_rows, scaling, H,
                                  cols, mask, INDEXED, HAS_SHARED, DTYPE)
            elif ONE_TILE:
                v = tl.where(row == pid, first, tl.load(x_ptr + row_start + cols, mask=mask & (cols * 0 + row != pid)))
            else:
                v = tl.load(x_ptr + row_start + cols, mask=mask)
            if STAGED:  # re-armed with the peers' tiles after the epilogue
                tl.store(own_ptr(bases, buf_table_ptr, rank, DTYPE, WORLD) + dst_off + cols, v, mask=mask)
            bits = v.to(tl.int16, bitcast=True)
            bits = tl.where(bits == SENTINEL, 0, bits).to(tl.int16)
            for q in tl.static_range(WORLD):
                if q != rank:
                    dst = base_ptr(bases, buf_table_ptr, q, tl.int16, WORLD)
                    tl.store(dst + dst_off + cols, bits, mask=mask)
    # ... and this program's call tag (signature and epoch) into each peer's tag [par][pid][rank]: not when
    # a peer gave up on this call (check_abort), so that no peer completes it.
    tag_idx = tag_off + (par * max_programs + pid) * WORLD
    tell_idx = tag_idx - pid * WORLD + rank  # a peer's tag of program 0 from this rank (a mismatch's tell)
    tag = tag_value(epoch, signature)
    if alive:
        for q in tl.static_range(WORLD):
            if q != rank:
                tl.store(base_ptr(bases, buf_table_ptr, q, tl.int64, WORLD) + tag_idx + rank, tag)

    # The first row's residual and the weight, loaded now so that their latency hides under the wait.
    PRELOAD: tl.constexpr = NORM and NUM_TILES == 1
    SUM_FROM: tl.constexpr = SUM_GIVEN if VECTORS else SUM_REDUCE
    if PRELOAD:
        res_pre, w_pre = preload_row(res_ptr + pid * H, w_ptr, pid * H, numel, H, BLOCK_H, HAS_RESIDUAL)
    else:
        res_pre, w_pre = offs, offs

    # 2. Per row: wait for every peer's tiles and call tag, reduce + epilogue, re-arm the tiles read
    #    (inside the wait with REARM_IN_SPIN: no barrier).
    tags = own_ptr(bases, buf_table_ptr, rank, tl.int64, WORLD) + tag_idx
    recv = own_ptr(bases, buf_table_ptr, rank, x_ptr.dtype.element_ty, WORLD) + par * parity_stride
    recv_bits = own_ptr(bases, buf_table_ptr, rank, tl.int16, WORLD) + par * parity_stride
    recv_words = own_ptr(bases, buf_table_ptr, rank, tl.int32, WORLD) + par * (parity_stride // 2)
    if VECTORS:  # this rank's first row (-0.0 or +0.0 adds the same to a sum that is never -0.0)
        own = widen(first)
        deadline = now_ns() + timeout  # the call's: every row's wait ends by it
        grace_end = deadline + grace_ns(timeout)
        tell_at = tl.where(timeout > 0, abort_index(abort_off, pid, rank, WORLD), -1)  # -1: tell no peer
    else:
        own = offs.to(tl.float32)
    for row in range(pid, n_rows, num_programs):
        row_start = row * H
        if VECTORS:  # one tile, every thread on its own 16-byte vectors
            acc = _spin_row(own, recv_words + row * (row_stride // 2), slot_stride // 2, row_start, numel, H,
                            tags, rank, epoch, pid, signature, deadline, grace_end, tell_at, timeout > 0,
                            err_ptr, state_ptr, buf_table_ptr, abort_off, tell_idx, max_programs, WORLD, BLOCK_H,
                            REARM_IN_SPIN,
                            x_ptr.dtype.element_ty, SPIN_PACK)
            s_pre = round_to(acc, x_ptr.dtype.element_ty)
        elif NUM_TILES == 1:  # rows not in whole vectors: a block-wide poll; the epilogue reads the tile again
            mask = (offs < H) & (row_start + offs < numel)
            timeout = _poll_tile(recv + row * row_stride, slot_stride, offs, mask, tags, rank, epoch, pid,
                                 signature, timeout, err_ptr, state_ptr, buf_table_ptr, abort_off, tell_idx,
                                 max_programs, WORLD)
            s_pre = offs
        else:  # rows of several tiles read them again
            for t in tl.static_range(NUM_TILES):
                cols = t * BLOCK_H + offs
                mask = (cols < H) & (row_start + cols < numel)
                timeout = _poll_tile(recv + row * row_stride, slot_stride, cols, mask, tags, rank, epoch, pid,
                                     signature, timeout, err_ptr, state_ptr, buf_table_ptr, abort_off, tell_idx,
                                     max_programs, WORLD)
            s_pre = offs
        if row == pid:  # the first row's wait has ended: every peer's programs of this call have started
            release_next(PDL)
        if STAGED:
            x_row = recv + rank * slot_stride + row * row_stride
        else:
            x_row = x_ptr + row_start
        reduce_norm_row(x_row, recv + row * row_stride, slot_stride,
                        res_ptr + row_start, res_out_ptr + row_start, w_ptr, out_ptr + row_start,
                        q_ptr + row_start, s_ptr + row * s_row_stride, s_group_stride, in_scale_ptr,
                        row_start, numel, H, eps, rank, res_pre, w_pre, (row == pid) | PREFETCH, s_pre,
                        WORLD, BLOCK_H, NUM_TILES, NORM, HAS_RESIDUAL, GEMMA, SUM_FROM,
                        QUANT, STORE_OUT, FP8, NATIVE_FP8, GROUP, PRELOAD)
        if VECTORS:  # the next row of this program: its own input and residual, before its wait
            nxt = row_start + num_programs * H
            nmask = (offs < H) & (nxt + offs < numel)
            if FINALIZE:
                own = widen(finalize_tile(e_ptr, idx_ptr, tw_ptr, sh_ptr, row + num_programs,
                                          row + num_programs < n_rows, K, n_expert_rows, scaling, H, offs,
                                          offs < H, INDEXED, HAS_SHARED, DTYPE))
            else:
                own = widen(tl.load(x_ptr + nxt + offs, mask=nmask, other=0.0))
            if PREFETCH:
                res_pre = tl.load(res_ptr + nxt + offs, mask=nmask, other=0.0)
        if not REARM_IN_SPIN:
            tl.debug_barrier()
            for t in tl.static_range(NUM_TILES):
                cols = t * BLOCK_H + offs
                mask = (cols < H) & (row_start + cols < numel)
                for q in tl.static_range(WORLD):
                    if q != rank:
                        tl.store(recv_bits + q * slot_stride + row * row_stride + cols,
                                 tl.full([BLOCK_H], SENTINEL, tl.int16), mask=mask)
                if STAGED:
                    tl.store(recv_bits + rank * slot_stride + row * row_stride + cols,
                             tl.full([BLOCK_H], SENTINEL, tl.int16), mask=mask)

    finish_program(state_ptr, epoch, ticket, num_programs)


def lamport_call(x, out, residual, residual_out, weight, ws, n_rows: int, H: int, eps: float,
                 cfg, norm: bool, gemma: bool, signature: int, quant=None, moe=None) -> KernelCall:
    """The launch of the Lamport kernel on rows ``[0, n_rows)``; arguments as :func:`one_shot.one_shot_call`.

    ``x`` must be bf16 or fp16 and ``n_rows`` rows must fit one Lamport slot
    (:meth:`~tpcomm.workspace.Workspace.lamport_rows_per_launch`).
    """
    if n_rows < 1:  # a program without rows would send its call tags and wait for none
        raise ValueError(f"lamport: n_rows must be >= 1, got {n_rows}")
    has_res = residual is not None
    # Whole 16-byte vectors per thread (spin.py) for rows of one tile in whole vectors; the vectors are
    # re-armed inside the wait when no lane of the tile is replicated over threads.
    vectors = cfg.num_tiles == 1 and H % 8 == 0 and x.numel() % 8 == 0
    rearm_in_spin = vectors and cfg.block_h // 8 >= 32 * cfg.num_warps
    # Two vectors a thread or more (an even count): spun in pairs, both loads in one round.
    spin_pack = 2 if vectors and cfg.block_h // 8 >= 2 * 32 * cfg.num_warps else 1
    return KernelCall(_lamport_kernel, cfg.grid(n_rows), (
        x, residual if has_res else x, weight if weight is not None else x, out,
        residual_out if has_res else out, *(quant.kernel_args() if quant else no_quant_args(out)),
        ws.lamport_table, ws.state, ws.err,
        n_rows, H, x.numel(), ws.row_stride(H, 2), ws.lamport_slot_bytes // 2,
        ws.world_size * ws.lamport_slot_bytes // 2,
        eps, ws.timeout, ws.rank, signature, ws.tag_offset(), ws.max_programs, ws.abort_offset("lamport"),
    ), dict(
        WORLD=ws.world_size, BLOCK_H=cfg.block_h, NUM_TILES=cfg.num_tiles, NORM=norm,
        HAS_RESIDUAL=has_res, GEMMA=gemma, **(quant.constexprs() if quant else NO_QUANT),
        VECTORS=vectors, REARM_IN_SPIN=rearm_in_spin,
        PREFETCH=vectors and has_res and norm, SPIN_PACK=spin_pack, **finalize_kwargs(moe),
        num_warps=cfg.num_warps, enable_fp_fusion=False, **ws.launch_options(),
    ))
