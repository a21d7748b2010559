"""A call cut into launches: the chunk loops of every op, as generators of
:class:`~tpcomm.kernels.launch.KernelCall`.

A launch carries at most what one workspace slot holds (``Workspace.rows_per_launch`` and its Lamport
and two-shot counterparts), so a larger call runs as consecutive launches of whole rows through the same
kernel. Each generator yields the launches of one call in order; the caller launches them under its
lock (``Communicator._launching``) and may record them (``tpcomm.call_cache``). ``sign(*fields)``
returns a launch's signature (``kernels/sync.call_signature``) and takes every field that tells two
launches apart (op, algorithm, dtype, sizes, the chunk, flags, the user's call), so a peer making
another call is detected. A one-launch call passes the caller's tensors themselves (no views), which
is what lets a repeated call replay it.
"""

from __future__ import annotations

from typing import Callable, Iterator

from .. import dispatch
from .gather import all_gather_call
from .lamport import lamport_call
from .launch import KernelCall
from .one_shot import one_shot_call
from .two_shot import two_shot_call


def quant_fields(quant) -> tuple:
    """What a launch's signature carries of its FP8 output: the mode, the format and the group size (ranks
    that differ in any would return different FP8 bytes; the scale layout and ``emit_unquantized`` change
    no byte, so they may differ)."""
    return (quant.mode, str(quant.fp8), quant.group) if quant is not None else (0,)


def row_launches(algorithm: str, ws, world_size: int, x, out, residual, residual_out, weight, n_rows: int,
                 H: int, eps: float, norm: bool, gemma: bool, quant, sign: Callable[..., int],
                 call: tuple = (), moe=None) -> Iterator[KernelCall]:
    """The launches of ``algorithm`` (``lamport``, ``one_shot`` or ``two_shot``) over ``n_rows`` rows of
    ``H`` of the flat tensors (the all-reduce and the fused op). ``call``: the user's call beyond the
    flat sizes (its shape), part of every signature. ``moe``: a :class:`~tpcomm.kernels.moe.MoeIn` whose
    finalize makes this rank's rows in the one-shot and Lamport kernels (``x`` is then not read)."""
    if algorithm == "two_shot":
        if moe is not None:
            raise ValueError("row_launches: the MoE finalize prologue is one-shot's and Lamport's")
        yield from two_shot_launches(ws, world_size, x, out, residual, residual_out, weight, n_rows, H, eps, norm,
                                     gemma, quant, sign, call=call)
        return
    cfg = dispatch.row_config(H, ws.max_programs)
    es = x.element_size()
    lamport_rows = ws.lamport_rows_per_launch(H, es)
    use_lamport = algorithm == "lamport" and lamport_rows >= 1
    per_launch = lamport_rows if use_lamport else ws.rows_per_launch(H, es)
    numel = x.numel()
    for r0 in range(0, n_rows, per_launch):
        r1 = min(n_rows, r0 + per_launch)
        a, b = r0 * H, min(numel, r1 * H)
        if a == 0 and b == numel:  # one launch (the usual case): no views to make
            args = (x, out, residual, residual_out, weight, ws, n_rows, H, eps, cfg, norm, gemma)
        else:
            args = (x.view(-1)[a:b], out.view(-1)[a:b],
                    residual.view(-1)[a:b] if residual is not None else None,
                    residual_out.view(-1)[a:b] if residual_out is not None else None,
                    weight, ws, r1 - r0, H, eps, cfg, norm, gemma)
        q = quant.shifted(r0, a) if quant is not None else None
        sig = sign(algorithm, str(x.dtype), numel, r0, r1, H, norm, residual is not None, gemma, quant_fields(quant),
                   eps, call)
        yield (lamport_call if use_lamport else one_shot_call)(*args, sig, quant=q,
                                                               moe=moe.shifted(r0) if moe is not None else None)


def two_shot_launches(ws, world_size: int, x, out, residual, residual_out, weight, n_rows: int, H: int,
                      eps: float, norm: bool, gemma: bool, quant, sign: Callable[..., int], scatter_only: bool = False,
                      call: tuple = ()) -> Iterator[KernelCall]:
    """The two-shot launches over ``n_rows`` rows of ``H``: each covers the same local rows of every
    rank's share. ``scatter_only``: reduce-scatter (``out`` is this rank's share)."""
    cfg = dispatch.row_config(H, ws.max_programs, two_shot=True, factor=ws.pad_programs // ws.max_programs)
    per_launch = ws.share_rows_per_launch(H, x.element_size())
    longest = -(-n_rows // world_size)
    for j0 in range(0, longest, per_launch):
        n_local = min(per_launch, longest - j0)
        sig = sign("two_shot", str(x.dtype), x.numel(), n_rows, j0, n_local, H, norm, residual is not None, gemma,
                   quant_fields(quant), scatter_only, eps, call)
        yield two_shot_call(x, out, residual, residual_out, weight, ws, n_rows, j0, n_local, H, eps, cfg, norm,
                            gemma, sig, scatter_only, quant)


def gather_launches(ws, src, dst, n: int, dtype_name: str, sign: Callable[..., int],
                    call: tuple = ()) -> Iterator[KernelCall]:
    """The all-gather launches of ``n`` elements of flat ``src`` (what the kernel moves: bytes for dtypes
    moved as bytes) into ``dst`` (rank ``q``'s piece at element ``q * n``)."""
    width = dispatch.all_reduce_width(n, src.element_size(), ws)
    cfg = dispatch.row_config(width, ws.max_programs)
    n_rows = -(-n // width)
    per_launch = ws.rows_per_launch(width, src.element_size())
    for r0 in range(0, n_rows, per_launch):
        r1 = min(n_rows, r0 + per_launch)
        a, b = r0 * width, min(n, r1 * width)
        sig = sign("push", dtype_name, n, r0, r1, width, call)
        piece, into = (src, dst) if a == 0 and b == n else (src.view(-1)[a:b], dst.view(-1)[a:])
        yield all_gather_call(piece, into, n, ws, r1 - r0, width, cfg, sig)
