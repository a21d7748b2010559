"""Decode-sized calls on ONE GPU, ranks as loopback communicators (``tpcomm.loopback``): CUDA-graph
timings per setting, every output first checked bit for bit against ``tpcomm.reference``.

The peers' data never crosses NVLink here, so these numbers are the kernels' own costs (launch, sync,
epilogue), not what 2 GPUs take; use them to compare kernel settings on a one-GPU machine, and
``dev_decode.py`` / ``tpcomm bench`` on several GPUs for real numbers.

    PYTHONPATH=. python benchmarks/dev_loopback.py [--world 2] [--calls 50] [--replays 30] [--out DIR]
"""
import argparse
import json
import os

import torch

from tpcomm import reference as R
from tpcomm.loopback import close_group, loopback_group, run_ranks

H = 6144


def graph_us(ranks, fn, calls, replays):
    """µs per call: ``calls`` calls of ``fn(rank)`` on every rank captured in one graph, median replay."""
    for _ in range(2):
        run_ranks(ranks, fn)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            run_ranks(ranks, fn)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def run(world, pdl, calls, replays):
    ranks = loopback_group(world, pdl=pdl, timeout_s=20.0)
    rows, ok = [], True
    try:
        for T in (1, 16, 64, 256):
            g = torch.Generator(device="cuda").manual_seed(T)
            xs = [torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16) for _ in ranks]
            res = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
            w = torch.randn(H, device="cuda", generator=g).to(torch.bfloat16)
            s = R.reduce_in_rank_order(xs)
            o_ref, ro_ref = R.add_rmsnorm_reference(s, res, w, 1e-6)
            q_ref, sc_ref = R.per_token_quant_reference(o_ref)
            for algo in ("lamport", "one_shot"):
                def fused(rank):
                    with rank.use_algorithm(algo):
                        return rank.fused_add_rmsnorm(xs[rank.rank], res, w, 1e-6)

                def fp8(rank):
                    with rank.use_algorithm(algo):
                        return rank.fused_add_rmsnorm(xs[rank.rank], res, w, 1e-6, quant="fp8_per_token")

                def ar(rank):
                    with rank.use_algorithm(algo):
                        return rank.all_reduce(xs[rank.rank])

                got = list(zip(run_ranks(ranks, fused), run_ranks(ranks, fp8), run_ranks(ranks, ar)))
                torch.cuda.synchronize()
                exact = all(torch.equal(f[0], o_ref) and torch.equal(f[1], ro_ref)
                            and torch.equal(q[0].view(torch.uint8), q_ref.view(torch.uint8))
                            and torch.equal(q[1], sc_ref) and torch.equal(y, s) for f, q, y in got)
                ok &= exact
                rows.append(dict(world=world, pdl=pdl, algo=algo, T=T, exact=exact,
                                 fused_us=round(graph_us(ranks, fused, calls, replays), 2),
                                 fp8_us=round(graph_us(ranks, fp8, calls, replays), 2),
                                 all_reduce_us=round(graph_us(ranks, ar, calls, replays), 2)))
                print(json.dumps(rows[-1]), flush=True)
        for rank in ranks:
            rank.check()
    finally:
        close_group(ranks)
    return ok, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    all_rows, ok = [], True
    for pdl in (False, True):
        good, rows = run(args.world, pdl, args.calls, args.replays)
        ok &= good
        all_rows += rows
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dev_loopback.json"), "w") as f:
        json.dump(all_rows, f, indent=1)
    print("ALL EXACT" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
