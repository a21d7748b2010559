"""Decode-sized calls on ONE GPU, ranks as loopback communicators (``tpcomm.loopback``): CUDA-graph
timings per kernel variant (``dev_single.VARIANTS``, joined with ``+``; ``no_pdl`` sets
``TPCOMM_PDL=0``), every output first checked bit for bit against ``tpcomm.reference``.

The peers' data never crosses NVLink here, so these numbers are the kernels' own costs (launch, sync,
epilogue), not what 2 GPUs take; use them to compare kernel variants on a one-GPU machine, and
``dev_decode.py`` / ``tpcomm bench`` on several GPUs for real numbers. Each variant runs in a fresh
process (its patches apply before anything compiles).

    PYTHONPATH=. python dev/dev_loopback.py --variants base,no_pdl,warps8 [--world 2] [--out DIR]
"""
import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

H = 6144


def graph_us(ranks, fn, calls, replays):
    """µs per call: every rank issues ``calls`` calls of ``fn(rank)`` on its own stream, captured in one
    graph (:func:`tpcomm.bench.loopback.graph_us`); median over ``replays`` replays."""
    from tpcomm.bench.loopback import graph_us as timed

    return timed(lambda r: fn(ranks[r]), [rank.stream for rank in ranks], calls, replays)


def _same(a, b):
    """Bit-for-bit equality (``torch.equal`` would take -0.0 for +0.0)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def run_one(variant, world, calls, replays, max_programs):
    from dev_single import VARIANTS

    for name in variant.split("+"):
        if name == "no_pdl":
            os.environ["TPCOMM_PDL"] = "0"
        elif name != "base":
            VARIANTS[name]()
    from tpcomm import reference as R
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    ranks = loopback_group(world, timeout_s=20.0, max_programs=max_programs)
    ok = True
    try:
        for T in (1, 16, 64):
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
                exact = all(_same(f[0], o_ref) and _same(f[1], ro_ref) and _same(q[0], q_ref)
                            and _same(q[1], sc_ref) and _same(y, s) for f, q, y in got)
                ok &= exact
                row = dict(variant=variant, world=world, pdl=ranks[0].workspace.pdl,
                           max_programs=ranks[0].workspace.max_programs,
                           algo=algo, T=T,
                           exact=exact, fused_us=round(graph_us(ranks, fused, calls, replays), 2),
                           fp8_us=round(graph_us(ranks, fp8, calls, replays), 2),
                           all_reduce_us=round(graph_us(ranks, ar, calls, replays), 2))
                print(json.dumps(row), flush=True)
        for rank in ranks:
            rank.check()
    finally:
        close_group(ranks)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="base,no_pdl")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--max-programs", type=int, default=None,
                    help="grid cap of every variant (default: loopback_group's, SMs / (2 x world) with PDL; "
                         "give one to compare variants that differ in PDL on the same grid)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a single variant, in this process
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if args.one:
        raise SystemExit(0 if run_one(args.one, args.world, args.calls, args.replays, args.max_programs) else 1)
    from dev_single import VARIANTS

    variants = args.variants.split(",")
    unknown = [n for v in variants for n in v.split("+") if n not in ("base", "no_pdl", *VARIANTS)]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from base, no_pdl, {', '.join(VARIANTS)}")
    rows, ok = [], True
    for v in variants:
        proc = subprocess.run([sys.executable, __file__, "--one", v, "--world", str(args.world),
                               "--calls", str(args.calls), "--replays", str(args.replays),
                               *(["--max-programs", str(args.max_programs)] if args.max_programs else [])],
                              capture_output=True, text=True, timeout=600)
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        rows += lines
        for line in lines:
            print(json.dumps(line), flush=True)
        if proc.returncode:
            ok = False
            print(json.dumps({"variant": v, "failed": (proc.stderr.strip().splitlines() or ["?"])[-1]}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dev_loopback.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("ALL EXACT" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
