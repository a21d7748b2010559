"""Rank bodies of ``tests/call_cache/test_call_cache.py``: repeated calls (the cached path of ``tpcomm.call_cache``)
against first calls and the contract, calls that change one key field, errors on repeated calls, and
outputs the caller passes. Run by the CPU rank pool as ``fn(ctx, *args)``; each returns a list of
``(what, ok)`` pairs (or messages) for the test to assert on.
"""

from __future__ import annotations

import torch

import tpcomm
import tpcomm.ops as tops
from tests.ops.ranks import _same
from tests.support.numerics import all_inputs, raised, residual_input, weight_input
from tpcomm import call_cache, reference
from tpcomm.kernels import launch as klaunch


class LaunchLog:
    """Counts full-path launches (``Communicator._launch``) and replays (``Replay.launch``) by kernel name
    while active, so a test can tell which path a call took and which kernel it ran."""

    def __init__(self, comm):
        self.comm = comm
        self.full: list[str] = []
        self.replayed: list[str] = []

    def __enter__(self):
        comm, log = self.comm, self
        self._launch, self._replay = comm._launch, klaunch.Replay.launch

        def launch(call):
            log.full.append(call.kernel.__name__)
            return log._launch(call)

        def replay(r, tensors, stream=None, ptrs=None):
            log.replayed.append(r.kernel.__name__)
            return log._replay(r, tensors, stream, ptrs)

        comm._launch = launch
        klaunch.Replay.launch = replay
        return self

    def __exit__(self, *exc):
        del self.comm._launch  # the instance attribute: back to the method
        klaunch.Replay.launch = self._replay

    def take(self) -> tuple[list[str], list[str]]:
        got = (self.full, self.replayed)
        self.full, self.replayed = [], []
        return got


def _expected_fused(xs, res, w, eps, gemma):
    return reference.add_rmsnorm_reference(reference.reduce_in_rank_order(xs), res, w, eps, gemma)


def _fp8_reference(out, quant, fp8_dtype, group_size):
    rows = out.reshape(-1, out.shape[-1])
    if quant == "fp8_per_token":
        q, s = reference.per_token_quant_reference(rows, fp8_dtype)
    else:
        q, s = reference.per_group_quant_reference(rows, group_size, fp8_dtype)
    return q.view(out.shape), s


