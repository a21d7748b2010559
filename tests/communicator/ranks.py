"""Rank bodies: module-level functions the harness runs on every rank (they pickle by name).

Pool bodies take ``(ctx, *args)`` (``ctx``: :class:`harness.RankContext`); launch bodies (for
``tpcomm.launch.launch``) take ``(rank, world_size, *args)``. Each body rebuilds every rank's input from
the case's seed, runs the op, computes the expected result locally with the plain-torch reference, and
returns tensors; the assertions live in the test files, which see every rank's answer at once.

Bodies catch only the exceptions a test expects (and return what they saw); anything else propagates
and fails the test with the rank's traceback.

Used by ``tests/communicator/test_communicator.py`` and ``tests/communicator/test_workspace.py``; the
all-reduce and fused bodies they share with the one-shot tests are in ``tests/collectives/ranks.py``.
"""

from __future__ import annotations

import json
import os
import random
import time

import torch
import torch.distributed as dist

import tpcomm
from tests.support.harness import new_communicator
from tests.support.numerics import all_inputs, bits, raised, residual_input, weight_input
from tpcomm import dispatch


# -- row counts and chunked calls -----------------------------------------------------------------------
def fused_rows(ctx, seed, shape, dtype, row_counts, max_bytes=None, algo=None):
    """``fused_add_rmsnorm`` and ``all_reduce`` of the first ``n`` rows for each ``n`` in
    ``row_counts`` (batch invariance: a row's bits must not depend on how many rows share the call)."""
    comm = ctx.comm(max_bytes, algo=algo)
    H = shape[-1]
    xs = all_inputs(seed, ctx.world_size, shape, dtype)
    res = residual_input(seed, shape, dtype)
    w = weight_input(seed, H, dtype)
    x = xs[ctx.rank]
    runs = {}
    for n in row_counts:
        out, ro = comm.fused_add_rmsnorm(x[:n], res[:n], w)
        runs[n] = {"out": out, "residual_out": ro, "s": comm.all_reduce(x[:n])}
    return runs


