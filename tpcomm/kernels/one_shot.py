"""One-shot (push) all-reduce, plain or fused with residual add + RMSNorm.

Problem: ``out = rms_norm(all_reduce(x) + residual, w, eps)`` (or the plain ``all_reduce(x)``) for
``(T, H)`` rows, bit-identical on every rank.

Algorithm: program ``p`` owns rows ``p, p + G, p + 2G, ...`` (``G`` programs). It reads its rows of ``x``
where the caller has them and stores them into slot ``rank`` of every peer's receive buffer (push: the
faster direction over NVLink), publishes one flag per peer, waits for the same program index of every
peer, then sums its rows in rank order (its own rows straight from ``x``) and runs the epilogue.
Each rank sends ``(W - 1) * n`` bytes; the whole call is one launch with one flag round trip.

Sync protocol (see ``sync.py``): data stores → ``debug_barrier`` → ``atomic_xchg(flag, signature <<
32 | epoch, release, sys)`` on each peer's signal pad; ``atomic_add(own flag, 0, acquire, sys)`` polled
until it carries the epoch → ``debug_barrier`` → ``.cg`` loads of the received rows. Receive buffers and flags are
doubled by epoch parity; two are enough because a peer can start call ``e + 1`` only after finishing
call ``e``, which needed this rank's call-``e`` data, sent after this rank's call ``e - 1`` had
completed (stream order). A program waits only for the same program index on its peers.

When it wins: small messages (decode), where one flag round trip beats any multi-step algorithm; the
crossover table is in ``tpcomm/dispatch.py`` and the measurements in ``docs/design.md``.
"""

import triton
import triton.language as tl

from .epilogue import NO_QUANT, SUM_REDUCE, no_quant_args, preload_row, reduce_norm_row
from .launch import KernelCall
from .moe import finalize_kwargs, finalize_tile
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
def _one_shot_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr, s_row_stride, s_group_stride,
                     in_scale_ptr, buf_table_ptr, flag_table_ptr, state_ptr, err_ptr,
                     n_rows, H, numel, row_stride, slot_stride, parity_stride, pad_programs,
                     eps, timeout, rank, signature, abort_off,
                     e_ptr, idx_ptr, tw_ptr, sh_ptr, K, n_expert_rows, scaling,
                     WORLD: tl.constexpr, BLOCK_H: tl.constexpr, NUM_TILES: tl.constexpr,
                     NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
                     QUANT: tl.constexpr, STORE_OUT: tl.constexpr, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr,
                     GROUP: tl.constexpr, PDL: tl.constexpr,
                     FINALIZE: tl.constexpr, INDEXED: tl.constexpr, HAS_SHARED: tl.constexpr):
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

    # 1. Push this program's rows into slot `rank` of every peer's receive buffer.
    for row in range(pid, n_rows, num_programs):
        row_start = row * H
        dst_off = par * parity_stride + rank * slot_stride + row * row_stride
        for t in tl.static_range(NUM_TILES):
            cols = t * BLOCK_H + offs
            mask = (cols < H) & (row_start + cols < numel)
            if FINALIZE:  # this rank's row is made here (kernels/moe.py) and kept in its own slot for step 3
                v = finalize_tile(e_ptr, idx_ptr, tw_ptr, sh_ptr, row, row < n_rows, K, n_expert_rows, scaling, H,
                                  cols, mask, INDEXED, HAS_SHARED, DTYPE)
                tl.store(own_ptr(bases, buf_table_ptr, rank, DTYPE, WORLD) + dst_off + cols, v, mask=mask)
            else:
                v = tl.load(x_ptr + row_start + cols, mask=mask)
            for q in tl.static_range(WORLD):
                if q != rank:
                    dst = base_ptr(bases, buf_table_ptr, q, DTYPE, WORLD)
                    tl.store(dst + dst_off + cols, v, mask=mask)

    # The first row's residual and the weight, loaded now so that their latency hides under the wait.
    PRELOAD: tl.constexpr = NORM and NUM_TILES == 1
    if PRELOAD:
        res_pre, w_pre = preload_row(res_ptr + pid * H, w_ptr, pid * H, numel, H, BLOCK_H, HAS_RESIDUAL)
    else:
        res_pre, w_pre = offs, offs

    # 2. Publish one flag per peer and wait for the same program index of every peer (bounded).
    timeout = exchange_flags(flag_table_ptr, flag_bases, flag_offset(par, 0, pid, pad_programs, WORLD), epoch,
                             signature,
                             rank, pid, timeout, err_ptr, state_ptr, abort_off, alive, pad_programs, WORLD)
    release_next(PDL)  # every peer's programs of this call have started

    # 3. Reduce in rank order and run the epilogue.
    recv = own_ptr(bases, buf_table_ptr, rank, DTYPE, WORLD) + par * parity_stride
    for row in range(pid, n_rows, num_programs):
        row_start = row * H
        if FINALIZE:
            x_row = recv + rank * slot_stride + row * row_stride
        else:
            x_row = x_ptr + row_start
        reduce_norm_row(x_row, recv + row * row_stride, slot_stride,
                        res_ptr + row_start, res_out_ptr + row_start, w_ptr, out_ptr + row_start,
                        q_ptr + row_start, s_ptr + row * s_row_stride, s_group_stride, in_scale_ptr,
                        row_start, numel, H, eps, rank, res_pre, w_pre, row == pid, offs,
                        WORLD, BLOCK_H, NUM_TILES, NORM, HAS_RESIDUAL, GEMMA, SUM_REDUCE,
                        QUANT, STORE_OUT, FP8, NATIVE_FP8, GROUP, PRELOAD)

    finish_program(state_ptr, epoch, ticket, num_programs)