def repeated_calls_case(ctx, seed, shape, dtype_name):
    """Every op twice (three times for the fused forms), then once more after other calls: the first
    call runs the full path and is recorded, the later ones replay it (no full-path launch), and every
    result has the first call's bits and the contract's. Returns ``(what, ok)`` pairs."""
    dtype = getattr(torch, dtype_name)
    comm = ctx.comm()
    comm._calls.clear()
    xs = all_inputs(seed, ctx.world_size, shape, dtype)
    x = xs[ctx.rank]
    res, w = residual_input(seed, shape, dtype), weight_input(seed, shape[-1], dtype)
    expected_sum = reference.reduce_in_rank_order(xs)
    checks = []
    y = torch.empty_like(x)
    cases = {
        "all_reduce": (lambda: comm.all_reduce(x), lambda got: _same(got, expected_sum)),
        "all_reduce out=": (lambda: comm.all_reduce(x, out=y), lambda got: got is y and _same(got, expected_sum)),
        "all_gather": (lambda: comm.all_gather(x), lambda got: _same(got, torch.cat(xs, 0))),
        "reduce_scatter": (lambda: comm.reduce_scatter(x),
                           lambda got: _same(got, torch.tensor_split(expected_sum, ctx.world_size, 0)[ctx.rank])),
    }
    for gemma in (False, True):
        for with_res in (True, False):
            r = res if with_res else None
            o, ro = _expected_fused(xs, r, w, 1e-5, gemma)
            cases[f"fused gemma={gemma} residual={with_res}"] = (
                lambda r=r, gemma=gemma: comm.fused_add_rmsnorm(x, r, w, eps=1e-5, gemma=gemma),
                lambda got, o=o, ro=ro: _same(got[0], o) and (ro is None and got[1] is None or _same(got[1], ro)))
    if shape[-1] % 16 == 0:
        o, ro = _expected_fused(xs, res, w, 1e-6, False)
        for quant, group, column in (("fp8_per_token", 128, False), ("fp8_per_group", 16, False),
                                     ("fp8_per_group", 16, True)):
            if column and len(shape) != 2:
                continue
            q_ref, s_ref = _fp8_reference(o, quant, torch.float8_e4m3fn, group)
            kw = dict(quant=quant, group_size=group, column_major_scales=column, emit_unquantized=True)
            cases[f"{quant} group={group} column_major={column}"] = (
                lambda kw=kw: comm.fused_add_rmsnorm(x, res, w, **kw),
                lambda got, q_ref=q_ref, s_ref=s_ref, o=o, ro=ro, column=column: (
                    _same(got[0], q_ref) and torch.equal(got[1].reshape(s_ref.shape), s_ref)
                    and (not column or got[1].stride() == (1, got[1].shape[0]))
                    and _same(got[2], ro) and _same(got[3], o)))
    with LaunchLog(comm) as log:
        for name, (call, ok) in cases.items():
            first = call()
            full1, replayed1 = log.take()
            second = call()
            full2, replayed2 = log.take()
            checks.append((f"{name}: first call correct", ok(first)))
            checks.append((f"{name}: first call ran the full path", bool(full1) and not replayed1))
            checks.append((f"{name}: repeated call correct", ok(second)))
            checks.append((f"{name}: repeated call replayed {full1}", not full2 and replayed2 == full1))
        for name, (call, ok) in cases.items():  # every key still cached, in any order
            checks.append((f"{name}: later repeat correct", ok(call())))
        full, _ = log.take()
        checks.append(("later repeats replayed", not full))
    return checks


