"""One MiniMax-M2 decoder layer at its real shapes on ONE GPU, ranks as loopback communicators
(``tpcomm.loopback``), decode in CUDA graphs: the layer with its three collectives as tpcomm's fused calls
against the same layer with unfused collectives, and against the layer's local work alone.

The layer (hidden 3072; 48 query heads and 8 key-value heads of 128; 256 experts, top 8), per rank of a
group of ``W``, for ``T`` decode tokens:

1. ``qkv = h @ W_qkv`` (this rank's ``6144 / W`` query and ``1024 R / W`` key-value columns, ``R =
   max(1, W / kv_heads)`` ranks holding each key-value head); the full-width ``q_norm`` / ``k_norm``;
2. attention of the ``T`` queries over a fixed KV cache of ``cache`` positions and the new keys
   (``scaled_dot_product_attention``, GQA), ``o_proj``: a partial sum; the all-reduce, residual add and
   ``post_attention_layernorm``;
3. the router (sigmoid scores plus a bias choose 8 of 256 experts; the chosen scores renormalised) and the
   experts' outputs: a fixed ``(T, 8, 3072)`` tensor per rank in place of the experts' compute (a
   decode-grade grouped GEMM is outside tpcomm, and a per-expert torch loop reads the routing back to
   the host, which a graph cannot hold); the weighted sum over the experts, the all-reduce, the residual
   add and the next layer's ``input_layernorm``.

Variants: ``fused``: ``fused_qk_rmsnorm(kv_replicas=R)``, ``fused_add_rmsnorm``,
``fused_moe_finalize_add_rmsnorm``; ``unfused``: the same steps as tpcomm's ``all_reduce`` (of the
``(T, 2)`` float32 sums of squares; of the partial sums; of the experts' weighted sum) with the norms,
the residual adds and the weighted sum (slot by slot in float32, ``moe_finalize_reference``) in torch;
``local``: the layer with the collectives left out (each step returns its input), the work the
collectives add to. Rotary embeddings are left out (local, element-wise, the same in every variant).

Checked before timing, on every rank, each collective on the same inputs: the fused calls' outputs equal
the plain-torch oracles (``tpcomm.reference``: ``fused_qk_rmsnorm_reference``, ``add_rmsnorm_reference`` of
``reduce_in_rank_order``, ``moe_finalize_reference``) bit for bit, and the unfused ones are within 2 bf16
ulps of them. Timing as the other loopback benches (``tpcomm.bench.loopback.graph_us``: each rank issues
``calls`` layers on its own stream inside one graph; µs per layer is the median over ``replays`` replays).
Each world size runs in a child process with a time limit. The peers' data never crosses NVLink.

    PYTHONPATH=. python benchmarks/minimax_layer_loopback.py [--worlds 2,4,8] [--tokens 1,4,16,64]
        [--kv-heads 8] [--out results/minimax_layer.json]
    PYTHONPATH=. python benchmarks/minimax_layer_loopback.py --dry-run [--out F.json]

``--dry-run`` runs the same layer, variants and checks on CPU ranks (the Triton interpreter,
``tpcomm.launch``) at small shapes (hidden 256, 8 query and 2 key-value heads of 32, 16 experts; 2 and 4
ranks, the 4 with each key-value head on 2 ranks) and writes the JSON without timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, replace

import torch

#: Seconds a world size's child may take (it compiles tpcomm's kernels for its world size first).
CHILD_TIMEOUT_S = 95.0
#: How far the unfused collectives may be from the fused ones (bf16 ulps): the norms in torch round their
#: float32 steps in another order than the contract's.
UNFUSED_ULPS = 2
VARIANTS = ("fused", "unfused", "local")


@dataclass(frozen=True)
class Config:
    worlds: tuple = (2, 4, 8)
    tokens: tuple = (1, 4, 16, 64)
    hidden: int = 3072
    heads: int = 48
    kv_heads: int = 8
    head_dim: int = 128
    experts: int = 256
    topk: int = 8
    cache: int = 1024
    eps: float = 1e-6
    calls: int = 10
    replays: int = 10
    out: str | None = None
    device: str = "cuda"


#: ``--dry-run``: MiniMax-M2's proportions at the interpreter's scale.
DRY_RUN = dict(worlds=(2, 4), tokens=(1, 3), hidden=256, heads=8, kv_heads=2, head_dim=32, experts=16, topk=4,
               cache=16, device="cpu")


class RankLayer:
    """Rank ``r``'s shard of the layer (seeded: every rank draws every rank's weights alike) and its fixed
    inputs for ``T`` tokens: the normalised input ``h`` and the residual (the same on every rank), this
    rank's experts' outputs."""

    def __init__(self, cfg: Config, W: int, r: int, T: int, device):
        self.cfg, self.W, self.r, self.T = cfg, W, r, T
        self.replicas = max(1, W // cfg.kv_heads)
        self.hq = cfg.heads // W * cfg.head_dim
        self.hk = cfg.kv_heads * self.replicas // W * cfg.head_dim
        g = torch.Generator().manual_seed(1000 * W + T)
        shared = dict(h=(T, cfg.hidden), residual=(T, cfg.hidden), router=(cfg.hidden, cfg.experts),
                      bias=(cfg.experts,), post=(cfg.hidden,), next=(cfg.hidden,))
        t = {n: torch.randn(s, generator=g) for n, s in shared.items()}
        g = torch.Generator().manual_seed(7 + 100 * r + 10000 * W + T)  # this rank's shard
        kv = torch.Generator().manual_seed(8 + 100 * (r // self.replicas) + 10000 * W + T)  # its key-value head(s)
        H = cfg.hidden

        def dev(x, scale=1.0):
            return (x * scale).to(device=device, dtype=torch.bfloat16)
        self.h, self.residual = dev(t["h"]), dev(t["residual"])
        self.router, self.bias = dev(t["router"], H ** -0.5), t["bias"].to(device) * 0.1
        self.w_post, self.w_next = dev(1 + 0.2 * t["post"]), dev(1 + 0.2 * t["next"])
        w_k, w_v = torch.randn(H, self.hk, generator=kv), torch.randn(H, self.hk, generator=kv)
        self.w_qkv = dev(torch.cat([torch.randn(H, self.hq, generator=g), w_k, w_v], 1), H ** -0.5)
        self.w_q = dev(1 + 0.2 * torch.randn(self.hq, generator=g))
        self.w_k = dev(1 + 0.2 * torch.randn(self.hk, generator=kv))
        kv_local = self.hk // cfg.head_dim
        self.k_cache = dev(torch.randn(1, kv_local, cfg.cache, cfg.head_dim, generator=kv))
        self.v_cache = dev(torch.randn(1, kv_local, cfg.cache, cfg.head_dim, generator=kv))
        self.w_o = dev(torch.randn(self.hq, H, generator=g), (cfg.heads * cfg.head_dim) ** -0.5)
        self.expert_out = dev(torch.randn(T, cfg.topk, H, generator=g))
        self.state: dict = {}

    # -- the layer's three stages, each ending at one collective (``variant``) ---------------------------
    def stages(self, comm, variant: str) -> list:
        """Three callables, run in order: each does its local work and then one collective of ``variant``
        on ``comm`` (this rank's communicator), keeping what it made in :attr:`state`."""
        c, s = self.cfg, self.state
        ops = {"fused": Fused, "unfused": Unfused, "local": Local}[variant](comm, c.eps, self)

        def qkv():
            s["qkv"] = self.h @ self.w_qkv
            s["q"], s["k"] = s["qkv"][:, :self.hq], s["qkv"][:, self.hq:self.hq + self.hk]
            s["q_out"], s["k_out"] = ops.qk(s["q"], s["k"], self.w_q, self.w_k)

        def attention():
            T, D = self.T, c.head_dim
            q = s["q_out"].view(1, T, -1, D).transpose(1, 2)
            k = torch.cat([self.k_cache, s["k_out"].view(1, T, -1, D).transpose(1, 2)], 2)
            v = torch.cat([self.v_cache, s["qkv"][:, self.hq + self.hk:].reshape(1, T, -1, D).transpose(1, 2)], 2)
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            s["partial"] = att.transpose(1, 2).reshape(T, self.hq) @ self.w_o
            s["normed"], s["residual1"] = ops.add_norm(s["partial"], self.residual, self.w_post)

        def moe():
            scores = torch.sigmoid((s["normed"] @ self.router).float())
            index = torch.topk(scores + self.bias, c.topk, dim=-1, sorted=False).indices
            w = scores.gather(1, index)
            s["weights"] = w / w.sum(-1, keepdim=True)
            s["out"], s["residual2"] = ops.finalize(self.expert_out, s["weights"], s["residual1"], self.w_next)
        return [qkv, attention, moe]


class Fused:
    """The collectives as tpcomm's fused calls."""

    def __init__(self, comm, eps: float, layer: RankLayer):
        self.comm, self.eps, self.replicas = comm, eps, layer.replicas

    def qk(self, q, k, wq, wk):
        return self.comm.fused_qk_rmsnorm(q, k, wq, wk, self.eps, kv_replicas=self.replicas)

    def add_norm(self, partial, residual, w):
        return self.comm.fused_add_rmsnorm(partial, residual, w, self.eps)

    def finalize(self, expert_out, weights, residual, w):
        return self.comm.fused_moe_finalize_add_rmsnorm(expert_out, weights, residual, w, self.eps)


def _rms_norm(x32: torch.Tensor, w: torch.Tensor, eps: float, width: int | None = None, total=None):
    """RMSNorm in torch, float32: over ``x32``'s own row, or with the sum of squares ``total`` over
    ``width`` columns; bf16 out."""
    ms = x32.square().mean(-1, keepdim=True) if total is None else total / width
    return (x32 * torch.rsqrt(ms + eps) * w.float()).to(torch.bfloat16)


class Unfused(Fused):
    """The collectives as tpcomm's ``all_reduce`` with the rest in torch."""

    def qk(self, q, k, wq, wk):
        W, R = self.comm.world_size, self.replicas
        sums = torch.stack([q.float().square().sum(-1), k.float().square().sum(-1)], dim=1)
        if self.comm.rank % R:  # a replica of another rank's key-value columns: counted once, there
            sums[:, 1] = 0
        total = self.comm.all_reduce(sums)
        return (_rms_norm(q.float(), wq, self.eps, W * q.shape[1], total[:, :1]),
                _rms_norm(k.float(), wk, self.eps, W // R * k.shape[1], total[:, 1:]))

    def add_norm(self, partial, residual, w):
        residual_out = (self.comm.all_reduce(partial).float() + residual.float()).to(torch.bfloat16)
        return _rms_norm(residual_out.float(), w, self.eps), residual_out

    def finalize(self, expert_out, weights, residual, w):
        from tpcomm import moe_finalize_reference  # the weighted sum over the experts, slot by slot in float32

        return self.add_norm(moe_finalize_reference(expert_out, weights), residual, w)


class Local(Fused):
    """No collectives: each step returns its input (the layer's local work alone)."""

    def qk(self, q, k, wq, wk):
        return q, k

    def add_norm(self, partial, residual, w):
        return partial, residual

    def finalize(self, expert_out, weights, residual, w):
        return residual, residual


# -- checks ------------------------------------------------------------------------------------------------
def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ka = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    kb = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ka - kb).abs().max())


def check(layers: list[RankLayer], fused: list[dict], unfused: list[dict]) -> list[str]:
    """What is wrong with every rank's fused and unfused collectives, each on the fused run's inputs of
    that step (``fused`` / ``unfused``: every rank's :attr:`RankLayer.state` of the two runs, the unfused
    one made from the fused run's inputs): empty when all is right."""
    from tpcomm import moe_finalize_reference
    from tpcomm.reference import add_rmsnorm_reference, fused_qk_rmsnorm_reference, reduce_in_rank_order

    eps, R = layers[0].cfg.eps, layers[0].replicas
    qk = fused_qk_rmsnorm_reference([s["q"] for s in fused], [s["k"] for s in fused], [x.w_q for x in layers],
                                    [x.w_k for x in layers], eps, kv_replicas=R)
    post = add_rmsnorm_reference(reduce_in_rank_order([s["partial"] for s in fused]), layers[0].residual,
                                 layers[0].w_post, eps)
    moe = add_rmsnorm_reference(
        reduce_in_rank_order([moe_finalize_reference(x.expert_out, s["weights"]) for x, s in zip(layers, fused)]),
        fused[0]["residual1"], layers[0].w_next, eps)
    bad = []
    for r, (f, u) in enumerate(zip(fused, unfused)):
        want = {"q_out": qk[r][0], "k_out": qk[r][1], "normed": post[0], "residual1": post[1], "out": moe[0],
                "residual2": moe[1]}
        for name, w in want.items():
            if not torch.equal(f[name].cpu().view(torch.int16), w.cpu().view(torch.int16)):
                bad.append(f"rank {r} fused {name}: not the reference's bits")
            ulps = _ulps(u[name].cpu(), w.cpu())
            if ulps > UNFUSED_ULPS:
                bad.append(f"rank {r} unfused {name}: {ulps} ulps from the reference")
    return bad


def unfused_on_fused_inputs(layer: RankLayer, comm, fused: dict) -> list:
    """The unfused collectives as three calls on the fused run's inputs of each step, writing their outputs
    into a new state: ``(state, [call, call, call])``."""
    ops, st = Unfused(comm, layer.cfg.eps, layer), {}

    def qk():
        st["q_out"], st["k_out"] = ops.qk(fused["q"], fused["k"], layer.w_q, layer.w_k)

    def post():
        st["normed"], st["residual1"] = ops.add_norm(fused["partial"], layer.residual, layer.w_post)

    def moe():
        st["out"], st["residual2"] = ops.finalize(layer.expert_out, fused["weights"], fused["residual1"],
                                                  layer.w_next)
    return st, [qk, post, moe]


# -- GPU: loopback ranks -----------------------------------------------------------------------------------
def gpu_rows(cfg: Config, W: int) -> None:
    """Every token count at world size ``W`` on loopback ranks of this GPU: checked, then timed; each row
    printed as it is done (``tpcomm.bench.loopback._emit``)."""
    from tpcomm.bench.loopback import _emit, graph_us
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    ranks = loopback_group(W, timeout_s=20.0)
    streams = [rk.stream for rk in ranks]
    try:
        for T in cfg.tokens:
            layers = [RankLayer(cfg, W, r, T, "cuda") for r in range(W)]
            fused = [x.stages(rk, "fused") for x, rk in zip(layers, ranks)]
            for i in range(3):  # one collective per run_ranks: each new kernel loaded on every rank first
                run_ranks(ranks, lambda rk, i=i: fused[rk.rank][i]())
            pairs = [unfused_on_fused_inputs(x, rk, x.state) for x, rk in zip(layers, ranks)]
            for i in range(3):
                run_ranks(ranks, lambda rk, i=i: pairs[rk.rank][1][i]())
            torch.cuda.synchronize()
            bad = check(layers, [x.state for x in layers], [p[0] for p in pairs])
            row = dict(world=W, tokens=T, kv_replicas=layers[0].replicas, q_cols=layers[0].hq, k_cols=layers[0].hk,
                       checked=not bad, problems=bad[:6])
            if not bad:
                for variant in VARIANTS:
                    stages = [x.stages(rk, variant) for x, rk in zip(layers, ranks)]
                    for i in range(3):
                        run_ranks(ranks, lambda rk, i=i: stages[rk.rank][i]())

                    def layer(r, stages=stages):
                        for stage in stages[r]:
                            stage()
                    row[f"{variant}_us"] = graph_us(layer, streams, cfg.calls, cfg.replays)
            _emit(row)
            print(f"w{W} T={T}: " + ", ".join(f"{v} {row.get(v + '_us', float('nan')):.1f} µs" for v in VARIANTS),
                  file=sys.stderr, flush=True)
        for rk in ranks:
            rk.check()
    finally:
        torch.cuda.synchronize()
        close_group(ranks)


# -- CPU: --dry-run ----------------------------------------------------------------------------------------
def cpu_rank(rank: int, world_size: int, cfg: Config) -> list[dict]:
    """Every token count on this CPU rank (``tpcomm.launch``): the fused run, the unfused collectives on its
    inputs, the local run, and the checks on every rank's states (an all-gather). Returns the rows."""
    import torch.distributed as dist

    from tpcomm import Communicator

    rows = []
    with Communicator() as comm:
        for T in cfg.tokens:
            layer = RankLayer(cfg, world_size, rank, T, "cpu")
            for stage in layer.stages(comm, "fused"):
                stage()
            mine, calls = unfused_on_fused_inputs(layer, comm, layer.state)
            for call in calls:
                call()
            local = RankLayer(cfg, world_size, rank, T, "cpu")
            for stage in local.stages(comm, "local"):
                stage()
            everyone = [None] * world_size
            dist.all_gather_object(everyone, (layer.state, mine), group=comm.group)
            layers = [RankLayer(cfg, world_size, r, T, "cpu") for r in range(world_size)]
            bad = check(layers, [e[0] for e in everyone], [e[1] for e in everyone])
            rows.append(dict(world=world_size, tokens=T, kv_replicas=layer.replicas, q_cols=layer.hq,
                             k_cols=layer.hk, checked=not bad, problems=bad[:6], kernels=comm.uses_kernels,
                             local_ran="out" in local.state))
    return rows


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    def us(r, v):
        return "-" if r.get(f"{v}_us") is None else f"{r[f'{v}_us']:.1f}"

    def ratio(r, a, b):
        x, y = r.get(f"{a}_us"), r.get(f"{b}_us")
        return "-" if x is None or y is None else f"{y / x:.2f}x"

    def coll(r, v):
        x, y = r.get(f"{v}_us"), r.get("local_us")
        return "-" if x is None or y is None else f"{x - y:.1f}"
    out = [[r["world"], r["tokens"], r["kv_replicas"], "yes" if r["checked"] else "NO", us(r, "fused"),
            us(r, "unfused"), us(r, "local"), ratio(r, "fused", "unfused"), coll(r, "fused"), coll(r, "unfused")]
           for r in rows]
    return tabulate(out, headers=["world", "tokens", "kv_replicas", "checked", "fused µs", "unfused µs", "local µs",
                                  "unfused / fused", "fused − local µs", "unfused − local µs"], tablefmt="github",
                    disable_numparse=True)


def run(cfg: Config) -> int:
    from tpcomm.bench.loopback import _collect, _version

    rows, notes = [], []
    if cfg.device == "cpu":
        from tpcomm.launch import launch

        for W in cfg.worlds:
            rows += launch(cpu_rank, W, "cpu", args=(cfg,), timeout_s=600)[0]
    else:
        if not torch.cuda.is_available():
            print("minimax_layer_loopback: needs a CUDA GPU (or --dry-run on CPU ranks)")
            return 2
        for W in cfg.worlds:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(asdict(cfg)), str(W)]
            got, note = _collect(cmd, CHILD_TIMEOUT_S, f"world {W}")
            rows += got
            notes += [note] if note else []
    print(table(rows))
    for n in notes:
        print("note:", n)
    bad = [r for r in rows if not r["checked"]]
    for r in bad:
        print(f"NOT TIMED w{r['world']} T={r['tokens']}: " + "; ".join(r["problems"]))
    if cfg.out:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
        device = torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu (interpreter; not timed)"
        with open(cfg.out, "w") as f:
            json.dump(dict(config=asdict(cfg), device=device, torch=torch.__version__, triton=_version("triton"),
                           rows=rows, notes=notes), f, indent=1)
        print(f"wrote {cfg.out}")
    expected = len(cfg.worlds) * len(cfg.tokens)
    return 1 if bad or notes or len(rows) != expected else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        fields = json.loads(argv[1])
        cfg = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
        gpu_rows(cfg, int(argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def ints(s):
        return tuple(int(v) for v in s.split(","))

    p.add_argument("--worlds", type=ints, default=None)
    p.add_argument("--tokens", type=ints, default=None)
    p.add_argument("--kv-heads", type=int, default=None, help="key-value heads (default 8; fewer than the ranks: "
                                                              "each replicated, kv_replicas)")
    p.add_argument("--calls", type=int, default=Config.calls)
    p.add_argument("--replays", type=int, default=Config.replays)
    p.add_argument("--dry-run", action="store_true", help="CPU ranks, small shapes, no timings (module docstring)")
    p.add_argument("--out", default=None, help="JSON results path")
    a = p.parse_args(argv)
    cfg = replace(Config(calls=a.calls, replays=a.replays, out=a.out), **(DRY_RUN if a.dry_run else {}))
    given = {k: v for k, v in (("worlds", a.worlds), ("tokens", a.tokens), ("kv_heads", a.kv_heads)) if v}
    return run(replace(cfg, **given))


if __name__ == "__main__":
    sys.exit(main())