def one_shot_call(x, out, residual, residual_out, weight, ws, n_rows: int, H: int, eps: float,
                  cfg, norm: bool, gemma: bool, signature: int, quant=None, moe=None) -> KernelCall:
    """The launch of the one-shot kernel on rows ``[0, n_rows)`` of the flat tensors.

    Args:
        x, out: ``(n_rows * H)`` elements (``out`` may also hold fewer: ``x.numel()`` bounds both).
        residual, residual_out: ``(n_rows, H)`` or None (no residual).
        weight: ``(H,)`` norm weight (ignored without ``norm``).
        ws: the :class:`~tpcomm.workspace.Workspace`; ``n_rows * ws.row_stride(H)`` elements must fit
            one slot (the caller chunks).
        cfg: :class:`~tpcomm.dispatch.RowConfig` for ``H``; ``cfg.grid(n_rows)`` programs are launched.
        signature: the call's signature (:func:`tpcomm.kernels.sync.call_signature`), carried by the
            flags so a peer that makes a different call is detected.
        quant: :class:`~tpcomm.kernels.epilogue.QuantOut` of this launch's rows, or None (no FP8 output).
        moe: :class:`~tpcomm.kernels.moe.MoeIn` of this launch's rows: this rank's rows are the MoE
            finalize of it (``x`` then only gives the dtype and size, and is not read), or None.
    """
    has_res = residual is not None
    row_stride = ws.row_stride(H, x.element_size())
    return KernelCall(_one_shot_kernel, cfg.grid(n_rows), (
        x, residual if has_res else x, weight if weight is not None else x, out,
        residual_out if has_res else out, *(quant.kernel_args() if quant else no_quant_args(out)),
        ws.buf_table, ws.flag_table, ws.state, ws.err,
        n_rows, H, x.numel(), row_stride, ws.slot_elems(x.element_size()),
        ws.parity_elems(x.element_size()), ws.pad_programs,
        eps, ws.timeout, ws.rank, signature, ws.abort_offset("flag"),
    ), dict(
        WORLD=ws.world_size, BLOCK_H=cfg.block_h, NUM_TILES=cfg.num_tiles, NORM=norm,
        HAS_RESIDUAL=has_res, GEMMA=gemma, **(quant.constexprs() if quant else NO_QUANT),
        **finalize_kwargs(moe), num_warps=cfg.num_warps, enable_fp_fusion=False, **ws.launch_options(),
    ))