def changed_key_case(ctx, seed):
    """A recorded call, then calls that change one key field each (dtype, strides, H, residual or none,
    FP8 mode, algorithm, eps, Gemma), each followed by the base call: every changed call takes the full
    path and is right, the base call still replays and is right. A stale plan would give wrong values,
    shapes or kernels. Returns ``(what, ok)`` pairs."""
    comm = ctx.comm()
    comm._calls.clear()
    T, H = 3, 64
    xs = all_inputs(seed, ctx.world_size, (T, H), torch.bfloat16)
    x = xs[ctx.rank]
    res, w = residual_input(seed, (T, H), torch.bfloat16), weight_input(seed, H, torch.bfloat16)
    checks = []

    def fused_ok(got, xs_, res_, w_, eps=1e-6, gemma=False):
        o, ro = _expected_fused(xs_, res_, w_, eps, gemma)
        return _same(got[0], o) and (ro is None or _same(got[1], ro))

    base = lambda: comm.fused_add_rmsnorm(x, res, w)  # noqa: E731
    xs16 = [t.to(torch.float16) for t in xs]
    xs_wide = all_inputs(seed + 1, ctx.world_size, (T, 2 * H), torch.bfloat16)
    res_wide, w_wide = residual_input(seed + 1, (T, 2 * H), torch.bfloat16), weight_input(seed + 1, 2 * H,
                                                                                          torch.bfloat16)
    # the same values in a transposed layout: another stride, copied by the full path
    x_t = x.t().contiguous().t()
    changed = {
        "dtype": (lambda: comm.fused_add_rmsnorm(xs16[ctx.rank], res.half(), w.half()),
                  lambda got: fused_ok(got, xs16, res.half(), w.half())),
        "strides": (lambda: comm.fused_add_rmsnorm(x_t, res, w), lambda got: fused_ok(got, xs, res, w)),
        # one object as two arguments, then the same shapes as distinct tensors (the base call)
        "x as residual": (lambda: comm.fused_add_rmsnorm(x, x, w), lambda got: fused_ok(got, xs, x, w)),
        "hidden": (lambda: comm.fused_add_rmsnorm(xs_wide[ctx.rank], res_wide, w_wide),
                   lambda got: fused_ok(got, xs_wide, res_wide, w_wide)),
        "no residual": (lambda: comm.fused_add_rmsnorm(x, None, w),
                        lambda got: got[1] is None and fused_ok(got, xs, None, w)),
        "eps": (lambda: comm.fused_add_rmsnorm(x, res, w, eps=0.5), lambda got: fused_ok(got, xs, res, w, eps=0.5)),
        "gemma": (lambda: comm.fused_add_rmsnorm(x, res, w, gemma=True),
                  lambda got: fused_ok(got, xs, res, w, gemma=True)),
        "fp8 per token": (lambda: comm.fused_add_rmsnorm(x, res, w, quant="fp8_per_token"),
                          lambda got: got[0].dtype == torch.float8_e4m3fn and got[1].shape == (T, 1)),
        "fp8 per group": (lambda: comm.fused_add_rmsnorm(x, res, w, quant="fp8_per_group", group_size=32),
                          lambda got: got[0].dtype == torch.float8_e4m3fn and got[1].shape == (T, 2)),
        "fp8 e4m3fnuz": (lambda: comm.fused_add_rmsnorm(x, res, w, quant="fp8_per_token",
                                                        fp8_dtype=torch.float8_e4m3fnuz),
                         lambda got: got[0].dtype == torch.float8_e4m3fnuz),
    }
    with LaunchLog(comm) as log:
        base()
        log.take()
        checks.append(("base call replays", fused_ok(base(), xs, res, w) and log.take()[0] == []))
        for name, (call, ok) in changed.items():
            got = call()
            full, replayed = log.take()
            checks.append((f"{name}: right result", ok(got)))
            checks.append((f"{name}: planned afresh", bool(full) and not replayed))
            again = base()
            full, replayed = log.take()
            checks.append((f"{name}: base call after it still replays and is right",
                           not full and bool(replayed) and fused_ok(again, xs, res, w)))
            checks.append((f"{name}: repeated, right again", ok(call())))  # replayed, or (strides) not recorded
            log.take()
        # a non-contiguous input is copied by the full path, so it is never recorded: every call is planned
        for rep in range(2):
            got = comm.all_reduce(x_t)
            full, replayed = log.take()
            checks.append((f"non-contiguous all_reduce #{rep}: right, full path",
                           _same(got, reference.reduce_in_rank_order(xs)) and bool(full) and not replayed))
        # the algorithm is part of the key: the same call under each forced algorithm runs that kernel
        kernels = {}
        for algo in ("lamport", "one_shot", "two_shot"):
            with comm.use_algorithm(algo):
                got = base()
                full, replayed = log.take()
                again = base()
                full2, replayed2 = log.take()
            kernels[algo] = full
            checks.append((f"algorithm {algo}: planned afresh, then replayed",
                           bool(full) and not replayed and not full2 and replayed2 == full))
            checks.append((f"algorithm {algo}: right result", fused_ok(got, xs, res, w) and fused_ok(again, xs, res,
                                                                                                     w)))
        checks.append((f"each algorithm its own kernel {kernels}", len({tuple(k) for k in kernels.values()}) == 3))
    return checks


