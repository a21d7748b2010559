"""Two-shot all-reduce (plain or fused with residual add + RMSNorm) and reduce-scatter.

Problem: ``out = rms_norm(all_reduce(x) + residual, w, eps)`` (or the plain ``all_reduce(x)``) for
large ``(T, H)`` messages, where one-shot's ``(W - 1) * n`` bytes sent per rank and ``W * n`` bytes summed
per rank cost more than two steps; and ``reduce_scatter(x)``, which is two-shot's first half.

Algorithm: the rows are cut into ``W`` shares the way ``torch.tensor_split`` cuts them (share ``o`` is
rows ``[start_o, start_o + len_o)``; the first ``T % W`` shares have one row more). Rank ``o`` owns share
``o``. Program ``p`` handles local row ``j`` of every share for ``j = p, p + G, ...``:

  1. scatter: push row ``j`` of share ``o`` into slot ``rank`` (first half) of rank ``o``'s receive
     buffer, for every peer ``o``; exchange phase-0 flags with the same program of every peer;
  2. reduce: sum row ``j`` of its own share in rank order (:func:`epilogue.reduce_tile`, own row read in
     place), round it to the input dtype: this is the contract's ``s``. It is stored into this rank's
     ``out`` (the result of a reduce-scatter, which is then done, and of a plain all-reduce) and into
     the second half of slot ``rank`` of every peer's buffer; then phase-1 flags are sent;
  3. epilogue: first, while the peers' sums travel, the fused epilogue of this rank's own rows from
     ``s`` in ``out`` (in place); then, once the peers' phase-1 flags have arrived, for every peer's
     share ``o`` load ``s`` of row ``j`` from the second half of slot ``o`` and run the same epilogue
     as every algorithm (``reduce_norm_row`` with ``SUM_LOAD``): the residual add and the norm run
     on every rank, with its own residual, exactly as in one-shot.

Each rank sends ``2 (W - 1) / W * n`` bytes and sums ``n`` bytes (one-shot: ``(W - 1) * n`` and
``W * n``). ``s`` is computed by the same code as in one-shot and Lamport and travels in the input dtype,
so every output has the same bits as theirs.

Why shares of rows and not of hidden columns: the norm needs a whole row, and a row split into column
shares would need a third exchange (the partial sums of squares) or a norm on the owner that needs the
peer's residual; with row shares a row's epilogue reads only gathered rows. Rows also keep every push a
contiguous run of ``H`` elements (16-byte vectors). The cost is idle ranks when ``T < W``: the dispatch
never picks two-shot there (one row is at most ``H`` elements, which one-shot or Lamport send faster).

Sync protocol: as ``one_shot.py`` (``sync.exchange_flags``), twice per launch, with the phase in the flag's
index: phase 0 publishes the scattered rows, phase 1 the gathered sums. A program waits only for the same
program index of its peers. Two parities suffice for the same reason as in one-shot.

Buffers: per parity, slot ``q``'s first half holds the rows rank ``q`` pushed (``J`` rows, ``J`` the local
rows of this launch), its second half the reduced rows of share ``q``; so a launch carries at most
``Workspace.share_rows_per_launch`` local rows per share, and larger messages run in chunks of local rows.

When it wins: large messages; the crossover table is in ``tpcomm/dispatch.py``, the measurements in
``docs/design.md``.
"""

import triton
import triton.language as tl

from .epilogue import NO_QUANT, SUM_LOAD, no_quant_args, reduce_norm_row, reduce_tile, round_to
from .launch import KernelCall
from .sync import (
    base_ptr,
    check_abort,
    exchange_flags,
    finish_program,
    flag_offset,
    launch_timeout,
    own_ptr,
    release_next,
    signal_peers,
    start_program,
    table_bases,
    wait_peers,
)


@triton.jit
def share_start(o, n_rows, WORLD: tl.constexpr):
    """First row of share ``o`` of ``n_rows`` rows (``torch.tensor_split``'s cut)."""
    base = n_rows // WORLD
    extra = n_rows % WORLD
    return o * base + tl.where(o < extra, o, extra)  # (n_rows may arrive as a constexpr: no .to here)


@triton.jit
def share_len(o, n_rows, WORLD: tl.constexpr):
    """Rows in share ``o`` of ``n_rows`` rows."""
    base = n_rows // WORLD
    return tl.where(o < n_rows % WORLD, base + 1, base)


