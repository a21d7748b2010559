"""Rank bodies of the GPU tests (``tests/communicator/test_gpu.py``), run through ``tpcomm.launch.launch(fn, 2,
"cuda")``: ``fn(rank, world_size, *args)``. Importing this module touches no GPU.

Spawning ranks and joining NCCL costs seconds, so one launch runs many cases; each rank compares its own
outputs with the plain-torch reference (computed on its GPU from seeds every rank knows) and returns a
small summary per case (mismatch counts, worst ulp, a hash of the output bits for the cross-rank
comparison), never the tensors. Every case is run and summarised; nothing stops at the first failure.
"""

from __future__ import annotations

import traceback

import torch

import tpcomm
from tests.collectives.ranks import layout_of
from tests.support.gpu import _digest, _max_ulp, _mismatch, gpu_inputs
from tests.support.numerics import bits, out_ulp_tolerance

#: A number per dtype for the case seeds (Python's str hash differs between processes).
DTYPE_CODES = {"bfloat16": 1, "float16": 2, "float32": 3}


def _new_comm(algo, max_bytes=None, timeout_s=None):
    import os

    saved = os.environ.get("TPCOMM_ALGO")
    if algo is not None:
        os.environ["TPCOMM_ALGO"] = algo
    try:
        return tpcomm.Communicator(max_bytes=max_bytes, timeout_s=timeout_s)
    finally:
        if saved is None:
            os.environ.pop("TPCOMM_ALGO", None)
        else:
            os.environ["TPCOMM_ALGO"] = saved


def eager_cases(rank, world_size, cases, chunk_max_bytes):
    """Run every case ``(case_id, algo, dtype_name, H, T, chunked, layout)`` and summarise it.

    For each: ``all_reduce(x, out=NaN-filled)`` and ``fused_add_rmsnorm`` on a communicator that forces
    ``algo``, with ``x`` (and the residual) in ``layout`` (``tests.collectives.ranks.layout_of``), compared with the
    reference. The fused outputs are poisoned as far as the caller can: NaN-filled blocks of their size
    are freed just before the call, so the caching allocator hands them out again. When ``chunked``, the
    same fused call and all_reduce on a communicator with ``max_bytes=chunk_max_bytes`` (several
    launches) compared bit for bit with the first. Returns ``{case_id: summary}``; a case that raised
    has ``error`` set (and the next cases still run, on fresh communicators).
    """
    device = torch.device("cuda", torch.cuda.current_device())
    comms: dict = {}
    summaries = {}
    for case_id, algo, dtype_name, H, T, chunked, layout in cases:
        dtype = getattr(torch, dtype_name)
        summary: dict = {"error": None}
        try:
            key = (algo, None)
            if key not in comms:
                comms[key] = _new_comm(algo)
            comm = comms[key]
            seed = 100_000 * H + 10 * T + DTYPE_CODES[dtype_name]  # the same on every rank
            xs, res, w = gpu_inputs(seed, world_size, (T, H), dtype, device)
            x = layout_of(xs[rank], layout)
            r_in = layout_of(res, layout)
            s_ref = tpcomm.reduce_in_rank_order(xs)
            out_ref, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, w, 1e-6)
            y = torch.full((T, H), float("nan"), dtype=dtype, device=device)
            comm.all_reduce(x, out=y)
            poison = [torch.full((T, H), float("nan"), dtype=dtype, device=device) for _ in range(2)]
            del poison
            out, ro = comm.fused_add_rmsnorm(x, r_in, w, eps=1e-6)
            torch.cuda.synchronize()
            comm.check()
            summary.update(
                plan_fused=comm.plan("fused_add_rmsnorm", x.numel() * x.element_size(), H, dtype).algorithm,
                nan_left=int(y.isnan().sum()), s_mismatch=_mismatch(y, s_ref),
                x_untouched=torch.equal(bits(x), bits(xs[rank])),
                ro_mismatch=_mismatch(ro, ro_ref), out_max_ulp=_max_ulp(out, out_ref),
                out_tol=out_ulp_tolerance(dtype, H),
                hash_s=_digest(y), hash_ro=_digest(ro), hash_out=_digest(out))
            if chunked:
                key = (algo, chunk_max_bytes)
                if key not in comms:
                    comms[key] = _new_comm(algo, chunk_max_bytes)
                small = comms[key]
                before = small.workspace.epoch()
                out_c, ro_c = small.fused_add_rmsnorm(x, res, w, eps=1e-6)
                launches = small.workspace.epoch() - before
                y_c = small.all_reduce(x)
                torch.cuda.synchronize()
                small.check()
                summary.update(chunk_launches=launches, chunk_out_mismatch=_mismatch(out_c, out),
                               chunk_ro_mismatch=_mismatch(ro_c, ro), chunk_s_mismatch=_mismatch(y_c, y))
        except Exception:
            summary["error"] = traceback.format_exc()
            for c in comms.values():  # a failed call may leave epochs out of step: start afresh
                c.close()
            comms.clear()
            torch.distributed.barrier()
        summaries[case_id] = summary
    for c in comms.values():
        c.close()
    return summaries


