"""All-gather: every rank's input, concatenated in rank order, on every rank.

Problem: ``out[q * n : (q + 1) * n] = x_q`` for every rank ``q`` (``n`` elements per rank), bit for bit.

Algorithm (push, one flag round trip): the input is cut into rows of ``width`` elements. Program ``p``
owns rows ``p, p + G, ...``: it stores each into slot ``rank`` of every peer's receive buffer and into
its own part of ``out``, exchanges flags with the same program of every peer (``sync.exchange_flags``),
then copies its rows of every peer's slot into that peer's part of ``out``. Each rank sends
``(W - 1) * n`` bytes, the least an all-gather can.

Sync protocol and buffers: as ``one_shot.py`` (phase-0 flags, receive slots doubled by epoch parity).
The output is the caller's tensor, never registered with peers: a rank copies out of its own receive
buffer, so peers only ever write the workspace.
"""

import triton
import triton.language as tl

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
    start_program,
    table_bases,
)


@triton.jit(do_not_specialize=["rank"])  # one binary for every rank (tpcomm.loopback)
def _all_gather_kernel(x_ptr, out_ptr, buf_table_ptr, flag_table_ptr, state_ptr, err_ptr,
                       n_rows, width, numel, out_rank_stride, row_stride, slot_stride, parity_stride,
                       pad_programs, timeout, rank, signature, abort_off,
                       WORLD: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
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
    offs = tl.arange(0, BLOCK)
    base = par * parity_stride

    # 1. Push this program's rows to every peer; copy them into this rank's part of out.
    for row in range(pid, n_rows, num_programs):
        row_start = row * width
        for t in tl.static_range(NUM_TILES):
            cols = t * BLOCK + offs
            mask = (cols < width) & (row_start + cols < numel)
            v = tl.load(x_ptr + row_start + cols, mask=mask)
            for q in tl.static_range(WORLD):
                if q != rank:
                    dst = base_ptr(bases, buf_table_ptr, q, DTYPE, WORLD) + base + rank * slot_stride + row * row_stride
                    tl.store(dst + cols, v, mask=mask)
            tl.store(out_ptr + rank * out_rank_stride + row_start + cols, v, mask=mask)

    timeout = exchange_flags(flag_table_ptr, flag_bases, flag_offset(par, 0, pid, pad_programs, WORLD), epoch,
                             signature,
                             rank, pid, timeout, err_ptr, state_ptr, abort_off, alive, pad_programs, WORLD)
    release_next(PDL)  # every peer's programs of this call have started

    # 2. Copy every peer's rows out of this rank's receive buffer.
    recv = own_ptr(bases, buf_table_ptr, rank, DTYPE, WORLD) + base
    for row in range(pid, n_rows, num_programs):
        row_start = row * width
        for t in tl.static_range(NUM_TILES):
            cols = t * BLOCK + offs
            mask = (cols < width) & (row_start + cols < numel)
            for q in tl.static_range(WORLD):
                if q != rank:
                    v = tl.load(recv + q * slot_stride + row * row_stride + cols, mask=mask,
                                cache_modifier=".cg")
                    tl.store(out_ptr + q * out_rank_stride + row_start + cols, v, mask=mask)

    finish_program(state_ptr, epoch, ticket, num_programs)


def all_gather_call(x, out, out_rank_stride: int, ws, n_rows: int, width: int, cfg, signature: int) -> KernelCall:
    """The launch of the all-gather kernel on rows ``[0, n_rows)`` of ``width`` elements of flat ``x``.

    Args:
        x: this rank's piece, at most ``n_rows * width`` elements (``x.numel()`` bounds the last row).
        out: flat view whose element ``q * out_rank_stride + i`` receives element ``i`` of rank ``q``'s
            piece (a chunk of a larger all-gather starts ``out`` at the chunk's offset).
        ws: the :class:`~tpcomm.workspace.Workspace`; ``n_rows`` rows must fit one slot.
        cfg: :class:`~tpcomm.dispatch.RowConfig` for ``width``.
        signature: the call's signature (:func:`tpcomm.kernels.sync.call_signature`).
    """
    es = x.element_size()
    return KernelCall(_all_gather_kernel, cfg.grid(n_rows), (
        x, out, ws.buf_table, ws.flag_table, ws.state, ws.err,
        n_rows, width, x.numel(), out_rank_stride, ws.row_stride(width, es), ws.slot_elems(es),
        ws.parity_elems(es), ws.pad_programs, ws.timeout, ws.rank, signature, ws.abort_offset("flag"),
    ), dict(
        WORLD=ws.world_size, BLOCK=cfg.block_h, NUM_TILES=cfg.num_tiles, num_warps=cfg.num_warps,
        enable_fp_fusion=False, **ws.launch_options(),
    ))
