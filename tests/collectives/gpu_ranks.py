"""Rank bodies of ``tests/collectives/test_gpu_collectives.py``, run through ``tpcomm.launch.launch(run_all, 2,
"cuda")``: ``fn(rank, world_size, spec)``. Importing this module touches no GPU.

One launch runs every part (starting ranks and joining NCCL costs seconds; compiling the kernels once
serves every part): every algorithm on the same inputs at real shapes, interleaved calls of every op,
size and algorithm, and all_gather / reduce_scatter captured in CUDA graphs. Each rank checks its own
outputs against the plain-torch reference (computed on its GPU from seeds every rank knows) and returns,
per case, the failures it found (an empty list when all is right) and hashes of the output bits for the
cross-rank comparison, never the tensors. The code is device-agnostic (it runs on CPU ranks too, with
small shapes and no graph capture), so it can be tried without GPUs.
"""

from __future__ import annotations

import random
import time
import traceback

import torch

import tpcomm
from tests.support.gpu import _max_ulp, _mismatch
from tests.support.numerics import bits, out_ulp_tolerance

#: Exponent range (of the 2**k scale) of the wide-range inputs per dtype: float32 squares stay finite;
#: fp16 reaches into its subnormals; float32 into its subnormals.
EXPONENTS = {"bfloat16": (-60, 40), "float16": (-24, 10), "float32": (-140, 40)}
#: Outputs of the fused op and the all_reduce whose bits every algorithm (the fallback too) must give.
EXACT_OUTPUTS = ("s", "residual_out", "residual_out_gemma")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _gen(seed: int, rank: int, role: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(3_000_017 * seed + 307 * rank + role)


def wide(seed, rank, role, shape, dtype, device) -> torch.Tensor:
    """Normal values scaled by ``2**k``, ``k`` per element from ``EXPONENTS`` of ``dtype``."""
    lo, hi = EXPONENTS[str(dtype).replace("torch.", "")]
    g = _gen(seed, rank, role, device)
    k = torch.randint(lo, hi + 1, tuple(shape), generator=g, device=device)
    return (torch.randn(tuple(shape), generator=g, device=device) * torch.exp2(k.to(torch.float32))).to(dtype)


def random_bits(seed, rank, shape, dtype, device) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaN payloads, -0.0, subnormals, infinities): for copies."""
    g = _gen(seed, rank, 9, device)
    size = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    return torch.randint(0, 256, (n * size,), generator=g, device=device, dtype=torch.uint8).view(dtype).view(shape)


def weight(seed, H, dtype, device, gemma=False) -> torch.Tensor:
    w = 0.5 * torch.randn(H, generator=_gen(seed, 0, 3, device), device=device)
    return (w if gemma else 1.0 + w).to(dtype)


def bits_hash(t: torch.Tensor) -> int:
    """A 64-bit hash of the bits of ``t``, computed on its device (integer overflow wraps)."""
    b = t.contiguous().view(-1)
    b = (b.view(torch.uint8) if b.dtype in (torch.bool,) or b.element_size() == 1 else bits(b)).to(torch.int64)
    idx = torch.arange(b.numel(), device=b.device, dtype=torch.int64)
    return int(((b + 0x9E3779B9) * (idx * 0x5851F42D + 0x14057B7E)).sum()) if b.numel() else 0


def _new_comm(timeout_s, max_bytes=None):
    return tpcomm.Communicator(max_bytes=max_bytes, timeout_s=timeout_s)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _delay(device, rng, max_delay_us):
    """A different delay on every rank before a call: a spin kernel on the GPU, a sleep on the CPU."""
    us = rng.uniform(0, max_delay_us)
    if device.type == "cuda":
        torch.cuda._sleep(int(us * 2000))  # about 2 GHz: cycles per microsecond
    else:
        time.sleep(us * 1e-6)


def run_all(rank, world_size, spec):
    """Run each part named in ``spec`` (``algorithms``, ``interleave``, ``graphs``) with its arguments;
    returns ``{part: result}``, a part that raised giving ``{"error": traceback}``."""
    parts = {"algorithms": algorithms_part, "interleave": interleave_part, "graphs": graphs_part}
    result = {}
    for name, kwargs in spec.items():
        t0 = time.perf_counter()
        try:
            result[name] = parts[name](rank, world_size, _device(), **kwargs)
        except Exception:
            result[name] = {"error": traceback.format_exc()}
        result[name]["seconds"] = time.perf_counter() - t0
    return result


# -- every algorithm on the same inputs ----------------------------------------------------------------
def _outputs(comm, x, res, w, wg, which):
    """The outputs named in ``which`` (``s``, ``fused``, ``no_res``, ``gemma``) for input rows ``x``."""
    outs = {}
    if "s" in which:
        outs["s"] = comm.all_reduce(x)
    if "fused" in which:
        outs["out"], outs["residual_out"] = comm.fused_add_rmsnorm(x, res, w)
    if "no_res" in which:
        outs["out_no_residual"], ro = comm.fused_add_rmsnorm(x, None, w)
        assert ro is None
    if "gemma" in which:
        outs["out_gemma"], outs["residual_out_gemma"] = comm.fused_add_rmsnorm(x, res, wg, gemma=True)
    return outs


def _references(xs, res, w, wg, which):
    s = tpcomm.reduce_in_rank_order(xs)
    ref = {"s": s}
    if "fused" in which:
        ref["out"], ref["residual_out"] = tpcomm.add_rmsnorm_reference(s, res, w, 1e-6)
    if "no_res" in which:
        ref["out_no_residual"] = tpcomm.add_rmsnorm_reference(s, None, w, 1e-6)[0]
    if "gemma" in which:
        ref["out_gemma"], ref["residual_out_gemma"] = tpcomm.add_rmsnorm_reference(s, res, wg, 1e-6, gemma=True)
    return ref


def _algorithms_case(comm, rank, world_size, device, seed, dtype, H, T, which, prefixes, algos):
    xs = [wide(seed, r, 1, (T, H), dtype, device) for r in range(world_size)]
    res = wide(seed, 0, 2, (T, H), dtype, device)
    w, wg = weight(seed, H, dtype, device), weight(seed, H, dtype, device, gemma=True)
    x = xs[rank]
    ref = _references(xs, res, w, wg, which)
    tol = out_ulp_tolerance(dtype, H)
    failures, fallback_prefix, hashes, base = [], [], {}, None
    for algo in algos:  # one_shot first: the base every other algorithm is compared with
        with comm.use_algorithm(algo):
            nbytes = x.numel() * x.element_size()
            for op in ("all_reduce", "fused_add_rmsnorm"):
                plan = comm.plan(op, nbytes, H, dtype).algorithm
                if plan != algo:
                    failures.append(f"{algo}: {op} planned {plan!r}")
            outs = _outputs(comm, x, res, w, wg, which)
            _sync(device)
            comm.check()
            for name, t in outs.items():
                if name in EXACT_OUTPUTS:
                    if _mismatch(t, ref[name]):
                        failures.append(f"{algo} {name}: {_mismatch(t, ref[name])} elements differ from the reference")
                elif _max_ulp(t, ref[name]) > tol:
                    failures.append(f"{algo} {name}: {_max_ulp(t, ref[name])} ulp from the reference (tol {tol})")
                if base is not None:
                    if algo != "fallback" or name in EXACT_OUTPUTS:
                        if _mismatch(t, base[name]):
                            failures.append(f"{algo} {name}: {_mismatch(t, base[name])} elements differ from "
                                            "one_shot's")
                    elif _max_ulp(t, base[name]) > tol:
                        failures.append(f"{algo} {name}: {_max_ulp(t, base[name])} ulp from one_shot's (tol {tol})")
                hashes[f"{algo} {name}"] = bits_hash(t)
            for n in prefixes:  # batch invariance: the first n rows alone
                part = _outputs(comm, x[:n], res[:n], w, wg, which)
                _sync(device)
                for name, t in part.items():
                    if _mismatch(t, outs[name][:n]):
                        msg = (f"{algo} {name}: the first {n} rows alone differ from those rows inside {T} rows "
                               f"in {_mismatch(t, outs[name][:n])} elements (max {_max_ulp(t, outs[name][:n])} ulp)")
                        # the fallback's norm (torch's mean) apart: a known gap, its own test
                        (fallback_prefix if algo == "fallback" and name not in EXACT_OUTPUTS else failures).append(msg)
        if base is None:
            base = outs
    return failures, fallback_prefix, hashes


def algorithms_part(rank, world_size, device, cases, algos, timeout_s):
    """For each case ``(case_id, dtype name, H, T, which, prefixes)``: every algorithm of ``algos``
    forced on the same wide-range inputs, compared with the reference and with one-shot (see
    ``tests/collectives/test_gpu_collectives.py``). Returns ``{"cases": {case_id: {"failures", "fallback_prefix",
    "hashes"}}}`` (``fallback_prefix``: where the fallback's norm outputs of a prefix of rows differ from
    the same rows of the whole call); the part stops at a case that raised (the peer's calls then time
    out)."""
    comm = _new_comm(timeout_s)
    summaries = {}
    try:
        for i, (case_id, dtype_name, H, T, which, prefixes) in enumerate(cases):
            dtype = getattr(torch, dtype_name)
            run = [a for a in algos if not (a == "lamport" and dtype == torch.float32)]
            try:
                failures, fallback_prefix, hashes = _algorithms_case(comm, rank, world_size, device, 500 + i, dtype,
                                                                     H, T, which, prefixes, run)
            except Exception:
                summaries[case_id] = {"failures": [traceback.format_exc()], "fallback_prefix": [], "hashes": {}}
                break
            summaries[case_id] = {"failures": failures, "fallback_prefix": fallback_prefix, "hashes": hashes}
    finally:
        _sync(device)
        comm.close()
    return {"cases": summaries}


# -- interleaved calls -----------------------------------------------------------------------------------
def _check_step(comm, op, x_all, rank, world_size, dtype, H, seed, device):
    """Make one call of ``op`` and return ``(output, failure or None)`` (comparisons queued on the
    stream; ``.item()`` runs after the call)."""
    x = x_all[rank]
    if op == "all_reduce":
        y = comm.all_reduce(x)
        want = tpcomm.reduce_in_rank_order(x_all)
    elif op == "all_gather":
        y = comm.all_gather(x)
        want = torch.cat(x_all)
    elif op == "reduce_scatter":
        y = comm.reduce_scatter(x)
        want = torch.tensor_split(tpcomm.reduce_in_rank_order(x_all), world_size)[rank]
    else:
        res = wide(seed, 0, 2, x.shape, dtype, device) if op == "fused" else None
        w = weight(seed, H, dtype, device)
        y, ro = comm.fused_add_rmsnorm(x, res, w)
        out_ref, ro_ref = tpcomm.add_rmsnorm_reference(tpcomm.reduce_in_rank_order(x_all), res, w, 1e-6)
        fail = []
        if ro is not None and _mismatch(ro, ro_ref):
            fail.append(f"residual_out: {_mismatch(ro, ro_ref)} elements differ from the reference")
        if _max_ulp(y, out_ref) > out_ulp_tolerance(dtype, H):
            fail.append(f"out {_max_ulp(y, out_ref)} ulp from the reference")
        return y, "; ".join(fail) or None
    if y.shape != want.shape or _mismatch(y, want):
        return y, f"{y.shape} vs {want.shape}, {_mismatch(y, want) if y.shape == want.shape else '-'} elements differ"
    return y, None


def interleave_part(rank, world_size, device, steps, rounds, max_delay_us, timeout_s):
    """``rounds`` times, every step ``(op, T, H, dtype name, algo)`` of ``steps`` back to back on one
    communicator (ops ``fused``, ``fused_no_res``, ``all_reduce``, ``all_gather``, ``reduce_scatter``),
    each rank delayed differently before every call; every output checked against the reference.
    Returns ``{"failures": [...], "hashes": [per step hash or None (reduce_scatter shares differ)]}``."""
    comm = _new_comm(timeout_s)
    rng = random.Random(rank * 7 + 1)
    failures, hashes = [], []
    try:
        for rnd in range(rounds):
            for i, (op, T, H, dtype_name, algo) in enumerate(steps):
                dtype = getattr(torch, dtype_name)
                seed = 10_000 + 100 * rnd + i
                x_all = [wide(seed, r, 1, (T, H), dtype, device) for r in range(world_size)]
                _delay(device, rng, max_delay_us)
                with comm.use_algorithm(algo):
                    y, fail = _check_step(comm, op, x_all, rank, world_size, dtype, H, seed, device)
                if fail:
                    failures.append(f"round {rnd} step {i} ({op} {T}x{H} {dtype_name} {algo}): {fail}")
                hashes.append(None if op == "reduce_scatter" else bits_hash(y))
        _sync(device)
        comm.check()
    finally:
        _sync(device)
        comm.close()
    return {"failures": failures, "hashes": hashes}


# -- CUDA graphs ------------------------------------------------------------------------------------------
def _inputs_for(call, seed, world_size, device):
    op, T, H, dtype_name, _ = call
    dtype = getattr(torch, dtype_name)
    if op == "all_gather":
        return [random_bits(seed, r, (T, H), dtype, device) for r in range(world_size)]
    return [wide(seed, r, 1, (T, H), dtype, device) for r in range(world_size)]


def _run_call(comm, call, x, extra):
    op, _, _, _, dim = call
    if op == "all_gather":
        return comm.all_gather(x, dim)
    if op == "reduce_scatter":
        return comm.reduce_scatter(x, dim)
    if op == "all_reduce":
        return comm.all_reduce(x)
    with comm.use_algorithm("two_shot"):
        return comm.fused_add_rmsnorm(x, extra["res"], extra["w"])[1]  # residual_out: exact


def _expected(call, x_all, extra, rank, world_size):
    op, _, _, _, dim = call
    if op == "all_gather":
        return torch.cat(x_all, dim)
    s = tpcomm.reduce_in_rank_order(x_all)
    if op == "reduce_scatter":
        return torch.tensor_split(s, world_size, dim)[rank]
    if op == "all_reduce":
        return s
    return tpcomm.add_rmsnorm_reference(s, extra["res"], extra["w"], 1e-6)[1]


class _Eager:
    """Stands in for a CUDA graph on CPU ranks: ``replay`` runs the calls again into the same outputs."""

    def __init__(self, fn):
        self.fn = fn
        self.outs = fn()

    def replay(self):
        for o, n in zip(self.outs, self.fn()):
            o.copy_(n)


def _capture(fn, device):
    """``(graph, outputs)``: ``fn``'s calls captured in a CUDA graph (run eagerly on the CPU)."""
    if device.type != "cuda":
        g = _Eager(fn)
        return g, g.outs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