#: The calls captured in one CUDA graph: (kind, (T, H), dtype name). Under auto dispatch the 16-bit
#: ones take Lamport and the fp32 ones one-shot, so both kinds of kernel share the graph.
GRAPH_CALLS = [("fused", (16, 4096), "bfloat16"), ("all_reduce", (16, 4096), "bfloat16"),
               ("fused", (4, 2880), "float32"), ("fused_no_res", (64, 6144), "float16"),
               ("all_reduce", (1, 7168), "float32"), ("fused", (256, 8192), "bfloat16")]


def graph_replays(rank, world_size, replays, seed0):
    """Capture GRAPH_CALLS in one CUDA graph (and one all_reduce in a second graph), after a warm-up
    on a side stream as torch documents; then ``replays`` times: copy new inputs into the captured
    input tensors, replay, and compare every output with eager calls on the same inputs (bit for bit)
    and with the reference; between replays run eager calls of another shape and replay the second
    graph on odd steps. Returns per-step failure messages and output digests."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = tpcomm.Communicator()
    static = []
    for i, (kind, shape, dtype_name) in enumerate(GRAPH_CALLS):
        dtype = getattr(torch, dtype_name)
        xs, res, w = gpu_inputs(seed0 + i, world_size, shape, dtype, device)
        static.append({"x": xs[rank].clone(), "res": res.clone(), "w": w, "dtype": dtype})
    x2 = torch.zeros(3, 1000, dtype=torch.bfloat16, device=device)

    def fill(step):
        """New inputs for every captured call; returns every rank's inputs for the reference."""
        allx = []
        for i, (kind, shape, dtype_name) in enumerate(GRAPH_CALLS):
            xs, res, _ = gpu_inputs(seed0 + 1000 * step + i, world_size, shape, static[i]["dtype"], device)
            static[i]["x"].copy_(xs[rank])
            static[i]["res"].copy_(res)
            allx.append(xs)
        return allx

    def run_all():
        outs = []
        for (kind, _, _), st in zip(GRAPH_CALLS, static):
            if kind == "all_reduce":
                outs.append((comm.all_reduce(st["x"]), None))
            else:
                outs.append(comm.fused_add_rmsnorm(st["x"], st["res"] if kind == "fused" else None, st["w"]))
        return outs

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run_all()
            comm.all_reduce(x2)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outs = run_all()
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        y2 = comm.all_reduce(x2)
    torch.cuda.synchronize()

    failures, digests = [], []
    for step in range(1, replays + 1):
        allx = fill(step)
        graph.replay()
        if step % 2:
            x2.fill_(float(rank + step))
            graph2.replay()
        torch.cuda.synchronize()
        try:
            comm.check()
        except Exception as e:
            failures.append(f"step {step}: {e}")
            break
        if step % 2:
            want = float(sum(r + step for r in range(world_size)))
            if not bool((y2.float() == want).all()):
                failures.append(f"step {step}: second graph's all_reduce wrong")
        eager = run_all()
        torch.cuda.synchronize()
        step_digests = []
        for i, ((kind, shape, dtype_name), st) in enumerate(zip(GRAPH_CALLS, static)):
            g_out, g_ro = graph_outs[i]
            e_out, e_ro = eager[i]
            name = f"step {step} call {i} {kind} {shape} {dtype_name}"
            if _mismatch(g_out, e_out):
                failures.append(f"{name}: graph vs eager differ in {_mismatch(g_out, e_out)} elements")
            s_ref = tpcomm.reduce_in_rank_order(allx[i])
            if kind == "all_reduce":
                if _mismatch(g_out, s_ref):
                    failures.append(f"{name}: {_mismatch(g_out, s_ref)} elements differ from the reference")
            else:
                out_ref, ro_ref = tpcomm.add_rmsnorm_reference(
                    s_ref, st["res"] if kind == "fused" else None, st["w"], 1e-6)
                tol = out_ulp_tolerance(st["dtype"], shape[-1])
                if _max_ulp(g_out, out_ref) > tol:
                    failures.append(f"{name}: out {_max_ulp(g_out, out_ref)} ulp from the reference")
                if g_ro is not None and (_mismatch(g_ro, ro_ref) or _mismatch(g_ro, e_ro)):
                    failures.append(f"{name}: residual_out differs (reference {_mismatch(g_ro, ro_ref)}, "
                                    f"eager {_mismatch(g_ro, e_ro)})")
            step_digests.append(_digest(g_out))
        digests.append(step_digests)
        # an eager call of another size between replays (moves the epoch by one more launch)
        z = comm.all_reduce(torch.full((5, 33), float(rank), dtype=torch.float16, device=device))
        torch.cuda.synchronize()
        if not bool((z.float() == float(sum(range(world_size)))).all()):
            failures.append(f"step {step}: eager all_reduce between replays wrong")
    comm.close()
    return {"failures": failures, "digests": digests}


