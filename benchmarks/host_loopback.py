"""Host time of eager calls on ONE GPU, ranks as loopback communicators (``tpcomm.loopback``), beside
torch's ``y.add_(1)`` (one kernel launch) timed the same way.

Method: for each op, rank 0 issues ``--calls`` calls inside its stream context, then rank 1 the same
(its first kernel pairs with rank 0's first, which waits on the GPU meanwhile), and so on; the host
time of each rank's batch, divided by the calls, is the per-call host time (``run_ranks``' stream
switches are outside the timed loops), reported per rank and as the median of the ranks; run it with
two ``--calls`` (e.g. 25 and 200) to see whether a batch waits for a full launch queue. Every op runs
``--rounds`` times, interleaved with the others and with ``add_``; each number is the median of its rounds. Each op is
timed with new outputs and
with outputs passed (``out=`` etc.), the FP8 forms per token and per group, at 1 and 64 tokens; then
once more with ``TPCOMM_DIRECT_LAUNCH=0`` semantics (replays through ``kernel[grid]``), and in graph
mode (median of 20 replays of 50 calls) for the graph-timing check. Where FlashInfer is installed, its
TRT-LLM one-shot calls (all-reduce, fused, fused FP8 per token, outputs passed) are timed the same way
in the same rounds. Every result is checked against ``tpcomm.reference`` first. Prints a table and writes JSON to
``--out``.

    PYTHONPATH=. python benchmarks/host_loopback.py [--calls 200] [--rounds 9] [--hidden 6144] [--out F]
"""
import argparse
import json
import statistics
import time

import torch

