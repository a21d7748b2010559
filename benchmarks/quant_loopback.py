"""The quantised fused forms on ONE GPU, ranks as loopback communicators, in CUDA graphs: each form
beside the fused bf16 call and beside the fused bf16 call followed by the standalone quant op of the
same form (``tpcomm.quant``), all in the same run.

Each form is checked first: its bytes and scales equal the standalone op applied to the plain fused
call's ``out`` on every rank. Timing as ``tpcomm bench --loopback`` (``tpcomm.bench.loopback.graph_us``:
each rank issues ``--calls`` calls on its stream inside one graph, µs per call is the median over
``--replays`` replays; the composite: :func:`composite_us`). Rows are printed, and appended to ``--out`` as JSON
lines, as they are measured.

    PYTHONPATH=. python benchmarks/quant_loopback.py [--hidden 6144,7168] [--tokens 1,16,64,256,1024,4096]
                                                     [--out F]

A first loopback call of several launches (4096 x 6144 is one) loads every launch's kernel before the
first launch; before that it timed out in loopback (docs/reliability.md, "A call of several launches").
"""
import argparse
import json

import torch

from tpcomm import quant as Q

#: Each form's fused keyword arguments (the scale tensors are made on the GPU) and its standalone op.
FORMS = {
    "fp8_per_token": ({}, lambda o, s: Q.per_token_quant_fp8(o)),
    "fp8_per_group": ({"group_size": 128}, lambda o, s: Q.per_group_quant_fp8(o, 128)),
    "fp8_per_group_ue8m0": ({"group_size": 128}, lambda o, s: Q.per_group_quant_fp8(o, 128, ue8m0=True)),
    "fp8_static": ({"scale": "static"}, lambda o, s: (Q.static_quant_fp8(o, s), s)),
    "mxfp4": ({}, lambda o, s: Q.mxfp4_quant(o)),
    "nvfp4": ({"scale": "global"}, lambda o, s: Q.nvfp4_quant(o, s)),
}


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def composite_us(ranks, plain, standalone, s, calls: int, replays: int) -> float:
    """µs per call of the fused bf16 call on every rank, then the standalone op on each rank's ``out``
    (each on its rank's stream), timed as ``graph_us`` (``tpcomm.bench.loopback.replayed_us``). The
    standalone ops come after every rank's fused call (they read their scale on the host when not
    capturing, which would hold a rank's stream while its fused kernel waits for the peers)."""
    from tpcomm.bench.loopback import replayed_us
    from tpcomm.loopback import run_ranks

    def issue_calls(n):
        for _ in range(n):
            outs = run_ranks(ranks, lambda rk: plain(rk.rank)[0])
            run_ranks(ranks, lambda rk: standalone(outs[rk.rank], s))

    return replayed_us(issue_calls, calls, replays)


def main():
    from tpcomm.bench.loopback import graph_us
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    p = argparse.ArgumentParser()
    p.add_argument("--hidden", default="6144,7168")
    p.add_argument("--tokens", default="1,16,64,256,1024,4096")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    ranks = loopback_group(2, timeout_s=20.0)
    scales = {"static": torch.tensor([0.02], device="cuda"), "global": torch.tensor([500.0], device="cuda")}
    streams = [rk.stream for rk in ranks]
    print(f"{'H':>5} {'T':>5} {'form':20s} {'form us':>8} {'bf16 us':>8} {'bf16+op us':>10} {'/bf16':>6} "
          f"{'/(bf16+op)':>10}")
    try:
        for H in (int(h) for h in a.hidden.split(",")):
            for T in (int(t) for t in a.tokens.split(",")):
                g = torch.Generator(device="cuda").manual_seed(T * 31 + H)
                xs = [torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16) for _ in ranks]
                res = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
                w = (1 + 0.5 * torch.randn(H, device="cuda", generator=g)).to(torch.bfloat16)

                def plain(r):
                    return ranks[r].fused_add_rmsnorm(xs[r], res, w, 1e-6)
                want = run_ranks(ranks, lambda rk: plain(rk.rank))
                bf16 = graph_us(plain, streams, a.calls, a.replays)
                for form, (kw, standalone) in FORMS.items():
                    s = scales.get(kw.get("scale"))
                    kwargs = dict(kw, scale=s) if s is not None else kw

                    def fused(r, form=form, kwargs=kwargs):
                        return ranks[r].fused_add_rmsnorm(xs[r], res, w, 1e-6, quant=form, **kwargs)

                    got = run_ranks(ranks, lambda rk: fused(rk.rank))
                    torch.cuda.synchronize()
                    for r in range(len(ranks)):
                        sq, ss = standalone(want[r][0], s)
                        assert torch.equal(_bytes(got[r][0]), _bytes(sq)) and torch.equal(_bytes(got[r][1]),
                                                                                          _bytes(ss)), \
                            f"{form} {T}x{H}, rank {r}: differs from the standalone op on out"
                    us = graph_us(fused, streams, a.calls, a.replays)
                    composite = composite_us(ranks, plain, standalone, s, a.calls, a.replays)
                    row = dict(hidden=H, tokens=T, form=form, us=round(us, 3), bf16_us=round(bf16, 3),
                               bf16_and_op_us=round(composite, 3), to_bf16=round(us / bf16, 3),
                               to_bf16_and_op=round(us / composite, 3))
                    print(f"{H:5d} {T:5d} {form:20s} {us:8.2f} {bf16:8.2f} {composite:10.2f} {us / bf16:6.2f} "
                          f"{us / composite:10.2f}", flush=True)
                    if a.out:
                        with open(a.out, "a") as f:
                            f.write(json.dumps(row) + "\n")
        for rk in ranks:
            rk.check()
    finally:
        close_group(ranks)


if __name__ == "__main__":
    main()
