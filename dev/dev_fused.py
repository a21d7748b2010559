"""Development check on 2 GPUs: correctness of the fused kernel at the model shapes, then graph timings
of tpcomm fused against NCCL all-reduce + torch add + RMSNorm (hidden 6144 bf16). The published numbers
come from `tpcomm bench`; this script is for quick iterations on the kernels.

    PYTHONPATH=. python dev/dev_fused.py [--out DIR]
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def graph_time(fn, calls=50, replays=30):
    """µs per call of ``fn`` captured ``calls`` times in one graph: median over replays of the slowest
    rank. Before each replay a one-element NCCL all-reduce lines the GPUs up and a GPU sleep lets every
    host enqueue the replay before any starts (as ``tpcomm.bench.timing``), so no rank waits for a late
    host inside the timed region."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    line_up = torch.zeros(1, device="cuda")
    for _ in range(replays + 2):
        torch.cuda.synchronize()
        dist.all_reduce(line_up)
        torch.cuda._sleep(200_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    t = torch.tensor(times[2:], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.median())


def run_variants(body, variants, out_dir, json_name, key="variant", before=None, timeout_s=600):
    """Run ``body(rank, world, variant)`` on 2 GPU ranks per variant (fresh processes each, so a variant's
    patches apply before anything compiles; ``before(variant)`` runs first in this process, e.g. to set
    environment variables the ranks inherit). ``body`` returns ``(exact, rows)``. Prints every row as a
    JSON line, writes ``{variant: rows}`` to ``out_dir/json_name`` and exits 0 only when every variant
    ran and every output was exact."""
    from tpcomm.launch import RankFailure, launch

    results, ok = {}, True
    for i, variant in enumerate(variants):
        if before is not None:
            before(variant)
        try:
            res = launch(body, 2, "cuda", args=(variant,), timeout_s=timeout_s)
        except RankFailure as e:  # a variant that breaks the protocol: report it, time the others
            ok = False
            print(json.dumps({key: variant, "failed": str(e).splitlines()[-1]}), flush=True)
            continue
        ok &= all(r[0] for r in res)
        results[variant if variant not in results else f"{variant}#{i}"] = res[0][1]
        for row in res[0][1]:
            print(json.dumps({key: variant, **row}), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, json_name), "w") as f:
        json.dump(results, f, indent=1)
    print("ALL EXACT" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


def body(rank, world, outdir):
    import tpcomm
    from tpcomm.reference import add_rmsnorm_reference, reduce_in_rank_order

    os.environ["TPCOMM_ALGO"] = "one_shot"
    comm_o = tpcomm.Communicator()
    os.environ["TPCOMM_ALGO"] = "lamport"
    comm_l = tpcomm.Communicator()
    os.environ["TPCOMM_ALGO"] = "auto"
    comm = tpcomm.Communicator()
    log = []
    ok = True
    # correctness
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for H in (2880, 4096, 6144, 7168, 8192, 16384, 7):
            for T in (1, 16, 64, 256, 1024, 4096):
                if (H == 16384 or dtype != torch.bfloat16) and T > 256:
                    continue
                g = torch.Generator(device="cuda").manual_seed(H * 7 + T)
                xs = [torch.randn(T, H, device="cuda", generator=g).to(dtype) for _ in range(world)]
                r = torch.randn(T, H, device="cuda", generator=g).to(dtype)
                w = torch.randn(H, device="cuda", generator=g).to(dtype)
                y = comm.all_reduce(xs[rank])
                out, ro = comm.fused_add_rmsnorm(xs[rank], r, w, 1e-6)
                s = reduce_in_rank_order(xs)
                eo, ero = add_rmsnorm_reference(s, r, w, 1e-6)
                e1 = torch.equal(y, s)
                e2 = torch.equal(ro, ero)
                eps_rel = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10 if dtype == torch.float16 else 2 ** -23
                ulp = ((out.float() - eo.float()).abs() / (eo.float().abs() * eps_rel).clamp_min(1e-30)).max().item()
                good = e1 and e2
                for c in (comm_o, comm_l):
                    y2 = c.all_reduce(xs[rank])
                    o2, r2 = c.fused_add_rmsnorm(xs[rank], r, w, 1e-6)
                    same = torch.equal(y2, y) and torch.equal(o2, out) and torch.equal(r2, ro)
                    if not same:
                        log.append(f"rank{rank} {dtype} H={H} T={T} algo={c.env.algo} differs from auto")
                    good &= same
                ok &= good
                if not good or rank == 0 and T in (1, 4096) and H == 6144:
                    log.append(f"rank{rank} {dtype} H={H} T={T} ar_exact={e1} res_exact={e2} out_rel_ulp={ulp:.2f}")
    torch.cuda.synchronize()
    comm.check()
    # timing
    H = 6144
    rows = []
    for T in (1, 16, 64, 128, 256, 512, 1024, 4096):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
        xx = x.clone()

        def nccl_fused():
            dist.all_reduce(xx)
            v = (xx.float() + r.float())
            torch.nn.functional.rms_norm(v, (H,), w.float(), 1e-6).to(torch.bfloat16)

        def nccl_only():
            dist.all_reduce(xx)

        def ours():
            comm.fused_add_rmsnorm(x, r, w, 1e-6)

        def ours_ar():
            comm.all_reduce(x, out=xx)

        row = dict(T=T, nccl=graph_time(nccl_only), nccl_fused=graph_time(nccl_fused), tpcomm=graph_time(ours),
                   tpcomm_ar=graph_time(ours_ar),
                   lamport=graph_time(lambda: comm_l.fused_add_rmsnorm(x, r, w, 1e-6)),
                   one_shot=graph_time(lambda: comm_o.fused_add_rmsnorm(x, r, w, 1e-6)),
                   lamport_ar=graph_time(lambda: comm_l.all_reduce(x, out=xx)),
                   one_shot_ar=graph_time(lambda: comm_o.all_reduce(x, out=xx)))
        rows.append(row)
    torch.cuda.synchronize()
    # grid cap sweep for one-shot at large sizes
    for mp_ in (264, 528):
        os.environ["TPCOMM_ALGO"] = "one_shot"
        os.environ["TPCOMM_MAX_PROGRAMS"] = str(mp_)
        c2 = tpcomm.Communicator()
        for T in (1024, 4096):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
            xx = x.clone()
            fused_us = graph_time(lambda: c2.fused_add_rmsnorm(x, r, w, 1e-6))
            log.append(f"max_programs={mp_} T={T} one_shot fused {fused_us:.1f} us"
                       f" AR {graph_time(lambda: c2.all_reduce(x, out=xx)):.1f} us")
        torch.cuda.synchronize()
        c2.close()
    os.environ.pop("TPCOMM_MAX_PROGRAMS")
    for c in (comm, comm_o, comm_l):
        c.check()
        c.close()
    return ok, log, rows


if __name__ == "__main__":
    from tpcomm.launch import launch

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    a = p.parse_args()
    res = launch(body, 2, "cuda", args=(a.out,))
    ok = all(r[0] for r in res)
    for r in res:
        print("\n".join(r[1]))
    keys = ["nccl", "nccl_fused", "tpcomm", "lamport", "one_shot", "tpcomm_ar", "lamport_ar", "one_shot_ar"]
    print(f"{'T':>6} " + " ".join(f"{k:>11}" for k in keys) + "  speedup")
    for row in res[0][2]:
        print(f"{row['T']:>6} " + " ".join(f"{row[k]:11.1f}" for k in keys) +
              f"  {row['nccl_fused']/row['tpcomm']:6.2f}")
    json.dump(res[0][2], open(os.path.join(a.out, "dev_fused.json"), "w"), indent=1)
    print("CORRECT" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)