from tpcomm import reference as R


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _ops(T, H, ranks, xs, res, w):
    """``{name: fn(rank) -> result}`` and each op's expected result per rank."""
    outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in ranks]
    res_outs = [torch.empty_like(res) for _ in ranks]
    q_tok = [torch.empty(T, H, device="cuda", dtype=torch.float8_e4m3fn) for _ in ranks]
    s_tok = [torch.empty(T, 1, device="cuda", dtype=torch.float32) for _ in ranks]
    q_grp = [torch.empty(T, H, device="cuda", dtype=torch.float8_e4m3fn) for _ in ranks]
    s_grp = [torch.empty(T, H // 128, device="cuda", dtype=torch.float32) for _ in ranks]
    s = R.reduce_in_rank_order(xs)
    o, ro = R.add_rmsnorm_reference(s, res, w, 1e-6)
    q1, s1 = R.per_token_quant_reference(o)
    q2, s2 = R.per_group_quant_reference(o, 128)
    share = lambda r: torch.tensor_split(s, len(ranks))[r]  # noqa: E731
    x = lambda rank: xs[rank.rank]  # noqa: E731
    return {
        "all_reduce": (lambda rk: rk.all_reduce(x(rk)), lambda got, r: _same(got, s)),
        "all_reduce out=": (lambda rk: rk.all_reduce(x(rk), out=outs[rk.rank]), lambda got, r: _same(got, s)),
        "fused": (lambda rk: rk.fused_add_rmsnorm(x(rk), res, w), lambda got, r: _same(got[0], o) and _same(got[1],
                                                                                                            ro)),
        "fused out=": (lambda rk: rk.fused_add_rmsnorm(x(rk), res, w, out=outs[rk.rank],
                                                       residual_out=res_outs[rk.rank]),
                       lambda got, r: _same(got[0], o) and _same(got[1], ro)),
        "fp8/token": (lambda rk: rk.fused_add_rmsnorm(x(rk), res, w, quant="fp8_per_token"),
                      lambda got, r: _same(got[0], q1) and _same(got[1], s1)),
        "fp8/token out=": (lambda rk: rk.fused_add_rmsnorm(x(rk), res, w, quant="fp8_per_token", q_out=q_tok[rk.rank],
                                                           scales_out=s_tok[rk.rank], residual_out=res_outs[rk.rank]),
                           lambda got, r: _same(got[0], q1) and _same(got[1], s1)),
        "fp8/group": (lambda rk: rk.fused_add_rmsnorm(x(rk), res, w, quant="fp8_per_group"),
                      lambda got, r: _same(got[0], q2) and _same(got[1], s2)),
        "fp8/group out=": (lambda rk: rk.fused_add_rmsnorm(x(rk), res, w, quant="fp8_per_group", q_out=q_grp[rk.rank],
                                                           scales_out=s_grp[rk.rank], residual_out=res_outs[rk.rank]),
                           lambda got, r: _same(got[0], q2) and _same(got[1], s2)),
        "all_gather": (lambda rk: rk.all_gather(x(rk)), lambda got, r: _same(got, torch.cat(xs))),
        "reduce_scatter": (lambda rk: rk.reduce_scatter(x(rk)), lambda got, r: _same(got, share(r))),
    }


def trtllm_ops(T, H, ranks, xs, res, w):
    """FlashInfer's TRT-LLM one-shot calls with their outputs passed, as ``_ops`` gives tpcomm's (checked
    once here), or ``{}`` without FlashInfer."""
    try:
        import warnings

        from tpcomm.bench.loopback import TrtllmLoopback
        warnings.simplefilter("ignore")
        lb = TrtllmLoopback(len(ranks), T, H)
    except ImportError:
        return {}
    outs = [(torch.empty(T, H, device="cuda", dtype=torch.bfloat16),
             torch.empty(T, H, device="cuda", dtype=torch.bfloat16),
             torch.empty(T, H, device="cuda", dtype=torch.float8_e4m3fn),
             torch.empty(T, 1, device="cuda", dtype=torch.float32)) for _ in ranks]
    given = {"all_reduce": lambda o: (o[0],), "fused": lambda o: (o[0], o[1]), "fused_fp8": lambda o: (o[2], o[3],
                                                                                                       o[1])}
    ops = {}
    for op, name in (("all_reduce", "trtllm all_reduce out="), ("fused", "trtllm fused out="),
                     ("fused_fp8", "trtllm fp8/token out=")):
        def fn(rank, op=op):
            lb.call(rank.rank, op, xs[rank.rank], res, w, 1e-6, given[op](outs[rank.rank]))
        current = torch.cuda.current_stream()
        for rank in ranks:  # one call of every rank, then the check
            rank.stream.wait_stream(current)
            with torch.cuda.stream(rank.stream):
                fn(rank)
        for rank in ranks:
            current.wait_stream(rank.stream)
        torch.cuda.synchronize()
        s = R.reduce_in_rank_order(xs)
        want = s if op == "all_reduce" else R.add_rmsnorm_reference(s, res, w, 1e-6)[0]
        got = outs[0][0] if op != "fused_fp8" else outs[0][2].float() * outs[0][3]
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 0.07 * want.float().abs().max().item(), f"{name} T={T}: wrong result ({err})"
        ops[name] = (fn, None)
    return ops


def host_us(ranks, fn, calls):
    """µs of host time per call: each rank's batch of ``calls`` calls in its stream context, timed alone;
    one number per rank (rank 0's batch queues behind a kernel that waits for rank 1; rank 1's runs
    while the GPU works through the pairs, so the two tell host cost from a full launch queue)."""
    current = torch.cuda.current_stream()
    per_rank = []
    for rank in ranks:
        rank.stream.wait_stream(current)
        with torch.cuda.stream(rank.stream):
            t = time.perf_counter()
            for _ in range(calls):
                fn(rank)
            per_rank.append((time.perf_counter() - t) / calls * 1e6)
    for rank in ranks:
        current.wait_stream(rank.stream)
    torch.cuda.synchronize()
    return per_rank


def graph_us(ranks, fn, calls=50, replays=20):
    """Graph-mode µs per call of ``fn(rank)`` (:func:`tpcomm.bench.loopback.graph_us`)."""
    from tpcomm.bench.loopback import graph_us as timed

    return timed(lambda r: fn(ranks[r]), [rank.stream for rank in ranks], calls, replays)


def main():
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    H = a.hidden
    ranks = loopback_group(2, timeout_s=30.0)
    y = torch.zeros(1, H, device="cuda", dtype=torch.bfloat16)
    rows = []
    try:
        for T in (int(t) for t in a.tokens.split(",")):
            g = torch.Generator(device="cuda").manual_seed(T)
            xs = [torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16) for _ in ranks]
            res = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
            w = torch.randn(H, device="cuda", generator=g).to(torch.bfloat16)
            ops = _ops(T, H, ranks, xs, res, w)
            for name, (fn, ok) in ops.items():  # compile, record, check
                for _ in range(2):
                    got = run_ranks(ranks, fn)
                torch.cuda.synchronize()
                assert all(ok(got[r], r) for r in range(len(ranks))), f"{name} T={T}: wrong result"
            peer = trtllm_ops(T, H, ranks, xs, res, w)
            for direct in (True, False):
                for rank in ranks:
                    for entry in rank._calls._entries.values():  # replays through kernel[grid] when False
                        for replay in entry.replays:
                            if direct and replay.compiled is not None:
                                replay.bind_launcher(replay.compiled.run, replay.compiled.function,
                                                     replay.compiled.packed_metadata)
                            elif not direct:
                                replay.direct = False
                        if hasattr(entry, "rebuild"):  # the repeat's code follows its replays
                            entry.rebuild()
                timed = dict(ops, **(peer if direct else {}))
                samples = {name: [] for name in timed}
                samples["torch add_"] = []
                for _ in range(a.rounds):
                    samples["torch add_"].append(host_us(ranks, lambda rank: y.add_(1), a.calls))
                    for name, (fn, _) in timed.items():
                        samples[name].append(host_us(ranks, fn, a.calls))
                add = statistics.median(v for per_rank in samples["torch add_"] for v in per_rank)
                for name, values in samples.items():
                    per_rank = [statistics.median(v[r] for v in values) for r in range(len(ranks))]
                    us = statistics.median(per_rank)
                    rows.append(dict(tokens=T, op=name, launcher="compiled" if direct else "kernel[grid]",
                                     host_us=round(us, 2), ratio_to_add=round(us / add, 2),
                                     per_rank_us=[round(u, 2) for u in per_rank]))
            for name, (fn, _) in ops.items():
                rows.append(dict(tokens=T, op=name, launcher="graph", graph_us=round(graph_us(ranks, fn), 3)))
        for rank in ranks:
            rank.check()
    finally:
        close_group(ranks)
    print(f"{'tokens':>6s} {'op':16s} {'launcher':13s} {'host us':>8s} {'x add_':>7s} {'graph us':>9s}  per rank")
    for r in rows:
        print(f"{r['tokens']:6d} {r['op']:16s} {r['launcher']:13s} {r.get('host_us', ''):>8} "
              f"{r.get('ratio_to_add', ''):>7} {r.get('graph_us', ''):>9}  {r.get('per_rank_us', '')}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(hidden=H, calls=a.calls, rounds=a.rounds, torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