def chunked_vs_whole(ctx, seed, shape, dtype, small_max_bytes, op, algo=None):
    """The same call on a communicator that needs several launches (``small_max_bytes``) and on the
    default one (one launch), plus how many launches the small one made (its epoch advances once per
    launch)."""
    small, whole = ctx.comm(small_max_bytes, algo=algo), ctx.comm(algo=algo)
    H = shape[-1]
    xs = all_inputs(seed, ctx.world_size, shape, dtype)
    x = xs[ctx.rank]
    if op == "fused_add_rmsnorm":
        res = residual_input(seed, shape, dtype)
        w = weight_input(seed, H, dtype)
        call = lambda c: c.fused_add_rmsnorm(x, res, w)  # noqa: E731
        nbytes, hidden = x.numel() * x.element_size(), H
    else:
        call = lambda c: (c.all_reduce(x), None)  # noqa: E731
        nbytes, hidden = x.numel() * x.element_size(), dispatch.all_reduce_width(x.numel(), x.element_size(),
                                                                                 small.workspace)
    before = small.workspace.epoch()
    chunked = call(small)
    launches = small.workspace.epoch() - before
    one = call(whole)
    ws = small.workspace
    plan = small.plan(op, nbytes, hidden, dtype).algorithm
    es = x.element_size()
    rows = -(-x.numel() // hidden)
    if plan == "two_shot":  # launches carry up to share_rows_per_launch rows of every share
        per, local_rows = ws.share_rows_per_launch(hidden, es), -(-rows // ctx.world_size)
    else:
        lamport = plan == "lamport" and ws.lamport_rows_per_launch(hidden, es) >= 1
        per, local_rows = (ws.lamport_rows_per_launch if lamport else ws.rows_per_launch)(hidden, es), rows
    return {"chunked": chunked, "whole": one, "launches": launches,
            "rows_per_launch": per, "expected_launches": -(-local_rows // per) if per else None, "rows": rows,
            "plan_small": small.plan(op, nbytes, hidden, dtype).algorithm,
            "plan_whole": whole.plan(op, nbytes, hidden, dtype).algorithm,
            "ref": tpcomm.reduce_in_rank_order(xs)}


# -- repeated calls, skew ---------------------------------------------------------------------------------
#: (op, shape, dtype) of the soak's steps, cycled: alternating ops, sizes, dtypes (under ``auto`` 16-bit
#: calls take Lamport and fp32 calls one-shot, so the two algorithms interleave on one epoch counter),
#: row counts above and below the CPU grid cap of 4 programs, and a multi-row flat all_reduce.
SOAK_STEPS = [("fused", (1, 64), torch.bfloat16), ("all_reduce", (5, 33), torch.float32),
              ("fused", (5, 64), torch.bfloat16), ("all_reduce", (1,), torch.float16),
              ("fused", (3, 123), torch.float32), ("all_reduce", (4100,), torch.bfloat16),
              ("fused_no_res", (2, 16), torch.float16)]


def soak(ctx, seed, steps, max_skew_s=0.0, algo=None):
    """``steps`` calls back to back, cycling through ``SOAK_STEPS`` with new inputs each step, each rank
    sleeping a different random time (up to ``max_skew_s``) before every call. Returns, per step,
    ``(step, op, shape, dtype name, ok, digest)``: ``ok`` when ``s``/``residual_out`` were bit-exact and
    ``out`` within 1 ulp of the reference (2 for fp32 at these widths, see numerics), ``digest`` a
    hash of the output bits for the cross-rank comparison."""
    import hashlib

    from tests.support.numerics import bits, out_ulp_tolerance, ulp_distance

    comm = ctx.comm(algo=algo)
    rng = random.Random(seed * 7919 + ctx.rank)  # a different delay sequence on every rank
    digest = lambda t: hashlib.sha256(bits(t).numpy().tobytes()).hexdigest()  # noqa: E731
    report = []
    for i in range(steps):
        op, shape, dtype = SOAK_STEPS[i % len(SOAK_STEPS)]
        case = seed * 1000 + i
        xs = all_inputs(case, ctx.world_size, shape, dtype)
        if max_skew_s:
            time.sleep(rng.uniform(0, max_skew_s))
        name = str(dtype).replace("torch.", "")
        if op == "all_reduce":
            y = comm.all_reduce(xs[ctx.rank])
            ok = torch.equal(bits(y), bits(tpcomm.reduce_in_rank_order(xs)))
            report.append((i, op, shape, name, ok, digest(y)))
            continue
        res = residual_input(case, shape, dtype) if op == "fused" else None
        w = weight_input(case, shape[-1], dtype)
        out, ro = comm.fused_add_rmsnorm(xs[ctx.rank], res, w)
        out_ref, ro_ref = tpcomm.add_rmsnorm_reference(tpcomm.reduce_in_rank_order(xs), res, w, 1e-6)
        ok = (int(ulp_distance(out, out_ref).max()) <= out_ulp_tolerance(dtype, shape[-1])
              and not out.isnan().any())
        if res is not None:
            ok = ok and torch.equal(bits(ro), bits(ro_ref))
        report.append((i, op, shape, name, ok, digest(out)))
    return report


# -- validation -----------------------------------------------------------------------------------------
def _bad_call(comm, case: str):
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    r = torch.randn(4, 32, dtype=torch.bfloat16)
    w = torch.ones(32, dtype=torch.bfloat16)
    fused, ar = comm.fused_add_rmsnorm, comm.all_reduce
    calls = {
        "fused_int_x": lambda: fused(x.to(torch.int32), None, w),
        "fused_fp8_x": lambda: fused(x.to(torch.float8_e4m3fn), None, w),
        "all_reduce_fp8_x": lambda: ar(x.to(torch.float8_e4m3fn)),
        "all_reduce_bool_x": lambda: ar(x > 0),
        "all_reduce_complex_x": lambda: ar(torch.zeros(4, dtype=torch.complex64)),
        "residual_shape": lambda: fused(x, r[:, :16], torch.ones(32, dtype=torch.bfloat16)),
        "residual_rows": lambda: fused(x, r[:3], w),
        "residual_dtype": lambda: fused(x, r.to(torch.float16), w),
        "weight_shape": lambda: fused(x, r, torch.ones(31, dtype=torch.bfloat16)),
        "weight_2d": lambda: fused(x, r, torch.ones(1, 32, dtype=torch.bfloat16)),
        "weight_int": lambda: fused(x, r, torch.ones(32, dtype=torch.int32)),
        "eps_negative": lambda: fused(x, r, w, eps=-1e-6),
        "eps_inf": lambda: fused(x, r, w, eps=float("inf")),
        "eps_nan": lambda: fused(x, r, w, eps=float("nan")),
        "out_shape": lambda: ar(x, out=torch.empty(4, 33, dtype=torch.bfloat16)),
        "out_dtype": lambda: ar(x, out=torch.empty(4, 32, dtype=torch.float16)),
        "x_not_tensor_fused": lambda: fused(x.tolist(), r, w),
        "x_not_tensor_all_reduce": lambda: ar(x.tolist()),
        "residual_not_tensor": lambda: fused(x, r.tolist(), w),
        "weight_not_tensor": lambda: fused(x, r, [1.0] * 32),
        "out_not_tensor": lambda: ar(x, out=x.tolist()),
        "x_scalar": lambda: fused(torch.tensor(1.0, dtype=torch.bfloat16), None, w[:1]),
        "eps_none": lambda: fused(x, r, w, eps=None),
        "eps_float32_overflow": lambda: fused(x, r, w, eps=1e300),
        "eps_int_beyond_float64": lambda: fused(x, r, w, eps=10 ** 400),
        "gemma_not_bool": lambda: fused(x, r, w, gemma="no"),
        "quant_empty": lambda: fused(x, r, w, quant=""),
        "x_meta_device_fused": lambda: fused(x.to("meta"), r, w),
        "x_meta_device_all_reduce": lambda: ar(x.to("meta")),
    }
    return calls[case]


def bad_input_case(ctx, case):
    """What a bad call raised (type name, message), or None; then a good call, to show the
    communicator is still in step on every rank."""
    comm = ctx.comm()
    seen = raised(_bad_call(comm, case))
    x = torch.full((2, 32), float(ctx.rank + 1), dtype=torch.bfloat16)
    after = comm.all_reduce(x)
    return {"error": seen, "after": after}


def zero_tokens_case(ctx, dtype, H):
    """Zero-token calls (every form) on every rank, then a normal call that must still be right."""
    comm = ctx.comm()
    x = torch.empty(0, H, dtype=dtype)
    w = torch.ones(H, dtype=dtype)
    epoch = comm.workspace.epoch() if comm.workspace is not None else None
    out, ro = comm.fused_add_rmsnorm(x, torch.empty(0, H, dtype=dtype), w)
    out_nr, ro_nr = comm.fused_add_rmsnorm(x, None, w)
    y = comm.all_reduce(x)
    y0 = comm.all_reduce(torch.empty(0, dtype=dtype))
    epoch_after = comm.workspace.epoch() if comm.workspace is not None else None
    xs = [torch.full((1, 8), float(q + 1), dtype=dtype) for q in range(ctx.world_size)]
    after = comm.all_reduce(xs[ctx.rank])
    return {"out": out, "residual_out": ro, "out_nr": out_nr, "ro_nr": ro_nr, "y": y, "y0": y0,
            "epoch": epoch, "epoch_after": epoch_after, "after": after,
            "after_ref": tpcomm.reduce_in_rank_order(xs)}


def integer_all_reduce_case(ctx, dtype, shape):
    """An integer all_reduce (the torch.distributed fallback): exact."""
    comm = ctx.comm()
    xs = [torch.arange(q, q + int(torch.tensor(shape).prod())).reshape(shape).to(dtype) * (q + 1)
          for q in range(ctx.world_size)]
    y = comm.all_reduce(xs[ctx.rank])
    exact = sum(x.to(torch.int64) for x in xs)
    return {"y": y, "exact": exact, "plan": comm.plan("all_reduce", 64, 16, dtype).algorithm}


def constructor_error_case(ctx, case):
    """What ``Communicator(...)`` raised for a bad argument or environment (before any collective)."""
    saved = os.environ.get("TPCOMM_ALGO")
    if case == "algo_env":
        os.environ["TPCOMM_ALGO"] = "warp_speed"
    try:
        kwargs = {"max_bytes_zero": {"max_bytes": 0}, "max_bytes_negative": {"max_bytes": -4096},
                  "max_bytes_differ": {"max_bytes": 4096 * (ctx.rank + 1)},  # collective: every rank
                  "timeout_zero": {"timeout_s": 0}, "timeout_negative": {"timeout_s": -1.0},
                  "timeout_inf": {"timeout_s": float("inf")}, "algo_env": {},
                  "max_bytes_float": {"max_bytes": 4096.5}, "timeout_str": {"timeout_s": "abc"},
                  "group_str": {"group": "world"}}[case]
        return raised(lambda: tpcomm.Communicator(**kwargs))
    finally:
        if saved is None:
            os.environ.pop("TPCOMM_ALGO", None)
        else:
            os.environ["TPCOMM_ALGO"] = saved


#: Settings one rank changes (rank 1: ``env`` variables, or a patched module attribute), and whether the
#: ranks must agree on them (then every rank's constructor raises naming ``field``).
SETTINGS = {
    "algo": ({"TPCOMM_ALGO": "two_shot"}, None, "TPCOMM_ALGO"),
    "algo_fallback": ({"TPCOMM_ALGO": "fallback"}, None, "TPCOMM_ALGO"),
    "tpcomm_version": ({}, ("tpcomm.version", "__version__", "0.0.0-other"), "tpcomm version"),
    "triton_version": ({}, ("triton", "__version__", "0.0.0-other"), "Triton version"),
    "pdl": ({"TPCOMM_PDL": "0"}, None, None),
    "timeout": ({"TPCOMM_TIMEOUT_S": "7"}, None, None),
    "max_programs": ({"TPCOMM_MAX_PROGRAMS": "2"}, None, None),
    "direct_launch": ({"TPCOMM_DIRECT_LAUNCH": "0"}, None, None),
}


def settings_case(ctx, case):
    """Rank 1 creates its communicator with one setting changed (``SETTINGS``). Returns ``(raised,
    seconds the constructor took, right)``: ``raised`` as :func:`numerics.raised`, ``right`` whether an
    all-reduce and a fused call then match the contract (None when the constructor raised)."""
    import importlib
    import time as _time

    env, patch, _ = SETTINGS[case]
    saved = None
    if ctx.rank == 1 and patch is not None:
        module = importlib.import_module(patch[0])
        saved = getattr(module, patch[1])
        setattr(module, patch[1], patch[2])
    made = []
    t0 = _time.perf_counter()
    try:
        error = raised(lambda: made.append(new_communicator(env=env if ctx.rank == 1 else {})))
    finally:
        if saved is not None:
            setattr(importlib.import_module(patch[0]), patch[1], saved)
    took = _time.perf_counter() - t0
    if error is not None:
        return error, took, None
    comm = made[0]
    try:
        xs = all_inputs(3, ctx.world_size, (2, 64), torch.bfloat16)
        res, w = residual_input(3, (2, 64), torch.bfloat16), weight_input(3, 64, torch.bfloat16)
        s = tpcomm.reduce_in_rank_order(xs)
        o, ro = tpcomm.add_rmsnorm_reference(s, res, w, 1e-6)
        got = comm.fused_add_rmsnorm(xs[ctx.rank], res, w)
        right = (torch.equal(bits(comm.all_reduce(xs[ctx.rank])), bits(s)) and torch.equal(bits(got[0]), bits(o))
                 and torch.equal(bits(got[1]), bits(ro)))
        return None, took, right
    finally:
        comm.close()


def fallback_env_case(ctx, seed, shape, dtype):
    """The same calls on a communicator created with ``TPCOMM_ALGO=fallback`` and on the kernel one."""
    fb = new_communicator(algo="fallback")
    try:
        kern = ctx.comm()
        H = shape[-1]
        xs = all_inputs(seed, ctx.world_size, shape, dtype)
        res = residual_input(seed, shape, dtype)
        w = weight_input(seed, H, dtype)
        x = xs[ctx.rank]
        nbytes = x.numel() * x.element_size()
        return {"fb_uses_kernels": fb.uses_kernels, "kern_uses_kernels": kern.uses_kernels, "fb_repr": repr(fb),
                "fb_plan": fb.plan("fused_add_rmsnorm", nbytes, H, dtype).algorithm,
                "kern_plan": kern.plan("fused_add_rmsnorm", nbytes, H, dtype).algorithm,
                "fb_fused": fb.fused_add_rmsnorm(x, res, w), "kern_fused": kern.fused_add_rmsnorm(x, res, w),
                "fb_ar": fb.all_reduce(x), "kern_ar": kern.all_reduce(x)}
    finally:
        fb.close()


def requires_grad_case(ctx, seed, shape, dtype, algo):
    """The all-reduce, the fused op and reduce-scatter of inputs that require grad (activations of a
    model run outside ``torch.no_grad``), under ``algo`` (``fallback``: through torch.distributed):
    their results and whether each output requires grad; and the all-reduce into a strided view of a
    parameter and of a tensor made in inference mode (``out_param_view``, ``out_inference``)."""
    comm = new_communicator(algo=algo)
    try:
        H = shape[-1]
        x = all_inputs(seed, ctx.world_size, shape, dtype)[ctx.rank].clone().requires_grad_(True)
        res = residual_input(seed, shape, dtype).requires_grad_(True)
        w = weight_input(seed, H, dtype).requires_grad_(True)
        got = {"all_reduce": comm.all_reduce(x), "fused": comm.fused_add_rmsnorm(x, res, w),
               "reduce_scatter": comm.reduce_scatter(x)}
        # given outputs that host code writes (strided: staged through a contiguous one; or the fallback's):
        # a strided view of a parameter, and a tensor made in inference mode, used outside it
        param = torch.nn.Parameter(torch.zeros(shape[0], 2 * H, dtype=dtype))
        with torch.inference_mode():
            made_inside = torch.zeros(shape[0], 2 * H, dtype=dtype)
        for name, buf in (("out_param_view", param), ("out_inference", made_inside)):
            comm.all_reduce(x, out=buf[:, ::2])
            got[name] = buf[:, ::2].detach().clone()
        return {"plan": comm.plan("all_reduce", x.numel() * x.element_size(), x.numel(), dtype).algorithm,
                "grad": {k: [t.requires_grad for t in (v if isinstance(v, tuple) else (v,))] for k, v in got.items()},
                "values": {k: tuple(t.detach() for t in (v if isinstance(v, tuple) else (v,))) for k, v in got.items()}}
    finally:
        comm.close()


def life_cycle_case(ctx):
    """Create, use, close twice, then call: RuntimeError naming the op. Also as a context manager.
    Reports the tpcomm shared-memory files of this process seen at each point."""
    from tests.support.harness import shm_files

    mine = lambda: sorted(n for n in shm_files() if n.startswith(f"tpcomm-{os.getpid()}-"))  # noqa: E731
    seen = {"before": mine()}
    comm = tpcomm.Communicator()
    seen["uses_kernels"] = comm.uses_kernels
    seen["after_create"] = mine()
    y = comm.all_reduce(torch.ones(8, dtype=torch.float32))
    comm.close()
    comm.close()
    seen["after_close"] = mine()
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    seen["all_reduce_after_close"] = raised(lambda: comm.all_reduce(x))
    seen["fused_after_close"] = raised(lambda: comm.fused_add_rmsnorm(x, x, torch.ones(8, dtype=x.dtype)))
    with tpcomm.Communicator(max_bytes=4096) as c2:
        y2 = c2.all_reduce(torch.ones(8, dtype=torch.float32))
    seen["ctx_closed"] = raised(lambda: c2.all_reduce(x))
    dist.barrier()
    seen["after_all"] = mine()
    seen["y"], seen["y2"] = y, y2
    return seen


def plan_arguments_case(ctx):
    """What ``Communicator.plan`` raises for each bad argument (type name and message), and one good plan."""
    comm = tpcomm.Communicator()
    bf16 = torch.bfloat16
    bad = {"op": ("all_sum", 8192, 4096, bf16), "negative nbytes": ("all_reduce", -5, 4096, bf16),
           "float nbytes": ("all_reduce", 1.5, 4096, bf16), "bool hidden": ("fused_add_rmsnorm", 8192, True, bf16),
           "dtype name": ("all_reduce", 8192, 4096, "bf16")}
    seen = {name: raised(lambda args=args: comm.plan(*args)) for name, args in bad.items()}
    seen["good"] = comm.plan("fused_add_rmsnorm", 8192, 4096, bf16).algorithm
    comm.close()
    return seen


def workspace_layout_case(ctx, H, dtype, max_bytes):
    """Layout facts of a communicator's workspace for one shape."""
    comm = ctx.comm(max_bytes)
    ws = comm.workspace
    es = torch.empty((), dtype=dtype).element_size()
    return {"slot_bytes": ws.slot_bytes, "row_stride": ws.row_stride(H, es),
            "rows_per_launch": ws.rows_per_launch(H, es), "max_programs": ws.max_programs,
            "flag_table": ws.flag_table.tolist(), "buf_table": ws.buf_table.tolist(),
            "plan": comm.plan("fused_add_rmsnorm", H * es, H, dtype).algorithm}


def poisoned_scratch_case(ctx, seed, shape, dtype, algo=None):
    """Fill this rank's one-shot receive buffers with 0xFF bytes (NaN in every float dtype) while no call
    is in flight, then call: the result must come from what peers pushed this time, not from the
    buffer. (Lamport buffers hold a sentinel that the protocol relies on; they are not poisoned.)"""
    comm = ctx.comm(algo=algo)
    ws = comm.workspace
    xs = all_inputs(seed, ctx.world_size, shape, dtype)
    res = residual_input(seed, shape, dtype)
    w = weight_input(seed, shape[-1], dtype)
    data = ws.buffer[ws.flag_bytes:ws.flag_bytes + 2 * ws.world_size * ws.slot_bytes]  # one-shot slots
    dist.barrier()
    data.fill_(0xFF)
    dist.barrier()
    y = comm.all_reduce(xs[ctx.rank])
    dist.barrier()
    data.fill_(0xFF)
    dist.barrier()
    out, ro = comm.fused_add_rmsnorm(xs[ctx.rank], res, w)
    s_ref = tpcomm.reduce_in_rank_order(xs)
    out_ref, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, w, 1e-6)
    return {"y": y, "s_ref": s_ref, "out": out, "out_ref": out_ref, "residual_out": ro,
            "residual_out_ref": ro_ref}


def epoch_case(ctx, calls, algo=None):
    """The workspace epoch before and after each call of ``calls`` (``(op, shape, max_bytes)``): one
    launch of any grid size advances it by exactly one; a zero-element call leaves it."""
    steps = []
    for i, (op, shape, max_bytes) in enumerate(calls):
        comm = ctx.comm(max_bytes, algo=algo)
        xs = all_inputs(1500 + i, ctx.world_size, shape, torch.bfloat16)
        before = comm.workspace.epoch()
        if op == "all_reduce":
            comm.all_reduce(xs[ctx.rank])
        else:
            comm.fused_add_rmsnorm(xs[ctx.rank], None, torch.ones(shape[-1], dtype=torch.bfloat16))
        steps.append((before, comm.workspace.epoch()))
    return steps


def lamport_rearmed_case(ctx, shapes):
    """Lamport calls of several shapes, then the share of this rank's Lamport buffers that holds the
    sentinel 0x8000 (it must all be re-armed once every rank has finished); ``bad_tags``: call tags that
    hold neither their initial fill nor a tag (``kernels/spin.tag_value``: an odd low word)."""
    comm = ctx.comm(algo="lamport")
    ws = comm.workspace
    plans = []
    for i, shape in enumerate(shapes):
        xs = all_inputs(1600 + i, ctx.world_size, shape, torch.bfloat16)
        xs[ctx.rank].view(-1)[::3] = -0.0  # -0.0 has the sentinel's bits: pushed as +0.0
        comm.fused_add_rmsnorm(xs[ctx.rank], None, torch.ones(shape[-1], dtype=torch.bfloat16))
        plans.append(comm.plan("fused_add_rmsnorm", xs[0].numel() * 2, shape[-1], torch.bfloat16).algorithm)
    dist.barrier()
    base = ws.flag_bytes + 2 * ws.world_size * ws.slot_bytes
    lam = ws.buffer[base:base + ws.lamport_bytes].view(torch.int16)
    # call tags carry the epoch and are never re-armed: each holds its initial fill or an odd low word
    tags = ws.buffer[base + ws.lamport_bytes:base + ws.lamport_bytes + ws.tag_bytes].view(torch.int64)
    fill = torch.tensor([-32768] * 4, dtype=torch.int16).view(torch.int64)
    bad_tags = int(((tags != fill) & (tags % 2 == 0)).sum())
    return {"plans": plans, "sentinel_words": int((lam == -32768).sum()), "words": lam.numel(),
            "bad_tags": bad_tags}


def peer_timeout_case(ctx, timeout_s, op, shape, dtype, algo=None, skipper=1):
    """Rank ``skipper`` skips one call on a fresh communicator with a short timeout; the others call.
    Returns, on the callers, the error seen, its ``peer`` and how long the call took."""
    comm = new_communicator(timeout_s=timeout_s, algo=algo)
    try:
        seen = None
        elapsed = None
        # the callers start together: one that reaches its call more than the timeout after another (a
        # busy machine) is a late rank, which its peer names instead of the skipper (PeerAbortedError)
        dist.barrier()
        if ctx.rank != skipper:
            x = torch.ones(shape, dtype=dtype)
            t0 = time.perf_counter()
            try:
                if op == "all_reduce":
                    comm.all_reduce(x)
                else:
                    comm.fused_add_rmsnorm(x, x, torch.ones(shape[-1], dtype=x.dtype))
            except tpcomm.PeerTimeoutError as e:
                seen = {"type": type(e).__name__, "peer": e.peer, "rank": e.rank, "op": e.op,
                        "epoch": e.epoch, "message": str(e)}
            except Exception as e:  # a wrong exception type is a finding, not a harness failure
                seen = {"type": type(e).__name__, "message": str(e)}
            elapsed = time.perf_counter() - t0
            again = raised(lambda: comm.all_reduce(x))  # documented: unusable afterwards
        else:
            again = None
        dist.barrier()  # the skipper keeps its workspace until every caller has given up
        with new_communicator(algo=algo) as fresh:  # the documented remedy: a new communicator
            after = fresh.all_reduce(torch.full((2, 64), float(ctx.rank + 1), dtype=dtype))
        return {"seen": seen, "elapsed": elapsed, "again": again, "after": after,
                "kernel_timeout": comm.workspace.timeout if comm.workspace else None,
                "max_programs": comm.workspace.max_programs if comm.workspace else None}
    finally:
        comm.close()


def launch_die_after_comm(rank, world_size, pid_dir, how, dying_rank, timeout_s):
    """Write this rank's pid to ``pid_dir``, create a Communicator, then ``dying_rank`` dies (``how``:
    ``exit`` = ``os._exit(3)``, ``raise`` = RuntimeError) while the others call ``all_reduce`` on a
    short timeout and write what they saw to ``rank{r}.seen`` (JSON) in ``pid_dir``."""
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    comm = tpcomm.Communicator(timeout_s=timeout_s)
    dist.barrier()
    if rank == dying_rank:
        if how == "exit":
            os._exit(3)
        raise RuntimeError(f"rank {rank} fails on purpose after creating its communicator")
    t0 = time.perf_counter()
    err = raised(lambda: comm.all_reduce(torch.ones(4, 16, dtype=torch.bfloat16)))
    elapsed = time.perf_counter() - t0
    comm.close()
    with open(os.path.join(pid_dir, f"rank{rank}.seen"), "w") as f:
        json.dump({"error": err, "elapsed": elapsed}, f)
    return rank


def launch_group_outlives_no_communicator(rank, world_size):
    """Create a Communicator and call it, then destroy the process group without closing it: the group is
    freed at once (the communicator holds it weakly), and a call that would use it raises. Returns
    ``(group freed, what comm.group raised, what a fallback call raised)``."""
    import gc
    import weakref

    comm = tpcomm.Communicator()
    x = torch.ones(4, 16, dtype=torch.bfloat16)
    comm.all_reduce(x)
    ref = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    freed = ref() is None
    seen_group = raised(lambda: comm.group)
    with comm.use_algorithm("fallback"):
        seen_fallback = raised(lambda: comm.all_reduce(x))
    comm.close()
    return freed, seen_group, seen_fallback


def subgroup_case(ctx, members):
    """A Communicator on a subgroup (``dist.new_group(members)``, collective on every rank): group
    ranks differ from global ranks. Members return their group rank, the sums and references."""
    group = dist.new_group(members)
    if ctx.rank not in members:
        try:
            tpcomm.Communicator(group)
        except ValueError as e:
            return str(e)
        return "no error"
    xs = all_inputs(1900, len(members), (3, 40), torch.bfloat16)
    res = residual_input(1900, (3, 40), torch.bfloat16)
    w = weight_input(1900, 40, torch.bfloat16)
    with tpcomm.Communicator(group) as comm:
        me = comm.rank
        y = comm.all_reduce(xs[me])
        out, ro = comm.fused_add_rmsnorm(xs[me], res, w)
        uses = comm.uses_kernels
    s_ref = tpcomm.reduce_in_rank_order(xs)
    out_ref, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, w, 1e-6)
    return {"group_rank": me, "uses_kernels": uses, "y": y, "s_ref": s_ref, "out": out, "out_ref": out_ref,
            "residual_out": ro, "residual_out_ref": ro_ref}


def odd_shapes_case(ctx):
    """A 0-dim all_reduce and a 1-D ``(H,)`` fused call (one row)."""
    comm = ctx.comm()
    xs = [torch.tensor(float(q) + 0.5) for q in range(ctx.world_size)]
    y = comm.all_reduce(xs[ctx.rank])
    rows = all_inputs(1950, ctx.world_size, (64,), torch.bfloat16)
    w = weight_input(1950, 64, torch.bfloat16)
    out, ro = comm.fused_add_rmsnorm(rows[ctx.rank], rows[0], w)
    out_ref, ro_ref = tpcomm.add_rmsnorm_reference(tpcomm.reduce_in_rank_order(rows), rows[0], w, 1e-6)
    return {"y": y, "y_ref": tpcomm.reduce_in_rank_order(xs), "out": out, "out_ref": out_ref,
            "residual_out": ro, "residual_out_ref": ro_ref}


def small_slot_case(ctx, op, shape, dtype, max_bytes):
    """A call whose single row does not fit ``max_bytes``: the plan it takes and the result against the
    reference."""
    comm = ctx.comm(max_bytes)
    xs = all_inputs(1960, ctx.world_size, shape, dtype)
    x = xs[ctx.rank]
    s_ref = tpcomm.reduce_in_rank_order(xs)
    if op == "all_reduce":
        hidden = min(x.numel(), dispatch.ALL_REDUCE_ROW)
        return {"plan": comm.plan(op, x.numel() * x.element_size(), hidden, dtype).algorithm,
                "y": comm.all_reduce(x), "ref": s_ref}
    res = residual_input(1960, shape, dtype)
    w = weight_input(1960, shape[-1], dtype)
    out, ro = comm.fused_add_rmsnorm(x, res, w)
    out_ref, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, w, 1e-6)
    return {"plan": comm.plan(op, x.numel() * x.element_size(), shape[-1], dtype).algorithm,
            "out": out, "out_ref": out_ref, "residual_out": ro, "residual_out_ref": ro_ref}


