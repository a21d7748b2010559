"""Rank bodies of the custom-op, compile, multi-communicator and example tests (``tests/ops/test_ops.py``,
``tests/ops/test_compile.py``, ``tests/ops/test_multi_comm.py``, ``tests/ops/test_example_tp_decoder.py``), run by the
CPU rank pool as ``fn(ctx, *args)``. Inputs come from seeds every rank knows (``numerics``), so each rank
computes the expected result itself; the test files hold the assertions.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

import tpcomm
import tpcomm.graphs as tgraphs
import tpcomm.ops as tops
from tests.support.numerics import (
    all_inputs,
    bits,
    out_ulp_tolerance,
    raised,
    residual_input,
    ulp_distance,
    weight_input,
)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (shape, dtype and bits; FP8 and integer tensors compared as they are)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.element_size() == 1:
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(bits(a), bits(b))


# -- test_ops -------------------------------------------------------------------------------------------
def wrappers_match_methods(ctx, seed, shape, dtype_name):
    """Every wrapper of tpcomm.ops against the Communicator method on the same inputs: bit-identical
    outputs, NaN-poisoned ``out`` fully written, in place (``out=x``) equal to the new-tensor form, the
    residual and weight untouched. Returns a dict of booleans."""
    dtype = getattr(torch, dtype_name)
    comm = ctx.comm()
    xs = all_inputs(seed, ctx.world_size, shape, dtype)
    x = xs[ctx.rank]
    res = residual_input(seed, shape, dtype)
    w = weight_input(seed, shape[-1], dtype)
    x0, res0 = x.clone(), res.clone()
    got = {}
    y_m = comm.all_reduce(x)
    y_o = tops.all_reduce(comm, x)
    out = torch.full_like(x, float("nan"))
    y_out = tops.all_reduce(comm, x, out=out)
    inplace = x.clone()
    y_in = tops.all_reduce(comm, inplace, out=inplace)
    got["all_reduce"] = _same(y_o, y_m) and _same(y_m, tpcomm.reduce_in_rank_order(xs))
    got["all_reduce_out"] = y_out is out and _same(out, y_m)
    got["all_reduce_inplace"] = y_in is inplace and _same(inplace, y_m)
    for gemma in (False, True):
        for with_res in (True, False):
            r = res if with_res else None
            o_m, ro_m = comm.fused_add_rmsnorm(x, r, w, eps=1e-5, gemma=gemma)
            o_o, ro_o = tops.fused_add_rmsnorm(comm, x, r, w, eps=1e-5, gemma=gemma)
            ok = _same(o_o, o_m) and (ro_o is None) == (not with_res)
            if with_res:
                ok = ok and _same(ro_o, ro_m)
            got[f"fused(gemma={gemma}, residual={with_res})"] = ok
    for dim in (0, -1):
        g_m, g_o = comm.all_gather(x, dim), tops.all_gather(comm, x, dim)
        got[f"all_gather(dim={dim})"] = _same(g_o, g_m) and _same(g_o, torch.cat(xs, dim))
        rs_m, rs_o = comm.reduce_scatter(x, dim), tops.reduce_scatter(comm, x, dim)
        share = torch.tensor_split(tpcomm.reduce_in_rank_order(xs), ctx.world_size, dim)[ctx.rank]
        got[f"reduce_scatter(dim={dim})"] = _same(rs_o, rs_m) and _same(rs_o, share)
    for quant, kw in (("fp8_per_token", {}), ("fp8_per_group", {"group_size": 8, "emit_unquantized": True}),
                      ("fp8_per_group", {"group_size": 8, "column_major_scales": True})):
        m = comm.fused_add_rmsnorm(x, res, w, quant=quant, **kw)
        o = tops.fused_add_rmsnorm(comm, x, res, w, quant=quant, **kw)
        ok = all((a is None) == (b is None) for a, b in zip(o, m))
        ok = ok and all(a is None or (_same(a, b) and a.stride() == b.stride()) for a, b in zip(o, m))
        got[f"{quant}{sorted(kw)}"] = ok
    got["inputs_untouched"] = _same(x, x0) and _same(res, res0)
    return got


def opcheck_case(ctx):
    """``torch.library.opcheck`` of each op (schema, fake impl against the real one, autograd
    registration, AOT dispatch), the same sequence on every rank (each real call is collective).
    Returns ``{op: None or the error text}``."""
    import traceback

    comm = ctx.comm()
    h = tops.register(comm)
    x = all_inputs(2100, ctx.world_size, (3, 32), torch.bfloat16)[ctx.rank]
    res = residual_input(2100, (3, 32), torch.bfloat16)
    w = weight_input(2100, 32, torch.bfloat16)
    cases = {
        "all_reduce": (torch.ops.tpcomm.all_reduce.default, (h, x)),
        "all_reduce_out": (torch.ops.tpcomm.all_reduce_out.default, (h, x, torch.empty_like(x))),
        "fused_add_rmsnorm": (torch.ops.tpcomm.fused_add_rmsnorm.default, (h, x, res, w, 1e-6, False)),
        "fused_rmsnorm_gemma": (torch.ops.tpcomm.fused_add_rmsnorm.default, (h, x, None, w, 1e-6, True)),
        "fused_fp8_per_token": (torch.ops.tpcomm.fused_add_rmsnorm_fp8.default,
                                (h, x, res, w, 1e-6, False, "fp8_per_token", torch.float8_e4m3fn, 128, False, True)),
        "fused_fp8_per_group_column_major": (torch.ops.tpcomm.fused_add_rmsnorm_fp8.default,
                                             (h, x, None, w, 1e-6, False, "fp8_per_group", torch.float8_e4m3fn, 16,
                                              True, False)),
        "all_gather": (torch.ops.tpcomm.all_gather.default, (h, x, 1, comm.rank, comm.world_size)),
        "reduce_scatter": (torch.ops.tpcomm.reduce_scatter.default, (h, x, 0, comm.rank, comm.world_size)),
    }
    report = {}
    for name, (op, args) in cases.items():
        try:
            # test_aot_dispatch_dynamic retraces with symbolic shapes (the fake impls must take them)
            torch.library.opcheck(op, args)
            report[name] = None
        except Exception:
            report[name] = traceback.format_exc()
    return report


# -- test_compile ---------------------------------------------------------------------------------------
class _Layer(torch.nn.Module):
    """A tensor-parallel-style layer that calls every op: a matmul (an extern kernel under Inductor, so
    the same bits as eager), all_reduce, fused add + RMSNorm, all_reduce into a new ``out``, the same in
    place, the no-residual Gemma form, the FP8 per-group form, reduce_scatter along rows (a
    rank-dependent shape) and columns, and all_gather of the columns."""

    def __init__(self, comm, hidden: int, dtype, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.comm = comm
        dev = comm.device
        self.w_in = torch.nn.Parameter((torch.randn(hidden, hidden, generator=g) / hidden ** 0.5).to(dev, dtype),
                                       requires_grad=False)
        self.w_norm = torch.nn.Parameter(weight_input(seed, hidden, dtype).to(dev), requires_grad=False)
        self.group_size = min(128, hidden // 4)  # FP8 scales per group: 128 (DeepSeek-V3's) where H allows

    def forward(self, x, residual):
        s = tops.all_reduce(self.comm, x @ self.w_in)
        h, residual = tops.fused_add_rmsnorm(self.comm, s, residual, self.w_norm, eps=1e-5)
        buf = torch.empty_like(h)
        tops.all_reduce(self.comm, h, out=buf)
        tops.all_reduce(self.comm, buf, out=buf)  # in place, fed by the previous call
        out, none = tops.fused_add_rmsnorm(self.comm, buf @ self.w_in, None, self.w_norm, gemma=True)
        q, scales, residual, unq = tops.fused_add_rmsnorm(self.comm, out, residual, self.w_norm,
                                                          quant="fp8_per_group", group_size=self.group_size)
        rows = tops.reduce_scatter(self.comm, buf, 0)  # this rank's rows: the shape depends on the rank
        cols = tops.reduce_scatter(self.comm, out, -1)
        gathered = tops.all_gather(self.comm, cols, -1)
        return (out, residual, buf, q, scales, rows, gathered), none is None and unq is None


def compile_case(ctx, hidden, token_counts, seed):
    """``torch.compile(fullgraph=True)`` (Inductor) of :class:`_Layer`, with the token dimension marked
    dynamic (as engines do): one compilation serves every token count (>= 2: Inductor specialises 0
    and 1), and each compiled call is bit-identical to eager on the same inputs.
    Returns ``{"frames", "calls": [{T, same: [bool per output], none_ok, rows}]}`` (``rows``: how many
    rows the compiled reduce_scatter returned to this rank)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    dtype = torch.bfloat16
    layer = _Layer(ctx.comm(), hidden, dtype, seed)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    calls = []
    with torch.inference_mode():
        for i, T in enumerate(token_counts):
            x = all_inputs(seed + i, ctx.world_size, (T, hidden), dtype)[ctx.rank]
            res = residual_input(seed + i, (T, hidden), dtype)
            eager = layer(x, res)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(res, 0)
            comp = compiled(x, res)
            calls.append({"T": T, "same": [_same(a, b) and a.stride() == b.stride() for a, b in zip(comp[0], eager[0])],
                          "none_ok": comp[1] and eager[1], "rows": comp[0][5].shape[0]})
    return {"frames": counter.frame_count, "calls": calls}


