"""Rank bodies of ``tests/collectives/test_collectives.py`` (pool bodies: ``fn(ctx, *args)``): every algorithm
forced on the same inputs, all_gather, reduce_scatter, interleaved calls, calls that do not match a
peer's, and the crossover table a communicator loads.

As in ``tests/communicator/ranks.py``, each body rebuilds every rank's input from the case's seed, runs the op and
returns tensors (or what it raised); the assertions live in the test file, which sees every rank's answer.

Also the all-reduce and fused bodies of ``tests/collectives/test_one_shot.py`` (shared with
``tests/communicator/test_communicator.py``), the reference body of ``tests/collectives/test_reference.py``
and the 4- and 8-rank body of ``tests/collectives/test_large_worlds.py``.
"""

from __future__ import annotations

import random
import time
import warnings

import torch
import torch.distributed as dist

import tpcomm
from tests.support.harness import new_communicator
from tests.support.numerics import (
    all_inputs,
    bits,
    out_ulp_tolerance,
    residual_input,
    ulp_distance,
    weight_input,
)
from tpcomm import dispatch, reference as R


# -- inputs ---------------------------------------------------------------------------------------------
def _gen(seed: int, rank: int, role: int) -> torch.Generator:
    return torch.Generator().manual_seed(2_000_029 * seed + 211 * rank + role)


def wide_input(seed: int, rank: int, shape, dtype, exponents: tuple[int, int], role: int = 1) -> torch.Tensor:
    """Normal values scaled by ``2**k``, ``k`` drawn per element from ``exponents`` (inclusive): a wide
    dynamic range in one row (rank ``rank``'s input of case ``seed``; ``role`` 2 for the residual)."""
    g = _gen(seed, rank, role)
    k = torch.randint(exponents[0], exponents[1] + 1, tuple(shape), generator=g)
    v = torch.randn(tuple(shape), generator=g, dtype=torch.float64) * torch.pow(2.0, k.to(torch.float64))
    return v.to(dtype)


def wide_inputs(seed: int, world_size: int, shape, dtype, exponents) -> list[torch.Tensor]:
    """Every rank's :func:`wide_input`, in rank order."""
    return [wide_input(seed, r, shape, dtype, exponents) for r in range(world_size)]


def any_input(seed: int, rank: int, shape, dtype) -> torch.Tensor:
    """Rank ``rank``'s input of case ``seed`` for a bit-exact copy (all_gather): random bit patterns for
    float dtypes (NaN payloads, -0.0, subnormals and infinities included), random values otherwise."""
    g = _gen(seed, rank, 5)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).to(torch.bool)
    if dtype.is_floating_point:
        size = torch.empty((), dtype=dtype).element_size()
        n = int(torch.tensor(shape).prod()) if shape else 1
        return torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(1 << 40)), min(info.max, 1 << 40), shape, generator=g,
                         dtype=torch.int64).to(dtype)


def summable_input(seed: int, rank: int, shape, dtype) -> torch.Tensor:
    """Rank ``rank``'s input of case ``seed`` for a sum: wide-range normal floats, or integers small
    enough that the sum of a few ranks cannot overflow ``dtype``."""
    if dtype.is_floating_point:
        return wide_input(seed, rank, shape, dtype, (-8, 8))
    g = _gen(seed, rank, 6)
    return torch.randint(-20, 21, tuple(shape), generator=g).to(dtype)


