"""Rank bodies of ``tests/test_collectives.py`` (pool bodies: ``fn(ctx, *args)``): every algorithm
forced on the same inputs, all_gather, reduce_scatter, interleaved calls, calls that do not match a
peer's, and the crossover table a communicator loads.

As in ``rank_cases.py``, each body rebuilds every rank's input from the case's seed, runs the op and
returns tensors (or what it raised); the assertions live in the test file, which sees every rank's answer.
"""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist
from harness import new_communicator
from numerics import bits, out_ulp_tolerance, ulp_distance, weight_input

import tpcomm


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
    epoch steps of the whole algorithm}, "ref": {n: {output: reference}}}``.
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
    return {"runs": runs, "plans": plans, "launches": launches, "ref": ref}


# -- all_gather, reduce_scatter ----------------------------------------------------------------------------
def all_gather_case(ctx, seed, shape, dtype, dims, max_bytes=None, algo="auto"):
    """``all_gather(x, dim)`` for each dim of ``dims`` (inputs: :func:`any_input`). Returns per dim the
    result (or the error it raised), the expected ``torch.cat`` of every rank's input, the launches
    (epoch steps) and the plan."""
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