def single_rank_group_case(ctx):
    """A Communicator on a group of one rank (rank 0 alone; ``new_group`` is collective on all ranks):
    it falls back, and the contract still holds (-0.0 in gives +0.0 out)."""
    group = dist.new_group([0])
    if ctx.rank != 0:
        return None
    with tpcomm.Communicator(group) as comm:
        x = torch.tensor([-0.0, 1.5, -2.25, float("inf")], dtype=torch.bfloat16)
        y = comm.all_reduce(x)
        out, ro = comm.fused_add_rmsnorm(x[:3].reshape(1, 3), torch.zeros(1, 3, dtype=torch.bfloat16),
                                         torch.ones(3, dtype=torch.bfloat16))
        return {"uses_kernels": comm.uses_kernels, "reason": comm.fallback_reason, "y": y,
                "y_ref": tpcomm.reduce_in_rank_order([x]), "residual_out": ro,
                "residual_out_ref": tpcomm.reduce_in_rank_order([x[:3].reshape(1, 3)])}


def grid_case(ctx, seed, shape, dtype, programs_per_rank, algo=None):
    """Fused and all_reduce on a fresh communicator whose ranks set ``TPCOMM_MAX_PROGRAMS`` to
    ``programs_per_rank[rank]`` (None: unset). Returns the outputs and the grid cap agreed."""
    p = programs_per_rank[ctx.rank]
    comm = new_communicator(algo=algo, env={"TPCOMM_MAX_PROGRAMS": p} if p is not None else None)
    try:
        xs = all_inputs(seed, ctx.world_size, shape, dtype)
        res = residual_input(seed, shape, dtype)
        w = weight_input(seed, shape[-1], dtype)
        out, ro = comm.fused_add_rmsnorm(xs[ctx.rank], res, w)
        return {"out": out, "residual_out": ro, "s": comm.all_reduce(xs[ctx.rank]),
                "max_programs": comm.workspace.max_programs, "s_ref": tpcomm.reduce_in_rank_order(xs)}
    finally:
        comm.close()