def exact_sum(xs) -> torch.Tensor:
    """The contract's sum of every rank's input: rank-order float32 for floats, exact for integers."""
    if xs[0].is_floating_point():
        return tpcomm.reduce_in_rank_order(xs)
    return sum(x.to(torch.int64) for x in xs).to(xs[0].dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (any dtype, bool and FP8 included) as uint8, for bit-exact comparisons."""
    t = t.contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _picklable(t):
    """``t``, or for FP8 its uint8 view: FP8 tensors do not survive the pickling that carries results
    back from the ranks (torch 2.13: ``UntypedStorage has no attribute dtype`` when loading)."""
    if t is not None and t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


def _epoch(comm) -> int:
    """The workspace epoch (advances once per kernel launch; a fallback call leaves it)."""
    return comm.workspace.epoch() if comm.workspace is not None else 0


# -- every algorithm on the same inputs --------------------------------------------------------------------
def algorithms_case(ctx, seed, shape, dtype, exponents, prefixes, algos, fp8=False):
    """For each algorithm of ``algos`` forced with ``use_algorithm`` on one communicator, on the first
    ``n`` rows for ``n`` in ``[T] + prefixes``: ``all_reduce``, ``fused_add_rmsnorm`` with a residual,
    without one, and Gemma-style (and, with ``fp8``, its per-token FP8 output: bytes and scales).
    Inputs (x and residual) are :func:`wide_input` with ``exponents``.

    Returns ``{"runs": {algo: {n: {output: tensor}}}, "plans": {algo: {op: plan}}, "launches": {algo:
    epoch steps of the whole algorithm}, "calls": calls made under each algorithm, "ref": {n: {output:
    reference}}}``.
    """
    comm = ctx.comm()
    T, H = shape
    xs = wide_inputs(seed, ctx.world_size, shape, dtype, exponents)
    res = wide_input(seed, 0, shape, dtype, exponents, role=2)
    w = weight_input(seed, H, dtype)
    wg = weight_input(seed, H, dtype, gemma=True)
    x = xs[ctx.rank]
    runs, plans, launches = {}, {}, {}
    rows = [T] + list(prefixes)
    for algo in algos:
        before = _epoch(comm)
        with comm.use_algorithm(algo):
            nbytes = x.numel() * x.element_size()
            plans[algo] = {op: comm.plan(op, nbytes, H, dtype).algorithm
                           for op in ("all_reduce", "fused_add_rmsnorm")}
            runs[algo] = {}
            for n in rows:
                out, ro = comm.fused_add_rmsnorm(x[:n], res[:n], w)
                out_nr, ro_nr = comm.fused_add_rmsnorm(x[:n], None, w)
                out_g, ro_g = comm.fused_add_rmsnorm(x[:n], res[:n], wg, gemma=True)
                runs[algo][n] = {"s": comm.all_reduce(x[:n]), "out": out, "residual_out": ro,
                                 "out_no_residual": out_nr, "out_gemma": out_g, "residual_out_gemma": ro_g,
                                 "no_residual_is_none": ro_nr is None}
                if fp8:
                    q, scales, _, _ = comm.fused_add_rmsnorm(x[:n], res[:n], w, quant="fp8_per_token")
                    runs[algo][n].update(fp8_bytes=q.view(torch.uint8), fp8_scales=scales)
        launches[algo] = _epoch(comm) - before
    ref = {}
    for n in rows:
        s = tpcomm.reduce_in_rank_order([xi[:n] for xi in xs])
        out, ro = tpcomm.add_rmsnorm_reference(s, res[:n], w, 1e-6)
        out_nr, _ = tpcomm.add_rmsnorm_reference(s, None, w, 1e-6)
        out_g, ro_g = tpcomm.add_rmsnorm_reference(s, res[:n], wg, 1e-6, gemma=True)
        ref[n] = {"s": s, "out": out, "residual_out": ro, "out_no_residual": out_nr, "out_gemma": out_g,
                  "residual_out_gemma": ro_g}
    calls = len(rows) * (5 if fp8 else 4)  # each algorithm's calls (the fallback launches one kernel a call)
    return {"runs": runs, "plans": plans, "launches": launches, "calls": calls, "ref": ref}


# -- all_gather, reduce_scatter ----------------------------------------------------------------------------
def all_gather_case(ctx, seed, shape, dtype, dims, max_bytes=None, algo="auto"):
    """``all_gather(x, dim)`` for each dim of ``dims`` (inputs: :func:`any_input`). Returns per dim the
    result (or the error it raised), whether it is contiguous, the expected ``torch.cat`` of every rank's
    input, the launches (epoch steps) and the plan."""
    comm = ctx.comm(max_bytes)
    xs = [any_input(seed, r, shape, dtype) for r in range(ctx.world_size)]
    x = xs[ctx.rank]
    x_before = raw(x).clone()
    result = {}
    for dim in dims:
        before = _epoch(comm)
        with comm.use_algorithm(algo):
            plan = comm.plan("all_gather", x.numel() * x.element_size(), 0, dtype).algorithm
            try:
                y, error = comm.all_gather(x, dim), None
            except Exception as e:  # reported by the test; the pool stays up for the next one
                y, error = None, f"{type(e).__name__}: {e}"
        result[dim] = {"y": _picklable(y), "error": error, "ref": _picklable(torch.cat(xs, dim)),
                       "contiguous": y is not None and y.is_contiguous(),
                       "launches": _epoch(comm) - before,
                       "plan": plan, "x_untouched": torch.equal(raw(x), x_before)}
    return result


def reduce_scatter_case(ctx, seed, shape, dtype, dim, max_bytes=None, algo="auto"):
    """``reduce_scatter(x, dim)`` and ``all_reduce(x)`` (inputs: :func:`summable_input`). Returns the
    share, the expected share (``tensor_split`` of the exact sum), this rank's rows of the all_reduce,
    the launches of the reduce_scatter and, for a chunked call, the launches its plan needs."""
    comm = ctx.comm(max_bytes)
    xs = [summable_input(seed, r, shape, dtype) for r in range(ctx.world_size)]
    x = xs[ctx.rank]
    with comm.use_algorithm(algo):
        before = _epoch(comm)
        y = comm.reduce_scatter(x, dim)
        launches = _epoch(comm) - before
        s = comm.all_reduce(x)
    W = ctx.world_size
    moved = x.movedim(dim, 0)
    T, H = moved.shape[0], moved.numel() // max(moved.shape[0], 1)
    expected_launches = None
    if comm.workspace is not None and H:
        per = comm.workspace.share_rows_per_launch(H, x.element_size())
        longest = -(-T // W)
        expected_launches = -(-longest // per) if per else None
    return {"y": y, "ref": torch.tensor_split(exact_sum(xs), W, dim)[ctx.rank].contiguous(),
            "ar_rows": torch.tensor_split(s, W, dim)[ctx.rank].contiguous(),
            "launches": launches, "expected_launches": expected_launches,
            "bounds": tpcomm.reference.share_bounds(T, W, ctx.rank)}


def unsigned_case(ctx, seed, dtype_name, algo):
    """all_reduce, reduce_scatter and all_gather of a ``dtype_name`` (``uint16``, ...) input of 5 x 7 under
    ``algo``; returns each op's count of mismatched elements against the exact results (computed here:
    the test harness cannot pickle unsigned tensors)."""
    dtype = getattr(torch, dtype_name)
    comm = ctx.comm()
    xs = [summable_input(seed, r, (5, 7), dtype) for r in range(ctx.world_size)]
    x = xs[ctx.rank]
    want = exact_sum(xs)
    with comm.use_algorithm(algo):
        s, share, g = comm.all_reduce(x), comm.reduce_scatter(x), comm.all_gather(x)
    mine = torch.tensor_split(want, ctx.world_size)[ctx.rank]

    def mismatched(a, b):
        return -1 if a.shape != b.shape or a.dtype != b.dtype else int((raw(a) != raw(b)).sum())
    return {"all_reduce": mismatched(s, want), "reduce_scatter": mismatched(share, mine),
            "all_gather": mismatched(g, torch.cat(xs))}


# -- interleaving ----------------------------------------------------------------------------------------
def interleave_case(ctx, seed, steps, max_skew_s):
    """Run ``steps`` (``(op, shape, dtype, algo)``; op ``fused``, ``fused_no_res``, ``all_reduce``,
    ``all_gather`` or ``reduce_scatter``) back to back on one communicator, each rank sleeping a
    different random time (up to ``max_skew_s``) before each call, and check every result against the
    reference here. Returns per step ``(failure message or None, hash of the output bits, launches)``."""
    import hashlib

    comm = ctx.comm()
    rng = random.Random(seed * 31 + ctx.rank)
    W, r = ctx.world_size, ctx.rank
    report = []
    for i, (op, shape, dtype, algo) in enumerate(steps):
        case = seed * 1000 + i
        xs = wide_inputs(case, W, shape, dtype, (-6, 6))
        time.sleep(rng.uniform(0, max_skew_s))
        before = _epoch(comm)
        with comm.use_algorithm(algo):
            fail = None
            if op == "all_reduce":
                y = comm.all_reduce(xs[r])
                if not torch.equal(bits(y), bits(tpcomm.reduce_in_rank_order(xs))):
                    fail = "all_reduce differs from the reference"
            elif op == "all_gather":
                y = comm.all_gather(xs[r])
                if not torch.equal(bits(y), bits(torch.cat(xs))):
                    fail = "all_gather differs from the concatenation"
            elif op == "reduce_scatter":
                y = comm.reduce_scatter(xs[r])
                want = torch.tensor_split(tpcomm.reduce_in_rank_order(xs), W)[r]
                if y.shape != want.shape or not torch.equal(bits(y), bits(want)):
                    fail = "reduce_scatter differs from the share of the reference"
            else:
                res = wide_input(case, 0, shape, dtype, (-6, 6), role=2) if op == "fused" else None
                w = weight_input(case, shape[-1], dtype)
                y, ro = comm.fused_add_rmsnorm(xs[r], res, w)
                out_ref, ro_ref = tpcomm.add_rmsnorm_reference(tpcomm.reduce_in_rank_order(xs), res, w, 1e-6)
                if res is not None and not torch.equal(bits(ro), bits(ro_ref)):
                    fail = "residual_out differs from the reference"
                d = ulp_distance(y, out_ref)
                if y.isnan().any() or int(d.max()) > out_ulp_tolerance(dtype, shape[-1]):
                    fail = (fail or "") + f" out {int(d.max())} ulp from the reference"
        launches = _epoch(comm) - before
        report.append((fail, hashlib.sha256(bits(y).numpy().tobytes()).hexdigest(), launches))
    return report


# -- calls that do not match a peer's ----------------------------------------------------------------------
def _mismatch_call(comm, op, shape, dtype, seed, rank, world_size):
    """Make one call (``op``: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``fused``); return
    its outputs."""
    xs = [summable_input(seed, r, shape, dtype) for r in range(world_size)]
    if op == "all_reduce":
        return comm.all_reduce(xs[rank])
    if op == "all_gather":
        return comm.all_gather(xs[rank])
    if op == "reduce_scatter":
        return comm.reduce_scatter(xs[rank])
    return comm.fused_add_rmsnorm(xs[rank], xs[0], weight_input(seed, shape[-1], dtype))


def mismatch_case(ctx, calls, delays, timeout_s):
    """Rank ``r`` makes the call ``calls[r]`` (``(op, shape, dtype, algo)``) on a fresh communicator with
    a short timeout, after one call every rank makes alike and a sleep of ``delays[r]`` seconds. Returns
    what the call raised (type, peer, op, message), or None if it returned; and how long it took."""
    comm = new_communicator(timeout_s=timeout_s)
    try:
        dist.barrier()
        warm = comm.all_reduce(torch.full((1, 16), float(ctx.rank + 1)))
        warm_ok = bool((warm == ctx.world_size * (ctx.world_size + 1) / 2).all())
        op, shape, dtype, algo = calls[ctx.rank]
        seen = None
        time.sleep(delays[ctx.rank])
        t0 = time.perf_counter()
        try:
            with comm.use_algorithm(algo):
                _mismatch_call(comm, op, shape, dtype, 8100, ctx.rank, ctx.world_size)
            comm.check(op)
        except tpcomm.PeerTimeoutError as e:
            seen = {"type": type(e).__name__, "peer": e.peer, "op": e.op, "message": str(e)}
        except Exception as e:  # another type is a finding, reported by the test
            seen = {"type": type(e).__name__, "message": str(e)}
        elapsed = time.perf_counter() - t0
        dist.barrier()  # every rank is done with the peers' buffers before any closes its workspace
        return {"warm_ok": warm_ok, "seen": seen, "elapsed": elapsed}
    finally:
        comm.close()


def mismatch_batch(ctx, faults):
    """:func:`mismatch_case` for each ``(name, calls, delays, timeout_s)`` of ``faults``: ``{name: result}``."""
    return {name: mismatch_case(ctx, calls, delays, timeout_s) for name, calls, delays, timeout_s in faults}


# -- crossover tables --------------------------------------------------------------------------------------
def table_case(ctx, paths, probes):
    """A communicator created with ``TPCOMM_DISPATCH_TABLE=paths[rank]`` (None: unset). Returns the
    table it loaded (JSON), the plan of each probe ``(op, shape, dtype)``, and for each probe the result
    of the call against the reference with the launches it made."""
    path = paths[ctx.rank]
    comm = new_communicator(env={"TPCOMM_DISPATCH_TABLE": path} if path else None)
    try:
        plans, ok, launches = [], [], []
        for i, (op, shape, dtype) in enumerate(probes):
            xs = [summable_input(9000 + i, r, shape, dtype) for r in range(ctx.world_size)]
            x = xs[ctx.rank]
            H = shape[-1]
            plans.append(comm.plan(op, x.numel() * x.element_size(), H, dtype).algorithm)
            before = _epoch(comm)
            if op == "all_reduce":
                y = comm.all_reduce(x)
                ok.append(torch.equal(bits(y), bits(exact_sum(xs))))
            else:
                w = weight_input(9000 + i, H, dtype)
                y, _ = comm.fused_add_rmsnorm(x, None, w)
                want = tpcomm.add_rmsnorm_reference(exact_sum(xs), None, w, 1e-6)[0]
                ok.append(int(ulp_distance(y, want).max()) <= out_ulp_tolerance(dtype, H))
            launches.append(_epoch(comm) - before)
        return {"table": comm.table.to_json(), "plans": plans, "ok": ok, "launches": launches}
    finally:
        comm.close()


def table_error_case(ctx, paths):
    """What creating a communicator with ``TPCOMM_DISPATCH_TABLE=paths[rank]`` raised: ``(type name,
    message)``, or None when it worked."""
    path = paths[ctx.rank]
    try:
        comm = new_communicator(env={"TPCOMM_DISPATCH_TABLE": path} if path else None)
    except Exception as e:  # the test decides which types are right
        return type(e).__name__, str(e)
    comm.close()
    return None


# -- helpers ------------------------------------------------------------------------------------------
def layout_of(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in a given memory layout: ``contiguous``, ``strided`` (every other column of a
    wider tensor, like ``x[:, ::2]``), ``transposed`` (a ``.t()`` view of the transposed copy) or
    ``offset`` (contiguous from the second element of its storage)."""
    if layout == "contiguous":
        return t.clone()
    if layout == "strided":
        wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        v = wide[..., ::2]
        assert not v.is_contiguous()
        return v
    if layout == "offset":  # contiguous, but starting one element into its storage (misaligned)
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        flat[1:] = t.reshape(-1)
        v = flat[1:].view(t.shape)
        assert v.is_contiguous() and v.storage_offset() == 1
        return v
    if layout == "transposed":
        v = t.t().contiguous().t()
        assert not v.is_contiguous() or min(t.shape) == 1
        return v
    raise ValueError(layout)


