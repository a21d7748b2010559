"""The full-width QK norm on ONE GPU, ranks as loopback communicators (``tpcomm.loopback``), in CUDA graphs:
``fused_qk_rmsnorm`` (one launch) beside the unfused path (tpcomm's ``all_reduce`` of the ``(T, 2)`` float32
partial sums between the two halves of the norms in torch) and beside that ``all_reduce`` alone.

Each case is checked first: the fused outputs equal ``fused_qk_rmsnorm_reference`` bit for bit on every
rank (NaN-free inputs), and the unfused path's are within one bf16 ulp of them. Timing as ``tpcomm bench
--loopback`` (``tpcomm.bench.loopback.graph_us``: each rank issues ``calls`` calls on its stream inside one
graph; µs per call is the median over ``replays`` replays). Widths are MiniMax-M2's per rank: 48 query
heads and 8 key-value heads of 128, ``6144 / W`` and ``1024 / W`` columns. Prints a GitHub table with the
speed-up over each alternative and writes the rows as JSON (``--out``).

    PYTHONPATH=. python benchmarks/qk_norm_loopback.py [--worlds 2,4] [--tokens 1,16,64,256] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Config:
    worlds: tuple = (2, 4)
    tokens: tuple = (1, 16, 64, 256)
    q_width: int = 6144  # the full widths, divided by the world size
    k_width: int = 1024
    dtype: str = "bfloat16"
    eps: float = 1e-6
    calls: int = 50
    replays: int = 20


def unfused(rank, q, k, wq, wk, eps: float):
    """The unfused path on one rank: float32 partial sums in torch, tpcomm's all-reduce of them, the two
    norms in torch (float32, then the input dtype)."""
    W = rank.world_size
    sums = torch.stack([q.float().square().sum(-1), k.float().square().sum(-1)], dim=1)
    total = rank.all_reduce(sums)
    qo = (q.float() * torch.rsqrt(total[:, :1] / (W * q.shape[1]) + eps) * wq.float()).to(q.dtype)
    ko = (k.float() * torch.rsqrt(total[:, 1:] / (W * k.shape[1]) + eps) * wk.float()).to(k.dtype)
    return qo, ko


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ka = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    kb = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ka - kb).abs().max())


def measure(cfg: Config, W: int) -> list[dict]:
    from tpcomm.bench.loopback import graph_us
    from tpcomm.loopback import close_group, loopback_group, run_ranks
    from tpcomm.reference import fused_qk_rmsnorm_reference

    dtype = getattr(torch, cfg.dtype)
    Hq, Hk = cfg.q_width // W, cfg.k_width // W
    ranks = loopback_group(W, timeout_s=20.0)
    streams = [rk.stream for rk in ranks]
    rows = []
    try:
        for T in cfg.tokens:
            g = torch.Generator(device="cuda").manual_seed(T * 31 + W)
            qkv = [torch.randn(T, Hq + 2 * Hk, device="cuda", generator=g).to(dtype) for _ in ranks]
            qs, ks = [x[:, :Hq] for x in qkv], [x[:, Hq:Hq + Hk] for x in qkv]  # packed QKV views
            wq = [(1 + 0.5 * torch.randn(Hq, device="cuda", generator=g)).to(dtype) for _ in ranks]
            wk = [(1 + 0.5 * torch.randn(Hk, device="cuda", generator=g)).to(dtype) for _ in ranks]
            sums = [torch.rand(T, 2, device="cuda", generator=g) for _ in ranks]

            def fused(r):
                return ranks[r].fused_qk_rmsnorm(qs[r], ks[r], wq[r], wk[r], cfg.eps)

            def plain(r):
                return unfused(ranks[r], qs[r], ks[r], wq[r], wk[r], cfg.eps)

            def all_reduce(r):
                return ranks[r].all_reduce(sums[r])

            got = run_ranks(ranks, lambda rk: fused(rk.rank))
            other = run_ranks(ranks, lambda rk: plain(rk.rank))
            torch.cuda.synchronize()
            want = fused_qk_rmsnorm_reference(qs, ks, wq, wk, cfg.eps)
            for r in range(W):
                for name, a, b in (("q_out", got[r][0], want[r][0]), ("k_out", got[r][1], want[r][1])):
                    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
                        f"w{W} T={T} rank {r} {name}: the fused call differs from the reference"
                ulps = max(_ulps(got[r][0], other[r][0]), _ulps(got[r][1], other[r][1]))
                assert ulps <= 1, f"w{W} T={T} rank {r}: the unfused path is {ulps} ulps from the fused call"
            t_fused = graph_us(fused, streams, cfg.calls, cfg.replays)
            t_unfused = graph_us(plain, streams, cfg.calls, cfg.replays)
            t_ar = graph_us(all_reduce, streams, cfg.calls, cfg.replays)
            rows.append(dict(world=W, tokens=T, q_width=Hq, k_width=Hk, dtype=cfg.dtype, fused_us=t_fused,
                             unfused_us=t_unfused, all_reduce_us=t_ar, speedup_vs_unfused=t_unfused / t_fused,
                             vs_all_reduce=t_fused / t_ar, checked=True))
            print(f"w{W} T={T}: fused {t_fused:.2f} µs, unfused {t_unfused:.2f} µs, all_reduce (T, 2) f32 "
                  f"{t_ar:.2f} µs", flush=True)
        for rk in ranks:
            rk.check()
    finally:
        torch.cuda.synchronize()
        close_group(ranks)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| W | T | q cols | k cols | fused µs | unfused µs | all_reduce (T,2) f32 µs | unfused / fused "
            "| fused / all_reduce |\n|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r['world']} | {r['tokens']} | {r['q_width']} | {r['k_width']} | {r['fused_us']:.2f} | "
        f"{r['unfused_us']:.2f} | {r['all_reduce_us']:.2f} | {r['speedup_vs_unfused']:.2f}x | "
        f"{r['vs_all_reduce']:.2f}x |" for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--tokens", default="1,16,64,256")
    p.add_argument("--calls", type=int, default=Config.calls)
    p.add_argument("--replays", type=int, default=Config.replays)
    p.add_argument("--out", default=None, help="write the configuration and rows here as JSON")
    a = p.parse_args()
    cfg = Config(worlds=tuple(int(w) for w in a.worlds.split(",")), tokens=tuple(int(t) for t in a.tokens.split(",")),
                 calls=a.calls, replays=a.replays)
    rows = [row for W in cfg.worlds for row in measure(cfg, W)]
    print(table(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(config=asdict(cfg), device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