@triton.jit(do_not_specialize=["rank"])  # one binary for every rank (tpcomm.loopback)
def _two_shot_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr, s_row_stride, s_group_stride,
                     in_scale_ptr, buf_table_ptr, flag_table_ptr, state_ptr, err_ptr,
                     n_rows, j0, n_local, H, numel, row_stride, slot_stride, half_stride, parity_stride,
                     pad_programs, eps, timeout, rank, signature, abort_off,
                     WORLD: tl.constexpr, BLOCK_H: tl.constexpr, NUM_TILES: tl.constexpr,
                     SCATTER_ONLY: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     GEMMA: tl.constexpr, QUANT: tl.constexpr, STORE_OUT: tl.constexpr, FP8: tl.constexpr,
                     NATIVE_FP8: tl.constexpr, GROUP: tl.constexpr,
                     PDL: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    bases = table_bases(buf_table_ptr, WORLD)  # before the start atomic: their latencies overlap
    flag_bases = table_bases(flag_table_ptr, WORLD)
    epoch, ticket, word = start_program(state_ptr, num_programs, PDL)
    timeout = launch_timeout(word, timeout)
    alive = check_abort(state_ptr, word, rank, epoch, pid, signature, err_ptr, timeout, WORLD)
    timeout = tl.where(alive, timeout, 0)
    par = epoch & 1
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_H)
    base = par * parity_stride

    # 1. Scatter: row j0 + jj of share o goes to slot `rank` of rank o.
    for jj in range(pid, n_local, num_programs):
        j = j0 + jj
        for o in tl.static_range(WORLD):
            if o != rank:
                if j < share_len(o, n_rows, WORLD):
                    row_start = (share_start(o, n_rows, WORLD) + j) * H
                    dst = base_ptr(bases, buf_table_ptr, o, DTYPE, WORLD) + base + rank * slot_stride + jj * row_stride
                    for t in tl.static_range(NUM_TILES):
                        cols = t * BLOCK_H + offs
                        mask = (cols < H) & (row_start + cols < numel)
                        tl.store(dst + cols, tl.load(x_ptr + row_start + cols, mask=mask), mask=mask)
    timeout = exchange_flags(flag_table_ptr, flag_bases, flag_offset(par, 0, pid, pad_programs, WORLD), epoch,
                             signature,
                             rank, pid, timeout, err_ptr, state_ptr, abort_off, alive, pad_programs, WORLD)
    release_next(PDL)  # every peer's programs of this call have started

    # 2. Reduce this rank's share in rank order. s goes to this rank's out (the result of a
    #    reduce-scatter or a plain all-reduce; the epilogue's input otherwise) and to the second half of
    #    slot `rank` of every peer.
    recv = own_ptr(bases, buf_table_ptr, rank, DTYPE, WORLD) + base
    my_start = share_start(rank, n_rows, WORLD)
    my_len = share_len(rank, n_rows, WORLD)
    gather_off = base + rank * slot_stride + half_stride
    for jj in range(pid, n_local, num_programs):
        j = j0 + jj
        if j < my_len:
            row_start = (my_start + j) * H
            out_row = out_ptr + (j * H if SCATTER_ONLY else row_start)
            for t in tl.static_range(NUM_TILES):
                cols = t * BLOCK_H + offs
                mask = (cols < H) & (row_start + cols < numel)
                s = round_to(reduce_tile(x_ptr + row_start, recv + jj * row_stride, slot_stride, cols, mask,
                                         rank, WORLD), DTYPE)
                tl.store(out_row + cols, s, mask=mask)
                if not SCATTER_ONLY:
                    for q in tl.static_range(WORLD):
                        if q != rank:
                            tl.store(base_ptr(bases, buf_table_ptr, q, DTYPE, WORLD) + gather_off + jj * row_stride +
                                     cols, s,
                                     mask=mask)

    if not SCATTER_ONLY:
        flags = flag_offset(par, 1, pid, pad_programs, WORLD)
        if alive:
            signal_peers(flag_table_ptr, flag_bases, flags, epoch, signature, rank, WORLD)
        # 3a. While the peers' sums travel: the epilogue of this rank's own rows, from s in out (in place).
        if NORM:
            for jj in range(pid, n_local, num_programs):
                j = j0 + jj
                if j < my_len:
                    row = my_start + j
                    row_start = row * H
                    reduce_norm_row(x_ptr + row_start, out_ptr + row_start, slot_stride, res_ptr + row_start,
                                    res_out_ptr + row_start, w_ptr, out_ptr + row_start, q_ptr + row_start,
                                    s_ptr + row * s_row_stride, s_group_stride, in_scale_ptr, row_start, numel, H,
                                    eps, rank, offs, offs, False, offs,
                                    WORLD, BLOCK_H, NUM_TILES, NORM, HAS_RESIDUAL, GEMMA, SUM_LOAD,
                                    QUANT, STORE_OUT, FP8, NATIVE_FP8, GROUP, False)
        timeout = wait_peers(flag_table_ptr, flag_bases, flags, epoch, signature, rank, pid, timeout, err_ptr,
                             state_ptr, abort_off, pad_programs, WORLD)
        # 3b. The epilogue of every peer's row j, from the gathered sums.
        for jj in range(pid, n_local, num_programs):
            j = j0 + jj
            for o in tl.static_range(WORLD):
                if o != rank:
                    if j < share_len(o, n_rows, WORLD):
                        row = share_start(o, n_rows, WORLD) + j
                        row_start = row * H
                        reduce_norm_row(x_ptr + row_start,
                                        recv + o * slot_stride + half_stride + jj * row_stride,
                                        slot_stride, res_ptr + row_start, res_out_ptr + row_start, w_ptr,
                                        out_ptr + row_start, q_ptr + row_start, s_ptr + row * s_row_stride,
                                        s_group_stride, in_scale_ptr, row_start, numel, H, eps, rank,
                                        offs, offs, False, offs,
                                        WORLD, BLOCK_H, NUM_TILES, NORM, HAS_RESIDUAL, GEMMA, SUM_LOAD,
                                        QUANT, STORE_OUT, FP8, NATIVE_FP8, GROUP, False)

    finish_program(state_ptr, epoch, ticket, num_programs)