def _exact_int_sum(xs) -> torch.Tensor:
    """Sum of small-integer float tensors computed in int64 (no floating-point rounding at all)."""
    acc = torch.zeros(xs[0].shape, dtype=torch.int64)
    for x in xs:
        acc += x.to(torch.int64)
    return acc


# -- all_reduce -----------------------------------------------------------------------------------------
def all_reduce_case(ctx, seed, shape, dtype, kind="randn", out_mode="new", layout="contiguous",
                    max_bytes=None, algo=None):
    """One ``all_reduce``. ``out_mode``: ``new`` (no out), ``nan`` (out pre-filled with NaN),
    ``inplace`` (out=x), ``strided`` (a NaN-filled non-contiguous out whose gaps must stay NaN),
    ``overlap<k>`` (x and out views of one buffer, out ``k`` elements after x: they overlap, not in place)."""
    comm = ctx.comm(max_bytes, algo=algo)
    xs = all_inputs(seed, ctx.world_size, shape, dtype, kind)
    x = layout_of(xs[ctx.rank], layout)
    x_before = x.clone()
    gaps = None
    if out_mode == "new":
        y = comm.all_reduce(x)
    elif out_mode == "nan":
        out = torch.full(shape, float("nan"), dtype=dtype)
        y = comm.all_reduce(x, out=out)
        assert y is out, "all_reduce must return the out tensor it was given"
    elif out_mode == "inplace":
        y = comm.all_reduce(x, out=x)
        assert y is x, "all_reduce(x, out=x) must return x"
    elif out_mode.startswith("overlap"):
        k, n = int(out_mode[len("overlap"):]), x.numel()
        buf = torch.empty(n + abs(k), dtype=dtype)
        xv, ov = (buf[:n], buf[k:]) if k > 0 else (buf[-k:], buf[:n])
        xv.copy_(x.reshape(-1))
        out = ov.view(shape)
        y = comm.all_reduce(xv.view(shape), out=out)
        assert y is out, "all_reduce must return the out tensor it was given"
    elif out_mode == "strided":
        backing = torch.full((*shape[:-1], 2 * shape[-1]), float("nan"), dtype=dtype)
        out = backing[..., 1::2]
        y = comm.all_reduce(x, out=out)
        assert y is out, "all_reduce must return the out tensor it was given"
        gaps = backing[..., 0::2].clone()
    else:
        raise ValueError(out_mode)
    result = {"y": y.clone(), "ref": tpcomm.reduce_in_rank_order(xs), "gaps": gaps,
              "x_untouched": out_mode == "inplace" or out_mode.startswith("overlap")
              or torch.equal(bits(x), bits(x_before)),
              "plan": comm.plan("all_reduce", x.numel() * x.element_size(), min(x.numel(), dispatch.ALL_REDUCE_ROW),
                                dtype).algorithm}
    if kind == "int":
        result["exact"] = _exact_int_sum(xs)
    return result