def graphs_part(rank, world_size, device, calls, side_call, replays, timeout_s):
    """Capture ``calls`` (``(op, T, H, dtype name, dim)``, op ``all_gather``, ``reduce_scatter``,
    ``all_reduce`` or ``fused`` (two-shot, its residual_out)) in one CUDA graph and ``side_call`` in a
    second, after a warm-up on a side stream; then ``replays`` times: copy new inputs into the captured
    ones, replay (the second graph on odd steps), compare every output with the reference and with an
    eager call on the same inputs, and make an eager call of another size between replays. Returns
    ``{"failures": [...], "hashes": [[per call hash] per replay], "replays": n}``."""
    comm = _new_comm(timeout_s)
    try:
        static, extras = [], []
        for i, call in enumerate(calls + [side_call]):
            x_all = _inputs_for(call, 20_000 + i, world_size, device)
            static.append(x_all[rank].clone())
            dtype = getattr(torch, call[3])
            extras.append({"res": wide(20_000 + i, 0, 2, (call[1], call[2]), dtype, device),
                           "w": weight(20_000 + i, call[2], dtype, device)})
        n = len(calls)

        def main():
            return [_run_call(comm, c, static[i], extras[i]) for i, c in enumerate(calls)]

        def side():
            return [_run_call(comm, side_call, static[n], extras[n])]

        if device.type == "cuda":  # warm-up on a side stream, as torch documents for capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    main()
                    side()
            torch.cuda.current_stream().wait_stream(stream)
            _sync(device)
        graph, outs = _capture(main, device)
        graph2, outs2 = _capture(side, device)
        _sync(device)

        failures, hashes = [], []
        for step in range(1, replays + 1):
            inputs = []
            for i, call in enumerate(calls + [side_call]):
                x_all = _inputs_for(call, 30_000 + 100 * step + i, world_size, device)
                static[i].copy_(x_all[rank])
                inputs.append(x_all)
            graph.replay()
            if step % 2:
                graph2.replay()
            _sync(device)
            comm.check()
            eager = main()
            step_hashes = []
            for i, call in enumerate(calls):
                name = f"replay {step} call {i} {call}"
                want = _expected(call, inputs[i], extras[i], rank, world_size)
                got = outs[i]
                if got.shape != want.shape or _mismatch(got, want):
                    failures.append(f"{name}: differs from the reference")
                if got.shape != eager[i].shape or _mismatch(got, eager[i]):
                    failures.append(f"{name}: differs from the eager call")
                step_hashes.append(None if call[0] == "reduce_scatter" else bits_hash(got))
            if step % 2:
                want = _expected(side_call, inputs[n], extras[n], rank, world_size)
                if outs2[0].shape != want.shape or _mismatch(outs2[0], want):
                    failures.append(f"replay {step}: the second graph's {side_call} differs from the reference")
            hashes.append(step_hashes)
            z = comm.all_gather(torch.full((3, 5), float(rank + step), dtype=torch.float16, device=device))
            want = torch.cat([torch.full((3, 5), float(r + step), dtype=torch.float16, device=device)
                              for r in range(world_size)])
            _sync(device)
            if _mismatch(z, want):
                failures.append(f"replay {step}: an eager all_gather between replays is wrong")
        return {"failures": failures, "hashes": hashes, "replays": len(hashes)}
    finally:
        _sync(device)
        comm.close()