def errors_repeat_case(ctx):
    """Input errors raise the same exception on the first call and on every later one, also right after
    a valid call whose key differs from the bad one only in a type (``eps=True`` after ``eps=1.0``) or
    an address (an ``out`` that overlaps ``x``). Returns ``(what, first, second)`` with what was raised."""
    comm = ctx.comm()
    x = torch.randn(2, 32).to(torch.bfloat16)
    res, w = torch.randn(2, 32).to(torch.bfloat16), torch.ones(32, dtype=torch.bfloat16)
    buf = torch.zeros(2 * 32 + 1, dtype=torch.bfloat16)
    valid_then_bad = {
        "eps=True": (lambda: comm.fused_add_rmsnorm(x, res, w, eps=1.0),
                     lambda: comm.fused_add_rmsnorm(x, res, w, eps=True)),
        "gemma=1": (lambda: comm.fused_add_rmsnorm(x, res, w, gemma=True),
                    lambda: comm.fused_add_rmsnorm(x, res, w, gemma=1)),
        "group_size=True": (lambda: comm.fused_add_rmsnorm(x, res, w, quant="fp8_per_group", group_size=1),
                            lambda: comm.fused_add_rmsnorm(x, res, w, quant="fp8_per_group", group_size=True)),
        "dim=True": (lambda: comm.all_gather(x, dim=1), lambda: comm.all_gather(x, dim=True)),
        "residual dtype": (lambda: comm.fused_add_rmsnorm(x, res, w),
                           lambda: comm.fused_add_rmsnorm(x, res.half(), w)),
        "weight shape": (lambda: comm.fused_add_rmsnorm(x, res, w), lambda: comm.fused_add_rmsnorm(x, res, w[:16])),
        "out overlaps x": (lambda: comm.fused_add_rmsnorm(x, res, w, out=torch.empty_like(x)),
                           lambda: comm.fused_add_rmsnorm(buf[:64].view(2, 32), res, w, out=buf[1:].view(2, 32))),
        "residual_out overlaps weight": (
            lambda: comm.fused_add_rmsnorm(x, res, w, residual_out=torch.empty_like(res)),
            lambda: comm.fused_add_rmsnorm(x, res, buf[:32], residual_out=buf[:64].view(2, 32))),
    }
    found = []
    for name, (valid, bad) in valid_then_bad.items():
        valid()
        valid()  # recorded and replayed
        found.append((name, raised(bad), raised(bad)))
    # a closed communicator refuses a call whose key is cached
    other = tpcomm.Communicator()
    other.all_reduce(x)
    other.all_reduce(x)
    other.close()
    found.append(("closed", raised(lambda: other.all_reduce(x)), raised(lambda: other.all_reduce(x))))
    return found


def partial_overlap_case(ctx, seed):
    """``all_reduce(x, out=)`` with ``out`` overlapping ``x`` in part, after the same key (shapes,
    strides) was recorded with a separate ``out``: the repeated call sees the overlap and reduces from a
    copy (the full path), so the result is still exact. Returns ``(what, ok)`` pairs."""
    comm = ctx.comm()
    n = 64
    xs = all_inputs(seed, ctx.world_size, (n + 1,), torch.float32)
    expected = reference.reduce_in_rank_order([t[1:] for t in xs])
    buf = xs[ctx.rank].clone()
    sep = torch.empty(n, dtype=torch.float32)
    comm.all_reduce(buf[1:], out=sep)
    comm.all_reduce(buf[1:], out=sep)
    got = comm.all_reduce(buf[1:], out=buf[:-1])
    return [("separate out", _same(sep, expected)), ("overlapping out", got.data_ptr() == buf.data_ptr()
                                                     and _same(buf[:-1].clone(), expected))]