# -- fused_add_rmsnorm ----------------------------------------------------------------------------------
def fused_case(ctx, seed, shape, dtype, kind="randn", residual=True, gemma=False, w_dtype=None,
               eps=1e-6, layout="contiguous", max_bytes=None, also_all_reduce=False, algo=None):
    """One ``fused_add_rmsnorm`` (and optionally an ``all_reduce`` of the same ``x``, whose result is
    the contract's ``s``), with the reference computed locally from every rank's seeded input."""
    comm = ctx.comm(max_bytes, algo=algo)
    H = shape[-1]
    xs = all_inputs(seed, ctx.world_size, shape, dtype, kind)
    res = residual_input(seed, shape, dtype, kind) if residual else None
    w = weight_input(seed, H, w_dtype or dtype, gemma)
    x = layout_of(xs[ctx.rank], layout)
    r_in = layout_of(res, layout) if res is not None else None
    x_before = x.clone()
    out, ro = comm.fused_add_rmsnorm(x, r_in, w, eps=eps, gemma=gemma)
    s_ref = tpcomm.reduce_in_rank_order(xs)
    out_ref, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, w, eps, gemma)
    result = {"out": out, "residual_out": ro, "out_ref": out_ref, "residual_out_ref": ro_ref,
              "x_untouched": torch.equal(bits(x), bits(x_before)),
              "plan": comm.plan("fused_add_rmsnorm", x.numel() * x.element_size(), H, dtype).algorithm}
    if gemma:  # the reference with Gemma's 1 + w replaced by w: a test can check they differ
        result["out_ref_other"] = tpcomm.add_rmsnorm_reference(s_ref, res, w, eps, not gemma)[0]
    if also_all_reduce:
        result["s"] = comm.all_reduce(x)
        result["s_ref"] = s_ref
    if kind == "int":
        s = _exact_int_sum(xs)
        result["exact_s"] = s
        result["exact_residual_out"] = s + res.to(torch.int64) if res is not None else None
    return result