def refused_setup_case(ctx, bad_rank, env, max_bytes=None):
    """Rank ``bad_rank`` creates a Communicator with the ``TPCOMM_*`` variables ``env`` (and
    ``max_bytes``), the others with none. Returns ``(exception type name, message, seconds)`` of what the
    constructor raised on this rank (``None`` when it did not)."""
    mine = ctx.rank == bad_rank
    start = time.monotonic()
    try:
        comm = new_communicator(max_bytes=max_bytes if mine else None, env=env if mine else None)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e), time.monotonic() - start
    comm.close()
    return None


def use_algorithm_spelling_case(ctx, spelling):
    """The plan of a 16-row bf16 all-reduce inside ``use_algorithm(spelling)``."""
    comm = ctx.comm()
    with comm.use_algorithm(spelling):
        return comm.plan("all_reduce", 16 * 64 * 2, 64, torch.bfloat16).algorithm


def setup_timeout_case(ctx, late_s):
    """Rank 1 creates no communicator (``late_s`` None) or creates it ``late_s`` seconds after rank 0, whose
    ``timeout_s`` is 1 s: what each rank's constructor raised and after how long; then, after a barrier,
    a new communicator on every rank and its all-reduce."""
    import torch.distributed as dist

    from tpcomm import SetupTimeoutError

    start = time.monotonic()
    outcome = "no call"
    if ctx.rank == 0 or late_s is not None:
        if ctx.rank == 1:
            time.sleep(late_s)
        try:
            tpcomm.Communicator(timeout_s=1.0).close()
            outcome = "created"
        except SetupTimeoutError as e:
            outcome = {"missing": e.missing, "message": str(e)}
    seconds = time.monotonic() - start
    dist.barrier()
    with tpcomm.Communicator(timeout_s=1.0) as comm:
        y = comm.all_reduce(torch.ones(4)).tolist()
    return {"outcome": outcome, "seconds": seconds, "after": y}