def two_shot_call(x, out, residual, residual_out, weight, ws, n_rows: int, j0: int, n_local: int, H: int,
                  eps: float, cfg, norm: bool, gemma: bool, signature: int, scatter_only: bool = False,
                  quant=None) -> KernelCall:
    """The launch of the two-shot kernel on local rows ``[j0, j0 + n_local)`` of every share.

    Args:
        x: the whole input, ``n_rows * H`` elements or fewer (a plain all-reduce's last row may be
            partial: ``x.numel()`` bounds every access).
        out: like ``x`` for an all-reduce; for ``scatter_only`` this rank's share, ``share_len * H``
            elements (reduce-scatter).
        residual, residual_out: like ``x``, or None (no residual). Ignored with ``scatter_only``.
        weight: ``(H,)`` norm weight (ignored without ``norm``).
        ws: the :class:`~tpcomm.workspace.Workspace`; ``n_local`` must not exceed
            ``ws.share_rows_per_launch(H, x.element_size())`` (the caller chunks).
        cfg: :class:`~tpcomm.dispatch.RowConfig` for ``H``; ``cfg.grid(n_local)`` programs are launched.
        signature: the call's signature (:func:`tpcomm.kernels.sync.call_signature`).
        scatter_only: stop after the reduce (reduce-scatter).
        quant: :class:`~tpcomm.kernels.epilogue.QuantOut` of the whole call, or None (no FP8 output).
    """
    has_res = residual is not None and not scatter_only
    es = x.element_size()
    return KernelCall(_two_shot_kernel, cfg.grid(n_local), (
        x, residual if has_res else x, weight if weight is not None else x, out,
        residual_out if has_res else out, *(quant.kernel_args() if quant else no_quant_args(out)),
        ws.buf_table, ws.flag_table, ws.state, ws.err,
        n_rows, j0, n_local, H, x.numel(), ws.row_stride(H, es), ws.slot_elems(es), ws.half_slot_elems(es),
        ws.parity_elems(es), ws.pad_programs, eps, ws.timeout, ws.rank, signature, ws.abort_offset("flag"),
    ), dict(
        WORLD=ws.world_size, BLOCK_H=cfg.block_h, NUM_TILES=cfg.num_tiles, SCATTER_ONLY=scatter_only,
        NORM=norm, HAS_RESIDUAL=has_res, GEMMA=gemma, **(quant.constexprs() if quant else NO_QUANT),
        num_warps=cfg.num_warps, enable_fp_fusion=False, **ws.launch_options(),
    ))