# -- special values -------------------------------------------------------------------------------------
def negative_zero_case(ctx, dtype, algo=None):
    """Every rank passes -0.0 (and a residual of -0.0): ``s`` and ``residual_out`` must be +0.0."""
    comm = ctx.comm(algo=algo)
    H = 37
    x = torch.full((3, H), -0.0, dtype=dtype)
    res = torch.full((3, H), -0.0, dtype=dtype)
    w = torch.ones(H, dtype=dtype)
    s = comm.all_reduce(x)
    out, ro = comm.fused_add_rmsnorm(x, res, w)
    out_nr, _ = comm.fused_add_rmsnorm(x, None, w)
    return {"s": s, "out": out, "residual_out": ro, "out_no_residual": out_nr}


def special_values_case(ctx, dtype, algo=None):
    """NaN and +-Inf in some ranks' inputs. Columns of the (2, 16) input, per rank r:
    col 0: NaN on rank 0; col 1: +Inf on every rank; col 2: +Inf on rank 0, -Inf on the last rank;
    col 3: -Inf on rank 0; everything else finite. Row 1 is all finite (a NaN must not leak across
    rows). Row 2 holds half the dtype's largest value (sign alternating) on rank 0 and zeros elsewhere,
    with a residual of 0 and a norm weight of 4: for bf16 and fp32 its squares overflow, so the norm's
    inverse is 0 and ``out`` is +-0 (``(v * 0) * 4``), not the NaN of ``(v * 4) * 0``, whose product
    overflows (``kernels/epilogue.py:weight_first``). Returns all_reduce and fused results and their
    references."""
    comm = ctx.comm(algo=algo)
    W, r = ctx.world_size, ctx.rank
    xs = []
    for q in range(W):
        x = torch.full((3, 16), float(q + 1), dtype=dtype)
        x[2] = 0.0
        if q == 0:
            x[2, 0::2] = torch.finfo(dtype).max / 2
            x[2, 1::2] = -torch.finfo(dtype).max / 2
        if q == 0:
            x[0, 0] = float("nan")
            x[0, 2] = float("inf")
            x[0, 3] = float("-inf")
        if q == W - 1:
            x[0, 2] = float("-inf")
        x[0, 1] = float("inf")
        xs.append(x)
    res = torch.ones(3, 16, dtype=dtype)
    res[2] = 0.0
    w = torch.full((16,), 4.0, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:  # the kernels' own: the GPU warns of nothing
        warnings.simplefilter("always")
        s = comm.all_reduce(xs[r])
        out, ro = comm.fused_add_rmsnorm(xs[r], res, w)
    s_ref = tpcomm.reduce_in_rank_order(xs)
    out_ref, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, w, 1e-6)
    return {"s": s, "s_ref": s_ref, "out": out, "out_ref": out_ref, "residual_out": ro,
            "residual_out_ref": ro_ref, "warnings": [str(c.message) for c in caught]}