def given_outputs_case(ctx, seed, shape, dtype_name):
    """``fused_add_rmsnorm`` with ``out``, ``residual_out`` (separate, and ``residual`` itself), ``q_out``
    and ``scales_out``, by method and through ``tpcomm.ops``, twice each: the given tensors are returned
    and hold the bits of the allocating call. Returns ``(what, ok)`` pairs."""
    dtype = getattr(torch, dtype_name)
    comm = ctx.comm()
    xs = all_inputs(seed, ctx.world_size, shape, dtype)
    x = xs[ctx.rank]
    res, w = residual_input(seed, shape, dtype), weight_input(seed, shape[-1], dtype)
    o_ref, ro_ref = comm.fused_add_rmsnorm(x, res, w)
    checks = []
    for via in ("method", "ops"):
        call = comm.fused_add_rmsnorm if via == "method" else (lambda *a, **k: tops.fused_add_rmsnorm(comm, *a, **k))
        for rep in range(2):
            out, ro = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
            got = call(x, res, w, out=out, residual_out=ro)
            checks.append((f"{via} #{rep}: out and residual_out", got[0] is out and got[1] is ro
                           and _same(out, o_ref) and _same(ro, ro_ref)))
            only_out = call(x, res, w, out=out)
            checks.append((f"{via} #{rep}: out alone", only_out[0] is out and _same(only_out[1], ro_ref)))
            inplace = res.clone()
            out2 = torch.empty_like(x)
            got = call(x, inplace, w, out=out2, residual_out=inplace)
            checks.append((f"{via} #{rep}: residual in place", got[1] is inplace and _same(inplace, ro_ref)
                           and _same(out2, o_ref)))
            inplace = res.clone()
            got = call(x, inplace, w, out=out2, residual_out=inplace.view(inplace.shape))  # a view of all of it
            checks.append((f"{via} #{rep}: residual in place through a view", _same(inplace, ro_ref)
                           and _same(got[1], ro_ref) and _same(out2, o_ref)))
            no_res = call(x, None, w, out=out2)
            checks.append((f"{via} #{rep}: no residual", no_res[1] is None
                           and _same(out2, comm.fused_add_rmsnorm(x, None, w)[0])))
            if shape[-1] % 16 == 0 and len(shape) == 2:
                for quant, column in (("fp8_per_token", False), ("fp8_per_group", False), ("fp8_per_group", True)):
                    kw = dict(quant=quant, group_size=16 if quant == "fp8_per_group" else 128,
                              column_major_scales=column)
                    q_ref, s_ref, ro_q, _ = comm.fused_add_rmsnorm(x, res, w, **kw)
                    q = torch.empty_like(q_ref)
                    s = torch.empty_like(s_ref.t()).t() if column else torch.empty_like(s_ref)
                    res_io = res.clone()
                    out_u = torch.empty_like(x)
                    got = call(x, res_io, w, emit_unquantized=True, out=out_u, residual_out=res_io, q_out=q,
                               scales_out=s, **kw)
                    checks.append((f"{via} #{rep}: {quant} column_major={column}",
                                   got[0] is q and got[1] is s and got[2] is res_io and got[3] is out_u
                                   and _same(q, q_ref) and torch.equal(s, s_ref) and _same(res_io, ro_q)
                                   and _same(out_u, o_ref)))
                    q2 = torch.empty_like(q_ref)
                    got = call(x, res, w, q_out=q2, **kw)  # the scales allocated
                    checks.append((f"{via} #{rep}: {quant} q_out alone", got[0] is q2 and _same(q2, q_ref)
                                   and torch.equal(got[1], s_ref) and got[1].stride() == s_ref.stride()))
    return checks


