"""``tpcomm demo``, part (c): every op that parts (a) and (b) leave out, each checked against its plain-torch
reference on every rank: the all-gather, the reduce-scatter, the full-width QK norm (MiniMax-M2's
``q_norm`` / ``k_norm``), the MoE finalize fused into the all-reduce + residual + RMSNorm, and the fused
norm's every quantised output form.

As in part (a), every rank's inputs come from seeds every rank knows, so each rank computes every rank's
expected result: the all-gather and the reduce-scatter share bit for bit against
:func:`tpcomm.reduce_in_rank_order`; the QK norm against :func:`tpcomm.fused_qk_rmsnorm_reference`; the MoE
call against :func:`tpcomm.moe_finalize_reference` of every rank, summed and normalised by
:func:`tpcomm.add_rmsnorm_reference`; each quantised form's bytes and scales against the form's plain-torch
reference applied to the call's own unquantised output (returned with ``emit_unquantized``), and that
output against :func:`tpcomm.add_rmsnorm_reference`. One hidden size (``DemoConfig.other_hidden``), the
token counts of ``DemoConfig.other_tokens``.
"""

from __future__ import annotations

import torch

from .demo_checks import DTYPES, Row, bit_equal, randn, same_on_all_ranks, time_eager, ulp_distance

#: The fused norm's quantised output forms, in the order the docs list them.
QUANT_FORMS = ("fp8_per_token", "fp8_per_group", "fp8_per_group_ue8m0", "fp8_static", "mxfp4", "nvfp4")
#: Part (c)'s ops, in table order.
OPS = ("all_gather", "reduce_scatter", "fused_qk_rmsnorm", "fused_moe_finalize_add_rmsnorm",
       *(f"quant={q}" for q in QUANT_FORMS))


def cases(cfg) -> list[tuple[str, int]]:
    """``(op, tokens)`` of every part (c) row of ``cfg`` (a :class:`tpcomm.demo.DemoConfig`)."""
    return [(op, T) for T in cfg.other_tokens for op in OPS]


def run_case(comm, cfg, case: int, op: str, T: int) -> Row:
    """One part (c) row on this rank (collective)."""
    run = {"all_gather": _gather, "reduce_scatter": _scatter, "fused_qk_rmsnorm": _qk,
           "fused_moe_finalize_add_rmsnorm": _moe}.get(op, _quant)
    return run(comm, cfg, case, op, T)


def _row(comm, cfg, op: str, shape: str, algorithm: str, call, checks, identical, residual_exact,
         error: float, unit: str = "ulp") -> Row:
    """The row: ``checks`` (name -> passed) and ``identical`` (None where the outputs differ between ranks by
    design); on GPUs, ``call`` timed as part (a)'s."""
    notes = [name for name, ok in checks.items() if not ok]
    if identical is False:
        notes.append("outputs differ between ranks")
    time_us = time_eager(call, cfg.calls, cfg.warmup) if cfg.calls and comm.device.type == "cuda" else None
    return Row(op, shape, cfg.dtype, algorithm, float(error), unit, residual_exact, identical, time_us, not notes,
               "; ".join(notes))


def _inputs(comm, cfg, case: int, shape) -> list[torch.Tensor]:
    """Every rank's input of ``case``, in rank order."""
    return [randn(shape, DTYPES[cfg.dtype], comm.device, cfg.seed, 500, case, q) for q in range(comm.world_size)]


def _gather(comm, cfg, case, op, T):
    H = cfg.other_hidden
    xs = _inputs(comm, cfg, case, (T, H))
    y = comm.all_gather(xs[comm.rank])
    want = torch.cat(xs, 0)
    plan = comm.plan(op, T * H * xs[0].element_size(), H, xs[0].dtype)
    exact = bit_equal(y, want)
    return _row(comm, cfg, op, f"{T}x{H} a rank", plan.algorithm, lambda: comm.all_gather(xs[comm.rank]),
                {"not bit-exact": exact}, same_on_all_ranks(y, comm.group), exact, ulp_distance(y, want))


def _scatter(comm, cfg, case, op, T):
    from .reference import reduce_in_rank_order

    H, W = cfg.other_hidden, comm.world_size
    xs = _inputs(comm, cfg, case, (T * W, H))
    y = comm.reduce_scatter(xs[comm.rank])
    want = torch.tensor_split(reduce_in_rank_order(xs), W, 0)[comm.rank]
    plan = comm.plan(op, T * W * H * xs[0].element_size(), H, xs[0].dtype)
    exact = bit_equal(y, want)
    # each rank holds another share: "same bits on all ranks" does not apply
    return _row(comm, cfg, op, f"{T * W}x{H}", plan.algorithm, lambda: comm.reduce_scatter(xs[comm.rank]),
                {"not bit-exact": exact}, None, exact, ulp_distance(y, want))