# -- the plain-torch references (test_reference.py) -----------------------------------------------------
def reference_collective_case(ctx, dtype):
    """The collective references against the local ones, from seeded inputs."""
    shape = (3, 40)
    if dtype.is_floating_point:
        xs = all_inputs(1800, ctx.world_size, shape, dtype)
    else:
        xs = [torch.arange(120).reshape(shape).to(dtype) * (q + 1) for q in range(ctx.world_size)]
    result = {"ar": tpcomm.all_reduce_reference(xs[ctx.rank]),
              "ar_local": (tpcomm.reduce_in_rank_order(xs) if dtype.is_floating_point
                           else sum(x.to(torch.int64) for x in xs).to(dtype))}
    if dtype.is_floating_point:
        res = residual_input(1800, shape, dtype)
        w = weight_input(1800, shape[-1], dtype)
        result["out"], result["ro"] = tpcomm.fused_add_rmsnorm_reference(xs[ctx.rank], res, w, 1e-6)
        result["out_local"], result["ro_local"] = tpcomm.add_rmsnorm_reference(
            tpcomm.reduce_in_rank_order(xs), res, w, 1e-6)
    return result


# -- 4 and 8 ranks, launched (test_large_worlds.py): (rank, world_size) ---------------------------------
def every_op_every_algorithm(rank: int, world_size: int) -> list[str]:
    """Fused (with and without residual, FP8 per token), all-reduce, all-gather and reduce-scatter under
    every algorithm, T = 5 rows (fewer than 8 ranks: some reduce-scatter shares are empty), bf16 and
    float32 (bf16 only on more than 4 ranks: 8 interpreted ranks on two cores cost a minute a dtype);
    returns what differs from the bit-exact reference (empty when everything is right)."""
    bad: list[str] = []
    dtypes = (torch.bfloat16, torch.float32) if world_size <= 4 else (torch.bfloat16,)
    with tpcomm.Communicator(timeout_s=60) as comm:
        for dtype in dtypes:
            T, H = 5, 40
            xs = [(torch.randn(T, H, generator=torch.Generator().manual_seed(q)) * 4).to(dtype)
                  for q in range(world_size)]
            r = torch.randn(T, H, generator=torch.Generator().manual_seed(99)).to(dtype)
            w = torch.randn(H, generator=torch.Generator().manual_seed(98)).to(dtype)
            s = R.reduce_in_rank_order(xs)
            out_ref, res_ref = R.add_rmsnorm_reference(s, r, w, 1e-6)
            q_ref, sc_ref = R.per_token_quant_reference(out_ref)
            for algo in ("lamport", "one_shot", "two_shot", "fallback"):
                if algo == "lamport" and dtype == torch.float32:
                    continue
                tag = f"{dtype} {algo}"
                with comm.use_algorithm(algo):
                    if not torch.equal(comm.all_reduce(xs[rank]), s):
                        bad.append(f"{tag}: all_reduce")
                    o, ro = comm.fused_add_rmsnorm(xs[rank], r, w, 1e-6)
                    if not (torch.equal(o, out_ref) and torch.equal(ro, res_ref)):
                        bad.append(f"{tag}: fused_add_rmsnorm")
                    q, sc, _, _ = comm.fused_add_rmsnorm(xs[rank], r, w, 1e-6, quant="fp8_per_token")
                    if not (torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sc, sc_ref)):
                        bad.append(f"{tag}: fused FP8")
                    if not torch.equal(comm.all_gather(xs[rank]), torch.cat(xs)):
                        bad.append(f"{tag}: all_gather")
                    if not torch.equal(comm.reduce_scatter(xs[rank]), torch.tensor_split(s, world_size)[rank]):
                        bad.append(f"{tag}: reduce_scatter")
        comm.check()
    return bad