def bad_outputs_case(ctx):
    """Given outputs that cannot be used: each raises ``(type, message)`` on two calls in a row."""
    comm = ctx.comm()
    x = torch.randn(2, 32).to(torch.bfloat16)
    res, w = torch.randn(2, 32).to(torch.bfloat16), torch.ones(32, dtype=torch.bfloat16)
    _shared = torch.empty_like(x)
    cases = {
        "out of another dtype": lambda: comm.fused_add_rmsnorm(x, res, w, out=torch.empty(2, 32)),
        "out of another shape": lambda: comm.fused_add_rmsnorm(x, res, w, out=torch.empty(2, 16, dtype=x.dtype)),
        "out not contiguous": lambda: comm.fused_add_rmsnorm(x, res, w, out=torch.empty(32, 2, dtype=x.dtype).t()),
        "out is x": lambda: comm.fused_add_rmsnorm(x, res, w, out=x),
        "out is residual_out": lambda: comm.fused_add_rmsnorm(x, res, w, out=res, residual_out=res),
        "residual_out without residual": lambda: comm.fused_add_rmsnorm(x, None, w, residual_out=torch.empty_like(x)),
        "residual_out is x": lambda: comm.fused_add_rmsnorm(x, res, w, residual_out=x),
        "out with quant, no emit": lambda: comm.fused_add_rmsnorm(x, res, w, quant="fp8_per_token",
                                                                  out=torch.empty_like(x)),
        "ops: out with quant, no emit": lambda: tops.fused_add_rmsnorm(comm, x, res, w, quant="fp8_per_token",
                                                                       out=torch.empty_like(x)),
        "ops: out is residual_out": lambda: tops.fused_add_rmsnorm(comm, x, res, w, out=_shared, residual_out=_shared),
        "q_out without quant": lambda: comm.fused_add_rmsnorm(
            x, res, w, q_out=torch.empty(2, 32, dtype=torch.float8_e4m3fn)),
        "q_out of another format": lambda: comm.fused_add_rmsnorm(
            x, res, w, quant="fp8_per_token", q_out=torch.empty(2, 32, dtype=torch.float8_e4m3fnuz)),
        "scales_out row-major for column-major": lambda: comm.fused_add_rmsnorm(
            x, res, w, quant="fp8_per_group", group_size=16, column_major_scales=True,
            scales_out=torch.empty(2, 2)),
        "scales_out of another shape": lambda: comm.fused_add_rmsnorm(
            x, res, w, quant="fp8_per_token", scales_out=torch.empty(2)),
        "scales_out float16": lambda: comm.fused_add_rmsnorm(
            x, res, w, quant="fp8_per_token", scales_out=torch.empty(2, 1, dtype=torch.float16)),
    }
    # the same shapes as a clean in-place call recorded just before: the repeated call checks them too
    clean = torch.zeros_like(res)
    buf = torch.zeros(3 * 32, dtype=x.dtype)
    x_in, res_in_x = buf[:64].view(2, 32), buf[32:].view(2, 32)  # the residual starts one row into x
    x_in.copy_(x)
    wbuf = torch.zeros(3 * 32, dtype=x.dtype)
    res_w, w_in_res = wbuf[:64].view(2, 32), wbuf[32:64]  # the weight is the residual's second row
    w_in_res.fill_(1.0)

    def after_clean(call):
        def run():
            comm.fused_add_rmsnorm(x, clean, w, residual_out=clean)
            return call()
        return run
    cases["in-place residual_out inside x, after a clean call"] = after_clean(
        lambda: comm.fused_add_rmsnorm(x_in, res_in_x, w, residual_out=res_in_x))
    cases["in-place residual_out holding the weight, after a clean call"] = after_clean(
        lambda: comm.fused_add_rmsnorm(x, res_w, w_in_res, residual_out=res_w))
    return [(name, raised(call), raised(call)) for name, call in cases.items()]


def bounded_cache_case(ctx, limit, shapes):
    """A cache of ``limit`` entries over more call shapes than that: never more entries than the limit,
    and every call, evicted or not, is right. Returns ``(entries seen, all right)``."""
    comm = ctx.comm()
    comm._calls.clear()
    saved, comm._calls.max_entries = comm._calls.max_entries, limit
    try:
        ok, sizes = True, []
        for rep in range(2):
            for shape in shapes:
                xs = all_inputs(7, ctx.world_size, shape, torch.float32)
                ok &= _same(comm.all_reduce(xs[ctx.rank]), reference.reduce_in_rank_order(xs))
                sizes.append(len(comm._calls))
        return max(sizes), ok
    finally:
        comm._calls.max_entries = saved
        comm._calls.clear()


def replay_holds_no_tensor_case(ctx):
    """The cache keeps no reference to any call's tensors, the recording call's included: inputs and
    outputs of a first and a repeated call are freed once the caller drops them. Returns
    ``(what, ok)`` pairs."""
    import gc
    import weakref

    comm = ctx.comm()
    comm._calls.clear()
    checks = []
    for name, call in (("all_reduce", lambda x, r, w: (comm.all_reduce(x),)),
                       ("fused", lambda x, r, w: comm.fused_add_rmsnorm(x, r, w)),
                       ("fused FP8", lambda x, r, w: comm.fused_add_rmsnorm(x, r, w, quant="fp8_per_token")),
                       ("all_gather", lambda x, r, w: (comm.all_gather(x),))):
        for which in ("first", "repeated"):
            x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.ones(16)
            outs = call(x, r, w)
            refs = [weakref.ref(t) for t in (x, r, w, *outs) if t is not None]
            del x, r, w, outs
            gc.collect()
            checks.append((f"{name}, {which} call: tensors freed", all(ref() is None for ref in refs)))
    checks.append(("calls were recorded", len(comm._calls) == 4 and call_cache.MAX_ENTRIES >= 1))
    return checks