class _AllReduceLayer(torch.nn.Module):
    def __init__(self, comm):
        super().__init__()
        self.comm = comm

    def forward(self, x):
        return tops.all_reduce(self.comm, x) * 2


def compiled_follows_comm_case(ctx):
    """One compiled function applied to layers holding different communicators (the world group, and
    a group of this rank alone, whose all_reduce is the identity): each result equals its own layer's
    eager result, and a layer whose communicator is swapped after compilation follows the new one.
    Returns ``{name: bool}`` and the compile count."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    mine, _ = dist.new_subgroups_by_enumeration([[r] for r in range(ctx.world_size)])
    world, alone = ctx.comm(), tpcomm.Communicator(mine)
    x = torch.full((2, 16), float(ctx.rank + 1), dtype=torch.float32)
    counter = CompileCounterWithBackend("eager")
    run = torch.compile(lambda layer, x: layer(x), fullgraph=True, backend=counter)
    a, b = _AllReduceLayer(world), _AllReduceLayer(alone)
    got = {"world": _same(run(a, x), a(x)), "alone": _same(run(b, x), b(x)),
           "differ": not _same(a(x), b(x))}
    a.comm = alone
    got["swapped"] = _same(run(a, x), b(x))
    alone.close()
    return {"checks": got, "frames": counter.frame_count}


# -- test_multi_comm -------------------------------------------------------------------------------------
#: The calls each communicator makes at step ``i`` (cycled): op, shape, dtype. bf16 takes the Lamport
#: kernel and fp32 the one-shot kernel (auto dispatch), so both kinds of workspace state interleave.
MULTI_STEPS = (("all_reduce", (2, 24), torch.bfloat16), ("fused", (1, 40), torch.float32),
               ("fused_no_res", (3, 16), torch.bfloat16), ("all_reduce", (5,), torch.float32))


def _group_call(comm, members, op, shape, dtype, seed, via_ops):
    """One call of ``comm`` (group ``members``, global ranks in group-rank order) on inputs from
    ``seed``; returns whether the result matches the contract (``s`` / ``residual_out`` bit-exact,
    ``out`` within the ulp tolerance)."""
    xs = all_inputs(seed, len(members), shape, dtype)
    x = xs[comm.rank]
    s_ref = tpcomm.reduce_in_rank_order(xs)
    if op == "all_reduce":
        y = tops.all_reduce(comm, x) if via_ops else comm.all_reduce(x)
        return _same(y, s_ref)
    res = residual_input(seed, shape, dtype) if op == "fused" else None
    w = weight_input(seed, shape[-1], dtype)
    call = (lambda: tops.fused_add_rmsnorm(comm, x, res, w)) if via_ops else (lambda: comm.fused_add_rmsnorm(x, res, w))
    out, ro = call()
    out_ref, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, w, 1e-6)
    ok = int(ulp_distance(out, out_ref).max()) <= out_ulp_tolerance(dtype, shape[-1])
    return ok and (res is None or _same(ro, ro_ref))


def multi_comm_case(ctx, layout, steps, seed, skew_s):
    """Two communicators per rank, on two different groups, used interleaved for ``steps`` steps.

    ``layout``:
      * ``tp_world``: TP groups ``[[0, 1], [2, 3]]`` and the world group.
      * ``tp_dp``: TP groups ``[[0, 1], [2, 3]]`` and the orthogonal groups ``[[0, 2], [1, 3]]``
        (tensor x data parallel).
    At each step every rank makes one call on each of its communicators (op, shape and dtype cycling
    through ``MULTI_STEPS``, the second communicator a step ahead of the first so they differ). Ranks of
    the second TP group call the second communicator first, so the groups interleave their calls in
    different orders; one rank, a different one at each step, sleeps ``skew_s`` first. Odd steps go
    through ``tpcomm.ops``, even ones through the methods. Returns ``[(step, which, ok), ...]`` and the
    group ranks seen.
    """
    W = ctx.world_size
    half = W // 2
    tp_groups = [list(range(0, half)), list(range(half, W))]
    tp_mine, _ = dist.new_subgroups_by_enumeration(tp_groups)
    tp_members = tp_groups[ctx.rank // half]
    if layout == "tp_world":
        other_mine, other_members = None, list(range(W))
    elif layout == "tp_dp":
        dp_groups = [[r, r + half] for r in range(half)]
        other_mine, _ = dist.new_subgroups_by_enumeration(dp_groups)
        other_members = dp_groups[ctx.rank % half]
    else:
        raise ValueError(layout)
    comms = {"tp": tpcomm.Communicator(tp_mine), "other": tpcomm.Communicator(other_mine)}
    members = {"tp": tp_members, "other": other_members}
    order = ("tp", "other") if ctx.rank < half else ("other", "tp")
    report = []
    for i in range(steps):
        if ctx.rank == i % W:
            time.sleep(skew_s)
        for which in order:
            j = i + (1 if which == "other" else 0)
            op, shape, dtype = MULTI_STEPS[j % len(MULTI_STEPS)]
            # the seed names the group (its first member) and the step: every member derives the same inputs
            case = seed + 1000 * i + 10 * members[which][0] + (5 if which == "other" else 0)
            ok = _group_call(comms[which], members[which], op, shape, dtype, case, via_ops=bool(i % 2))
            report.append((i, which, ok))
    ranks = {k: (c.rank, c.world_size, c.uses_kernels) for k, c in comms.items()}
    handles = {k: tops.register(c) for k, c in comms.items()}
    for c in comms.values():
        c.close()
    return {"report": report, "ranks": ranks, "distinct_handles": len(set(handles.values())) == 2}


def same_group_comms_case(ctx, steps, seed):
    """Two communicators on the same (world) group, one with a small workspace (chunked calls),
    interleaved call by call through ``tpcomm.ops``: each result matches the contract, and neither
    communicator's calls disturb the other's epochs. Returns ``[(step, which, ok)]``."""
    comms = {"a": tpcomm.Communicator(), "b": tpcomm.Communicator(max_bytes=256)}
    members = list(range(ctx.world_size))
    report = []
    for i in range(steps):
        for k, which in enumerate(("a", "b") if i % 2 else ("b", "a")):
            op, shape, dtype = MULTI_STEPS[(i + k) % len(MULTI_STEPS)]
            ok = _group_call(comms[which], members, op, shape, dtype, seed + 100 * i + k, via_ops=True)
            report.append((i, which, ok))
    for c in comms.values():
        c.close()
    return report


# -- registry and graph helpers ---------------------------------------------------------------------------
def registry_case(ctx):
    """Handles: stable per communicator, distinct between communicators, never reused after a
    communicator is garbage-collected (whose handle then raises LookupError naming it); an int handle
    works in place of the communicator; a bad input through an op raises the communicator's error,
    and the ranks stay in step. Returns a dict of observations."""
    first = tpcomm.Communicator()
    h1, h1_again = tops.register(first), tops.register(first)
    second = tpcomm.Communicator()
    h2 = tops.register(second)
    x = torch.full((2, 8), float(ctx.rank + 1), dtype=torch.float32)
    by_handle = tops.all_reduce(h2, x)
    second.close()
    closed = raised(lambda: tops.all_reduce(h2, x))
    del second
    gc.collect()
    gone = raised(lambda: tops.all_reduce(h2, x))
    third = tpcomm.Communicator()
    h3 = tops.register(third)
    w = torch.ones(8, dtype=torch.float32)
    bad_weight = raised(lambda: tops.fused_add_rmsnorm(first, x, None, torch.ones(7)))
    fp8_option_without_quant = raised(lambda: tops.fused_add_rmsnorm(first, x, None, w, group_size=4))
    after = tops.fused_add_rmsnorm(first, x, x, w)[1]  # ranks still in step after the refused call
    result = {"h1": h1, "h1_again": h1_again, "h2": h2, "h3": h3, "by_handle": by_handle, "closed": closed,
              "gone": gone, "bad_weight": bad_weight, "after": after,
              "fp8_option_without_quant": fp8_option_without_quant,
              "bad_register": raised(lambda: tops.register(object())),
              "bad_handle": raised(lambda: tops.lookup("1"))}
    first.close()
    third.close()
    return result


def warmup_case(ctx, shapes, ops=None, **kw):
    """``tpcomm.graphs.warmup`` on a fresh communicator (its default ops, or ``ops``): the calls it made,
    and whether each later call of the same signatures (new tensors, through the ops) counts as warmed,
    while another shape does not. ``capture_guard`` on CPU: entered and left (no capture), refusing a
    closed communicator. Returns a dict."""
    comm = tpcomm.Communicator()
    calls = tgraphs.warmup(comm, shapes, dtypes=(torch.bfloat16,), **({"ops": ops} if ops else {}), **kw)
    warmed = tgraphs.warmed(comm)
    sig = lambda op, *ts: (op,) + tuple((tuple(t.shape), t.dtype, True) if t is not None else None for t in ts)  # noqa: E731
    x = torch.zeros(shapes[0], dtype=torch.bfloat16)
    w = torch.ones(shapes[0][-1], dtype=torch.bfloat16)
    other = torch.zeros(7, 9, dtype=torch.bfloat16)
    seen = {"all_reduce": sig("all_reduce", x, x) in warmed,
            "fused": sig("fused_add_rmsnorm(gemma=False)", x, x, w) in warmed,
            "fused_no_res": sig("fused_add_rmsnorm(gemma=False)", x, None, w) in warmed,
            "other_shape": sig("all_reduce", other, other) in warmed}
    scale_shapes = None
    if ops and "fused_add_rmsnorm_fp8_static" in ops:  # warmed with a (1,) scale: () and (1, 1) are the same
        for shape in ((), (1, 1)):
            tops.fused_add_rmsnorm(comm, x, x, w, quant="fp8_static", scale=torch.ones(shape, dtype=torch.float32))
        scale_shapes = len(tgraphs.warmed(comm)) - len(warmed)
    with tgraphs.capture_guard(comm) as guard:
        inside = tops.all_reduce(comm, x)  # not capturing: an ordinary call
    comm.close()
    return {"calls": calls, "count": len(warmed), "seen": seen, "guard": guard is not None,
            "scale_shapes": scale_shapes, "inside": inside.shape == x.shape,
            "closed": raised(lambda: tgraphs.capture_guard(comm).__enter__())}


def warmup_qk_moe_case(ctx):
    """``tpcomm.graphs.warmup`` of the QK norm (``k_width``) and the MoE ops (``topk``, the permuted
    layout with an int32 index, a shared output) for two token counts, then a model's calls through the
    ops with new tensors of those shapes: how many signatures each adds (0: the capture guard accepts
    it). Returns a dict."""
    comm = tpcomm.Communicator()
    ops = ("fused_qk_rmsnorm", "fused_moe_finalize_add_rmsnorm", "moe_finalize")
    calls = tgraphs.warmup(comm, [(2, 64), (1, 64)], ops=ops, k_width=32, topk=2, moe_index=torch.int32,
                           moe_shared=True)
    count = len(tgraphs.warmed(comm))
    g = torch.Generator().manual_seed(ctx.rank)
    bf = dict(dtype=torch.bfloat16)

    def added(fn) -> int:
        before = len(tgraphs.warmed(comm))
        fn()
        return len(tgraphs.warmed(comm)) - before

    def moe(T, K, perm=True, **kw):
        e = torch.randn((T * K, 64) if perm else (T, K, 64), generator=g).to(torch.bfloat16)
        index = torch.randperm(T * K, generator=g).to(torch.int32).view(T, K) if perm else None
        return tops.fused_moe_finalize_add_rmsnorm(
            comm, e, torch.rand((T, K), generator=g), torch.randn((T, 64), generator=g).to(torch.bfloat16),
            torch.ones(64, **bf), index=index, shared_out=torch.randn((T, 64), generator=g).to(torch.bfloat16), **kw)

    qk = lambda T, Hk: tops.fused_qk_rmsnorm(comm, torch.randn((T, 64), generator=g).to(torch.bfloat16),  # noqa: E731
                                             torch.randn((T, Hk), generator=g).to(torch.bfloat16),
                                             torch.ones(64, **bf), torch.ones(Hk, **bf))
    result = {"calls": calls, "count": count,
              "qk": [added(lambda: qk(2, 32)), added(lambda: qk(1, 32))],
              "moe": [added(lambda: moe(2, 2, scaling=2.5)), added(lambda: moe(1, 2))],
              "qk_other_k": added(lambda: qk(2, 16)),
              "moe_other_K": added(lambda: moe(2, 3)),
              "moe_token_order": added(lambda: moe(2, 2, perm=False)),
              "no_topk": raised(lambda: tgraphs.warmup(comm, [(2, 64)], ops=("moe_finalize",))),
              "not_2d": raised(lambda: tgraphs.warmup(comm, [(1, 2, 64)], ops=("fused_qk_rmsnorm",)))}
    comm.close()
    return result


# -- test_example_tp_decoder -------------------------------------------------------------------------------
def example_case(ctx, cfg_fields):
    """``examples/tp_decoder.py``'s rank body on this pool's ranks (no new processes)."""
    import os
    import sys

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import tp_decoder

    return tp_decoder.run_rank(ctx.rank, ctx.world_size, cfg_fields)