def past_hoisted_ranks(rank: int, world_size: int) -> list[str]:
    """More ranks than the kernels load address-table entries for at their start
    (``kernels.sync.HOISTED_RANKS``): those kernels load each entry where they use it. All-reduce under
    every kernel algorithm, the fused op under Lamport and one-shot, the all-gather; T = 3 x 24 bf16.
    Returns what differs from the bit-exact reference."""
    bad: list[str] = []
    with tpcomm.Communicator(timeout_s=120) as comm:
        T, H = 3, 24
        xs = [(torch.randn(T, H, generator=torch.Generator().manual_seed(q)) * 4).to(torch.bfloat16)
              for q in range(world_size)]
        r = torch.randn(T, H, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
        w = torch.randn(H, generator=torch.Generator().manual_seed(98)).to(torch.bfloat16)
        s = R.reduce_in_rank_order(xs)
        out_ref, res_ref = R.add_rmsnorm_reference(s, r, w, 1e-6)
        for algo in ("lamport", "one_shot", "two_shot"):
            with comm.use_algorithm(algo):
                if not torch.equal(comm.all_reduce(xs[rank]), s):
                    bad.append(f"{algo}: all_reduce")
                if algo != "two_shot":
                    o, ro = comm.fused_add_rmsnorm(xs[rank], r, w, 1e-6)
                    if not (torch.equal(o, out_ref) and torch.equal(ro, res_ref)):
                        bad.append(f"{algo}: fused_add_rmsnorm")
        if not torch.equal(comm.all_gather(xs[rank]), torch.cat(xs)):
            bad.append("all_gather")
        comm.check()
    return bad