def bad_argument_types_case(ctx):
    """Arguments of the wrong type (None for a tensor, unhashable scalars), twice each: ``(what, first,
    second)`` with what was raised (the key of such a call is skipped, so the full path names the
    argument)."""
    import numpy as np

    comm = ctx.comm()
    x, w = torch.ones(2, 32), torch.ones(32)
    cases = {
        "all_reduce(None)": lambda: comm.all_reduce(None),
        "all_gather(None)": lambda: comm.all_gather(None),
        "reduce_scatter(None)": lambda: comm.reduce_scatter(None),
        "fused x=None": lambda: comm.fused_add_rmsnorm(None, None, w),
        "fused weight=None": lambda: comm.fused_add_rmsnorm(x, None, None),
        "fused eps=[1e-6]": lambda: comm.fused_add_rmsnorm(x, None, w, eps=[1e-6]),
        "fused eps=np.array(1e-6)": lambda: comm.fused_add_rmsnorm(x, None, w, eps=np.array(1e-6)),
        "fused gemma=[True]": lambda: comm.fused_add_rmsnorm(x, None, w, gemma=[True]),
        "fused quant=[...]": lambda: comm.fused_add_rmsnorm(x, None, w, quant=["fp8_per_token"]),
        "all_gather dim=[0]": lambda: comm.all_gather(x, dim=[0]),
    }
    comm.fused_add_rmsnorm(x, None, w)  # a valid key of the same shapes is cached
    got = [(name, raised(call), raised(call)) for name, call in cases.items()]
    ok_numpy_dim = _same(comm.all_gather(x, dim=np.int64(0)), comm.all_gather(x, dim=0))
    return got, ok_numpy_dim


def compiled_outputs_case(ctx):
    """``tpcomm.ops``' given outputs under ``torch.compile(fullgraph=True, backend="aot_eager")``: a separate
    ``out`` and ``residual_out``, the residual in place, FP8 into given ``q_out`` / ``scales_out``; each
    equal to the eager method's bits. And ``out=x`` refused compiled too. Returns ``(what, ok)`` pairs."""
    import torch._dynamo

    comm = ctx.comm()
    torch._dynamo.reset()
    xs = all_inputs(21, ctx.world_size, (3, 32), torch.bfloat16)
    x = xs[ctx.rank]
    res, w = residual_input(21, (3, 32), torch.bfloat16), weight_input(21, 32, torch.bfloat16)
    o_ref, ro_ref = comm.fused_add_rmsnorm(x, res, w)
    q_ref, s_ref, _, _ = comm.fused_add_rmsnorm(x, res, w, quant="fp8_per_token")

    def separate(x, r, w, out, ro):
        return tops.fused_add_rmsnorm(comm, x, r, w, out=out, residual_out=ro)

    def in_place(x, r, w, out):
        return tops.fused_add_rmsnorm(comm, x, r, w, out=out, residual_out=r)

    def fp8(x, r, w, q, s):
        return tops.fused_add_rmsnorm(comm, x, r, w, quant="fp8_per_token", q_out=q, scales_out=s)

    def onto_x(x, r, w):
        return tops.fused_add_rmsnorm(comm, x, r, w, out=x)

    checks = []
    out, ro = torch.empty_like(x), torch.empty_like(x)
    torch.compile(separate, fullgraph=True, backend="aot_eager")(x, res, w, out, ro)
    checks.append(("separate out and residual_out", _same(out, o_ref) and _same(ro, ro_ref)))
    r2, out2 = res.clone(), torch.empty_like(x)
    torch.compile(in_place, fullgraph=True, backend="aot_eager")(x, r2, w, out2)
    checks.append(("residual in place", _same(r2, ro_ref) and _same(out2, o_ref)))
    q, s = torch.empty_like(q_ref), torch.empty_like(s_ref)
    torch.compile(fp8, fullgraph=True, backend="aot_eager")(x, res, w, q, s)
    checks.append(("FP8 into q_out and scales_out", _same(q, q_ref) and torch.equal(s, s_ref)))
    x3 = x.clone()
    err = raised(lambda: torch.compile(onto_x, fullgraph=True, backend="aot_eager")(x3, res, w))
    checks.append((f"out=x refused compiled ({err})", err is not None and "out shares memory with x" in err[1]
                   and _same(x3, x)))
    return checks


