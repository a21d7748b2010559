"""Development timing of decode-sized calls on 2 GPUs, per kernel variant (``dev_single.VARIANTS``,
combined with ``+``): fused bf16 (Lamport and one-shot), Lamport all-reduce and fused FP8, hidden 6144,
in CUDA graphs (``dev_fused.graph_time``: 50 calls per graph, replays lined up as the bench does,
median of 30, slowest rank). Each
variant runs in fresh rank processes so its patches apply before anything compiles; every output is
checked bit for bit against ``tpcomm.reference`` first. Not a published number (those come from
``tpcomm bench``): it picks which kernel change to keep.

    PYTHONPATH=. python dev/dev_decode.py --variants base,warps8 [--out DIR]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from dev_fused import graph_time, run_variants  # noqa: E402
from dev_single import VARIANTS  # noqa: E402

H = 6144


def body(rank, world, variant):
    for name in variant.split("+"):
        if name != "base":
            VARIANTS[name]()
    import tpcomm
    from tpcomm import reference as R

    comm = tpcomm.Communicator()
    rows, ok = [], True
    nccl_x = torch.randn(16, H, device="cuda", dtype=torch.bfloat16)
    rows.append(dict(case="nccl_all_reduce", T=16, us=graph_time(lambda: dist.all_reduce(nccl_x))))
    for T in (1, 16, 64):
        g = torch.Generator(device="cuda").manual_seed(T)
        xs = [torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16) for _ in range(world)]
        r = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(H, device="cuda", generator=g).to(torch.bfloat16)
        x = xs[rank]
        s = R.reduce_in_rank_order(xs)
        o_ref, ro_ref = R.add_rmsnorm_reference(s, r, w, 1e-6)
        q_ref, sc_ref = R.per_token_quant_reference(o_ref)
        for algo in ("lamport", "one_shot"):
            with comm.use_algorithm(algo):
                o, ro = comm.fused_add_rmsnorm(x, r, w, 1e-6)
                y = comm.all_reduce(x)
                q, sc, _, _ = comm.fused_add_rmsnorm(x, r, w, 1e-6, quant="fp8_per_token")
                good = (torch.equal(o, o_ref) and torch.equal(ro, ro_ref) and torch.equal(y, s)
                        and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sc, sc_ref))
                ok &= good
                row = dict(case="decode", algo=algo, T=T, exact=good,
                           fused_us=graph_time(lambda: comm.fused_add_rmsnorm(x, r, w, 1e-6)),
                           all_reduce_us=graph_time(lambda: comm.all_reduce(x)))
                if T == 16:
                    row["fp8_us"] = graph_time(lambda: comm.fused_add_rmsnorm(x, r, w, 1e-6, quant="fp8_per_token"))
                rows.append(row)
    comm.check()
    comm.close()
    return ok, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="base")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = [name for v in variants for name in v.split("+") if name != "base" and name not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from base, {', '.join(VARIANTS)} (joined with +)")
    run_variants(body, variants, args.out, "dev_decode.json")


if __name__ == "__main__":
    main()