def gpu_peer_timeout(rank, world_size, timeout_s, configs):
    """For each ``(algo, op, T)``: rank 1 skips one call of ``T`` rows of 4096 bf16 on a fresh
    communicator with a short timeout; rank 0's call must end in PeerTimeoutError naming peer 1.
    Returns ``{"algo-op-T": {"error", "elapsed"}}`` as rank 0 saw it."""
    import time

    import torch.distributed as dist

    seen = {}
    device = torch.device("cuda", torch.cuda.current_device())
    for algo, op, T in configs:
        comm = _new_comm(algo, timeout_s=timeout_s)
        x = torch.ones(T, 4096, dtype=torch.bfloat16, device=device)
        w = torch.ones(4096, dtype=torch.bfloat16, device=device)
        call = (lambda: comm.all_reduce(x)) if op == "all_reduce" else (lambda: comm.fused_add_rmsnorm(x, x, w))
        call()  # a call both ranks make (compiles the kernel before anything is timed)
        torch.cuda.synchronize()
        if rank == 0:
            t0 = time.perf_counter()
            err = None
            try:
                call()
                torch.cuda.synchronize()
                comm.check()
            except tpcomm.PeerTimeoutError as e:
                err = {"type": "PeerTimeoutError", "peer": e.peer, "message": str(e)}
            except Exception as e:
                err = {"type": type(e).__name__, "message": str(e)}
            seen[f"{algo}-{op}-{T}"] = {"error": err, "elapsed": time.perf_counter() - t0}
        torch.cuda.synchronize()
        dist.barrier()
        comm.close()
    return seen


def gpu_special_values(rank, world_size, pairs):
    """For each ``(algo, dtype name)``: -0.0 from every rank (s and residual_out must be +0.0, sign bit
    clear) and NaN / +-Inf in some ranks' inputs (compared with the reference, any NaN matching any
    NaN). Returns ``{"algo-dtype": [failure messages]}``."""
    device = torch.device("cuda", torch.cuda.current_device())
    report = {}
    for algo, dtype_name in pairs:
        dtype = getattr(torch, dtype_name)
        failures = []
        comm = _new_comm(algo)
        try:
            z = torch.full((3, 4096), -0.0, dtype=dtype, device=device)
            w = torch.ones(4096, dtype=dtype, device=device)
            s = comm.all_reduce(z)
            out, ro = comm.fused_add_rmsnorm(z, z, w)
            for name, t in (("s", s), ("residual_out", ro), ("out", out)):
                if int((bits(t) != 0).sum()):
                    failures.append(f"-0.0 inputs: {name} has {int((bits(t) != 0).sum())} elements not +0.0")
            xs = []
            for q in range(world_size):
                x = torch.full((2, 4096), float(q + 1), dtype=dtype, device=device)
                x[0, 1] = float("inf")
                if q == 0:
                    x[0, 0], x[0, 2], x[0, 3] = float("nan"), float("inf"), float("-inf")
                if q == world_size - 1:
                    x[0, 2] = float("-inf")
                xs.append(x)
            res = torch.ones(2, 4096, dtype=dtype, device=device)
            s = comm.all_reduce(xs[rank])
            out, ro = comm.fused_add_rmsnorm(xs[rank], res, w)
            s_ref = tpcomm.reduce_in_rank_order(xs)
            out_ref, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, w, 1e-6)
            torch.cuda.synchronize()
            for name, a, b in (("s", s, s_ref), ("residual_out", ro, ro_ref), ("out", out, out_ref)):
                if not torch.equal(a.isnan(), b.isnan()):
                    failures.append(f"special values: {name}: NaN at different places")
                elif int(((bits(a) != bits(b)) & ~a.isnan()).sum()):
                    failures.append(f"special values: {name}: {int(((bits(a) != bits(b)) & ~a.isnan()).sum())} "
                                    "elements differ from the reference")
        except Exception:
            failures.append(traceback.format_exc())
        finally:
            comm.close()
        report[f"{algo}-{dtype_name}"] = failures
    return report