def use_algorithm_checked_at_call_case(ctx):
    """``use_algorithm("warp_speed")`` without a ``with``: the error it raises (None if none), and the
    algorithm in force afterwards (a valid name outside a ``with`` forces nothing)."""
    comm = ctx.comm()
    try:
        comm.use_algorithm("warp_speed")
        raised = None
    except ValueError as e:
        raised = str(e)
    comm.use_algorithm("two_shot")
    return {"raised": raised, "after": comm.algorithm}


def fused_op_plans_case(ctx):
    """``comm.plan`` of the QK norm and the MoE finalize beside the fused norm's, in the default dispatch
    and inside ``use_algorithm("fallback")`` and ``use_algorithm("two_shot")``, and which path each QK
    call took (kernel launches: the epoch)."""
    comm = ctx.comm()
    bf = torch.bfloat16
    out = {}
    for forced in ("auto", "fallback", "two_shot"):
        with comm.use_algorithm(forced):
            qk = comm.plan("fused_qk_rmsnorm", 4 * (32 + 16) * 2, 32 + 16, bf)
            moe = comm.plan("fused_moe_finalize_add_rmsnorm", 4 * 64 * 2, 64, bf)
            fused = comm.plan("fused_add_rmsnorm", 4 * 64 * 2, 64, bf)
            before = comm.workspace.epoch()
            comm.fused_qk_rmsnorm(torch.ones(4, 32, dtype=bf), torch.ones(4, 16, dtype=bf), torch.ones(32, dtype=bf),
                                  torch.ones(16, dtype=bf))
            out[forced] = {"qk": (qk.algorithm, qk.reason), "moe": (moe.algorithm, moe.reason),
                           "fused": fused.algorithm, "qk launches": comm.workspace.epoch() - before}
    return out


def env_timeout_case(ctx, value):
    """A communicator created with ``TPCOMM_TIMEOUT_S=value`` and no timeout_s argument."""
    comm = new_communicator(env={"TPCOMM_TIMEOUT_S": value})
    try:
        return {"timeout_s": comm.timeout_s, "workspace_timeout_s": comm.workspace.timeout_s}
    finally:
        comm.close()


def max_bytes_rounding_case(ctx) -> dict:
    """``max_bytes`` 300 on rank 0 and 512 on the others (the same workspace): the communicator is made,
    ``max_bytes`` reads 512 everywhere, and a row of 512 bytes (1 x 128 fp32) plans a kernel."""
    comm = tpcomm.Communicator(max_bytes=300 if ctx.rank == 0 else 512)
    try:
        plan = comm.plan("fused_add_rmsnorm", 512, 128, torch.float32)
        return {"max_bytes": comm.max_bytes, "plan": plan.algorithm, "reason": plan.reason}
    finally:
        comm.close()