def _qk(comm, cfg, case, op, T):
    from .reference import fused_qk_rmsnorm_reference

    W, dtype = comm.world_size, DTYPES[cfg.dtype]
    Hq, Hk = cfg.qk_widths[0] // W, cfg.qk_widths[1] // W  # this rank's heads' columns
    qs = _inputs(comm, cfg, case, (T, Hq))
    ks = [randn((T, Hk), dtype, comm.device, cfg.seed, 501, case, r) for r in range(W)]
    wq = randn((W * Hq,), dtype, comm.device, cfg.seed, 502, case, scale=0.1, shift=1.0)  # the full weights
    wk = randn((W * Hk,), dtype, comm.device, cfg.seed, 503, case, scale=0.1, shift=1.0)
    wqs, wks = list(wq.split(Hq)), list(wk.split(Hk))
    r = comm.rank
    q_out, k_out = comm.fused_qk_rmsnorm(qs[r], ks[r], wqs[r], wks[r], cfg.eps)
    want_q, want_k = fused_qk_rmsnorm_reference(qs, ks, wqs, wks, cfg.eps)[r]
    err = max(ulp_distance(q_out, want_q), ulp_distance(k_out, want_k))
    plan = comm.plan(op, T * (Hq + Hk) * qs[0].element_size(), Hq + Hk, dtype)
    # each rank holds its own heads' columns: "same bits on all ranks" does not apply
    return _row(comm, cfg, op, f"{T}x({Hq}+{Hk}) a rank", plan.algorithm,
                lambda: comm.fused_qk_rmsnorm(qs[r], ks[r], wqs[r], wks[r], cfg.eps),
                {f"q_out / k_out differ from the reference by {err} ulp": err == 0}, None, None, err)


def _moe(comm, cfg, case, op, T):
    from .collectives.moe_finalize import moe_finalize_reference
    from .reference import add_rmsnorm_reference, reduce_in_rank_order

    H, K, dtype, dev = cfg.other_hidden, cfg.moe_topk, DTYPES[cfg.dtype], comm.device
    experts = _inputs(comm, cfg, case, (T, K, H))  # each rank's partial expert outputs
    g = torch.Generator(device=dev).manual_seed(cfg.seed + case)
    weights = torch.rand((T, K), generator=g, device=dev).softmax(-1)  # the routing, the same on every rank
    residual = randn((T, H), dtype, dev, cfg.seed, 504, case)
    norm = randn((H,), dtype, dev, cfg.seed, 505, case, scale=0.1, shift=1.0)

    def call():
        return comm.fused_moe_finalize_add_rmsnorm(experts[comm.rank], weights, residual, norm, cfg.eps)

    out, res_out = call()
    x = reduce_in_rank_order([moe_finalize_reference(e, weights) for e in experts])
    want_out, want_res = add_rmsnorm_reference(x, residual, norm, cfg.eps)
    err = ulp_distance(out, want_out)
    exact = bit_equal(res_out, want_res)
    plan = comm.plan(op, T * H * out.element_size(), H, dtype)
    identical = same_on_all_ranks(out, comm.group) and same_on_all_ranks(res_out, comm.group)
    return _row(comm, cfg, f"{op} (K={K})", f"{T}x{K}x{H} a rank", plan.algorithm, call,
                {f"out differs from the reference by {err} ulp": err == 0, "residual_out not bit-exact": exact},
                identical, exact, err)


def _quant(comm, cfg, case, op, T):
    from .reference import add_rmsnorm_reference, quant_form_reference, reduce_in_rank_order

    form, H, dtype, dev = op.removeprefix("quant="), cfg.other_hidden, DTYPES[cfg.dtype], comm.device
    xs = _inputs(comm, cfg, case, (T, H))
    residual = randn((T, H), dtype, dev, cfg.seed, 506, case)
    norm = randn((H,), dtype, dev, cfg.seed, 507, case, scale=0.1, shift=1.0)
    scale = torch.full((1,), 0.02, dtype=torch.float32, device=dev) if form in ("fp8_static", "nvfp4") else None

    def call():
        return comm.fused_add_rmsnorm(xs[comm.rank], residual, norm, cfg.eps, quant=form, emit_unquantized=True,
                                      scale=scale)

    q, scales, res_out, out = call()
    want_out, want_res = add_rmsnorm_reference(reduce_in_rank_order(xs), residual, norm, cfg.eps)
    want_q, want_scales = quant_form_reference(out, form, scale=scale)  # the form applied to the call's own out
    differ = _bytes_differ(q, want_q) + _bytes_differ(scales, want_scales)
    err = ulp_distance(out, want_out)
    exact = bit_equal(res_out, want_res)
    plan = comm.plan("fused_add_rmsnorm", T * H * out.element_size(), H, dtype)
    identical = all(same_on_all_ranks(t, comm.group) for t in (q, scales, res_out))
    return _row(comm, cfg, f"fused_add_rmsnorm {op}", f"{T}x{H}", plan.algorithm, call,
                {f"{differ} bytes of q / scales differ from the form's reference": differ == 0,
                 f"out differs from the reference by {err} ulp": err == 0, "residual_out not bit-exact": exact},
                identical, exact, differ, "bytes")


def _bytes_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many bytes of ``a`` and ``b`` differ (every byte when the shapes or dtypes differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel() * a.element_size(), 1)
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum().item())