def close_while_calling_case(ctx):
    """``close()`` from another thread while a call runs (the call on this thread: Triton's interpreter
    runs kernels on one thread only): the call completes or raises a named error, the process does not
    crash, the communicator ends closed. Returns ``(what the call did, closer still alive, closed)``."""
    import threading
    import time as _time

    from tpcomm.errors import PeerTimeoutError

    comm = tpcomm.Communicator(timeout_s=2.0)
    x = torch.randn(16, 512)
    comm.all_reduce(x)  # compiled and recorded
    seen = []
    closer = threading.Thread(target=lambda: (_time.sleep(0.005), comm.close()))
    closer.start()
    try:
        for _ in range(3):
            comm.all_reduce(x)
        seen.append("completed")
    except (RuntimeError, PeerTimeoutError) as e:
        seen.append(type(e).__name__)
    closer.join(timeout=30)
    return seen, closer.is_alive(), comm.closed


def negative_view_case(ctx):
    """Inputs that are lazily negated views (``torch._neg_view``: the negative bit set, memory not
    negated), first and repeated calls: the sums of the negated values. Returns ``(what, ok)`` pairs."""
    comm = ctx.comm()
    xs = all_inputs(31, ctx.world_size, (2, 32), torch.float32)
    res, w = residual_input(31, (2, 32), torch.float32), weight_input(31, 32, torch.float32)
    neg = [-t for t in xs]
    s = reference.reduce_in_rank_order(neg)
    o, ro = reference.add_rmsnorm_reference(s, res, w, 1e-6)
    checks = []
    for rep in range(2):
        v = torch._neg_view(xs[ctx.rank])
        checks.append((f"all_reduce #{rep}", _same(comm.all_reduce(v), s)))
        got = comm.fused_add_rmsnorm(v, res, w)
        checks.append((f"fused #{rep}", _same(got[0], o) and _same(got[1], ro)))
        checks.append((f"all_gather #{rep}", _same(comm.all_gather(v), torch.cat(neg))))
    # a negated output would read the kernels' results negated: refused, on every call, also after a call
    # with a plain output of the same layout was recorded
    x, y, o2, ro2 = xs[ctx.rank], torch.empty(2, 32), torch.empty(2, 32), torch.empty(2, 32)
    comm.all_reduce(x, out=y)
    comm.fused_add_rmsnorm(x, res, w, out=o2, residual_out=ro2)
    for rep in range(2):
        for name, call in (("all_reduce out=", lambda: comm.all_reduce(x, out=torch._neg_view(y))),
                           ("fused out=", lambda: comm.fused_add_rmsnorm(x, res, w, out=torch._neg_view(o2),
                                                                         residual_out=ro2)),
                           ("fused residual_out=", lambda: comm.fused_add_rmsnorm(
                               x, res, w, out=o2, residual_out=torch._neg_view(ro2)))):
            err = raised(call)
            checks.append((f"{name} negated #{rep}: {err}", err is not None and err[0] == "ValueError"
                           and "negative bit" in err[1]))
    return checks
