"""Rank bodies of the GPU fused FP8 tests (``tests/quant/test_gpu_fused_fp8.py``), run through
``tpcomm.launch.launch(fn, 2, "cuda")``: ``fn(rank, world_size, *args)``. Importing this module touches
no GPU.

One launch runs every case and the CUDA-graph check (spawning ranks, joining NCCL and compiling the
kernels cost more than the cases). Each rank compares its own outputs, on its GPU, with the standalone
Triton quant (``tpcomm.quant``) and the plain-torch quant (``tpcomm.reference``) of the fused ``out``,
and with the plain-torch reference of the norm, and returns a small summary per case (mismatch counts,
failure messages, digests of the bytes for the cross-rank comparison), never the tensors.
"""

from __future__ import annotations

import hashlib
import time
import traceback

import torch

import tpcomm
from tests.quant import ranks as fc
from tests.support.gpu import _digest, _max_ulp, _mismatch, gpu_inputs
from tests.support.numerics import bits, out_ulp_tolerance

FP8 = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}


def _value_mismatch(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ, a NaN matching any NaN (payloads are not part of the contract)."""
    return int(((bits(a) != bits(b)) & ~(a.isnan() & b.isnan())).sum())


def _bytes_digest(q: torch.Tensor) -> str:
    return hashlib.sha256(q.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _bytes_mismatch(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) if a.shape == b.shape else -1


def _scales_mismatch(a: torch.Tensor, b: torch.Tensor) -> int:
    return _mismatch(a, b) if a.shape == b.shape and a.stride() == b.stride() else -1


def _call(comm, algo, x, res, w, quant, fp8, group, column_major, emit):
    per_group = {"group_size": group} if quant == "fp8_per_group" else {}  # per-token calls take none
    with comm.use_algorithm(algo):
        return comm.fused_add_rmsnorm(x, res, w, eps=1e-6, quant=quant, fp8_dtype=fp8,
                                      column_major_scales=column_major, emit_unquantized=emit, **per_group)


def _plan(comm, algo, x) -> str:
    with comm.use_algorithm(algo):
        return comm.plan("fused_add_rmsnorm", x.numel() * x.element_size(), x.shape[-1], x.dtype).algorithm


def run_case(comm, rank, world_size, case, device) -> dict:
    """One case ``(case_id, algo, dtype, fp8, quant, group, column_major, H, T, residual, special,
    also_no_emit, seed)``: the quantised call with ``emit_unquantized=True`` (and, with
    ``also_no_emit``, without it), compared as the module docstring says."""
    _, algo, dtype_name, fp8_name, quant, group, cm, H, T, residual, special, also_no_emit, seed = case
    dtype, fp8 = getattr(torch, dtype_name), FP8[fp8_name]
    xs, res, w = gpu_inputs(seed, world_size, (T, H), dtype, device)
    res = res if residual else None
    if special:
        fc.special_inputs(xs, res, dtype, world_size - 1)
    x = xs[rank]
    q, s, ro, out = _call(comm, algo, x, res, w, quant, fp8, group, cm, True)
    std_q, std_s = fc.standalone_quant(out, quant, fp8, group, cm)
    ref_q, ref_s = fc.reference_quant(out, quant, fp8, group, cm)
    s_ref = tpcomm.reduce_in_rank_order(xs)
    out_ref, ro_ref = tpcomm.add_rmsnorm_reference(s_ref, res, w, 1e-6)
    y32 = fc.norm_f32(ro_ref if res is not None else s_ref, w, 1e-6, False)
    torch.cuda.synchronize()
    comm.check()
    q2 = q.view(torch.uint8)
    summary = {
        "plan": _plan(comm, algo, x),
        "q_std": _bytes_mismatch(q, std_q), "s_std": _scales_mismatch(s, std_s),
        "q_ref": _bytes_mismatch(q, ref_q), "s_ref": _scales_mismatch(s, ref_s),
        "ro": _value_mismatch(ro, ro_ref) if res is not None else 0,
        "out_max_ulp": _max_ulp(out, out_ref), "out_tol": out_ulp_tolerance(dtype, H),
        "rules": fc.scale_rule_failures(q2, s, out, fp8),
        "dequant": fc.dequantised_failure(q2, s, y32, fp8),
        "hash_q": _bytes_digest(q), "hash_s": _digest(s),
    }
    if also_no_emit:
        q_n, s_n, ro_n, out_n = _call(comm, algo, x, res, w, quant, fp8, group, cm, False)
        torch.cuda.synchronize()
        summary.update(no_emit_out=out_n is None, no_emit_q=_bytes_mismatch(q_n, q),
                       no_emit_s=_scales_mismatch(s_n, s),
                       no_emit_ro=_mismatch(ro_n, ro) if res is not None else 0)
    return summary


def graph_replays(comm, rank, world_size, calls, replays, seed0, device) -> dict:
    """Capture ``calls`` (``(algo, dtype, fp8, quant, group, column_major, H, T)``, each with a residual
    and ``emit_unquantized``) in one CUDA graph after a warm-up on a side stream; then ``replays``
    times: copy new inputs into the captured ones, replay, and compare each call's bytes, scales,
    ``out`` and ``residual_out`` with an eager call on the same inputs (bit for bit) and the bytes and
    scales with the standalone Triton quant of the replayed ``out``. Returns failure messages and the
    digests of every replay's bytes."""
    static = []
    for i, (algo, dtype_name, fp8_name, quant, group, cm, H, T) in enumerate(calls):
        xs, res, w = gpu_inputs(seed0 + i, world_size, (T, H), getattr(torch, dtype_name), device)
        static.append({"x": xs[rank].clone(), "res": res.clone(), "w": w})

    def run_all():
        return [_call(comm, c[0], st["x"], st["res"], st["w"], c[3], FP8[c[2]], c[4], c[5], True)
                for c, st in zip(calls, static)]

    def fill(step):
        for i, (_, dtype_name, _, _, _, _, H, T) in enumerate(calls):
            xs, res, _ = gpu_inputs(seed0 + 1000 * step + i, world_size, (T, H), getattr(torch, dtype_name),
                                    device)
            static[i]["x"].copy_(xs[rank])
            static[i]["res"].copy_(res)

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run_all()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outs = run_all()
    torch.cuda.synchronize()
    failures, digests = [], []
    for step in range(1, replays + 1):
        fill(step)
        graph.replay()
        torch.cuda.synchronize()
        try:
            comm.check()
        except Exception as e:
            failures.append(f"step {step}: {e}")
            break
        eager = run_all()
        torch.cuda.synchronize()
        step_digests = []
        for i, (c, (gq, gs, gro, gout), (eq, es, ero, eout)) in enumerate(zip(calls, graph_outs, eager)):
            name = f"step {step} call {i} {c}"
            for what, n in (("bytes", _bytes_mismatch(gq, eq)), ("scales", _scales_mismatch(gs, es)),
                            ("out", _mismatch(gout, eout)), ("residual_out", _mismatch(gro, ero))):
                if n:
                    failures.append(f"{name}: {what}: graph vs eager differ in {n} elements")
            sq, ss = fc.standalone_quant(gout, c[3], FP8[c[2]], c[4], c[5])
            if _bytes_mismatch(gq, sq) or _scales_mismatch(gs, ss):
                failures.append(f"{name}: replayed bytes/scales differ from tpcomm.quant of the replayed out")
            step_digests.append(_digest(gs))
        digests.append(step_digests)
    return {"failures": failures, "digests": digests}


def fp8_gpu_body(rank, world_size, cases, graph_calls, replays) -> dict:
    """Every case of ``cases`` (:func:`run_case`; a case that raised has ``error`` set and the next
    cases run on a fresh communicator), then :func:`graph_replays` of ``graph_calls`` on a fresh
    communicator. Returns ``{"cases": {case_id: summary}, "graph": ...}``."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = tpcomm.Communicator()
    summaries = {}
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        if rank == 0 and i % 25 == 0:  # progress in the log (pytest -s), should the launch time out
            print(f"[fused fp8 gpu] case {i}/{len(cases)} {case[0]} at {time.perf_counter() - t0:.1f} s",
                  flush=True)
        try:
            summary = run_case(comm, rank, world_size, case, device)
            summary["error"] = None
        except Exception:
            summary = {"error": traceback.format_exc()}
            comm.close()  # a failed call may leave epochs out of step: start afresh
            torch.distributed.barrier()
            comm = tpcomm.Communicator()
        summaries[case[0]] = summary
    comm.close()
    if rank == 0:
        print(f"[fused fp8 gpu] {len(cases)} cases in {time.perf_counter() - t0:.1f} s; graph", flush=True)
    graph_comm = tpcomm.Communicator()
    try:
        graph = graph_replays(graph_comm, rank, world_size, graph_calls, replays, 777, device)
    except Exception:
        graph = {"failures": [traceback.format_exc()], "digests": []}
    graph_comm.close()
    return {"cases": summaries, "graph": graph}
