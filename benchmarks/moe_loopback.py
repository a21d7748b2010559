"""MoE finalize + all-reduce + residual + RMSNorm on ONE GPU, ranks as loopback communicators.

Rows per (world size, hidden size, tokens), K experts a token, bf16, CUDA graphs:

* ``fused``: ``comm.fused_moe_finalize_add_rmsnorm`` (permuted layout with an index; one launch where the
  fused norm has one);
* ``composed``: ``tpcomm.moe_finalize`` then ``comm.fused_add_rmsnorm`` (two launches);
* ``trtllm_finalize``: FlashInfer's ``trtllm_moe_finalize_allreduce_fusion`` (TensorRT-LLM's kernel, the
  same permuted input and index), and ``trtllm_moe_ar``: ``trtllm_moe_allreduce_fusion`` (its expert-major
  ``(K * T, H)`` input with ``(K, T)`` float32 scales), each as loopback ranks on the workspace of
  ``tpcomm.bench.loopback.TrtllmLoopback``; only where FlashInfer imports, at world sizes it supports and
  up to ``FI_MAX_TOKENS`` tokens (its loopback grid outgrows what the ranks keep resident beyond).

Every output is checked before it is timed: tpcomm's bit for bit against the plain-torch oracle
(``moe_finalize_reference`` per rank, ``reduce_in_rank_order``, ``add_rmsnorm_reference``), TensorRT-LLM's
within a relative error of 8e-3 (it sums in another order). Timing: ``tpcomm.bench.loopback.graph_us``
(each rank issues ``calls`` calls on its own stream in one graph; median over ``replays`` replays of the
time per call, µs). Each library at each (world, hidden) runs in a child process with a time limit, so a
kernel that never ends costs its own rows only. The peers' data never crosses NVLink: these are the
kernels' own costs. Bandwidth is not reported: the finalize's traffic (``K`` expert rows read per token)
is not the all-reduce's.

    PYTHONPATH=. python benchmarks/moe_loopback.py [--worlds 2,4] [--hiddens 3072,7168] [--tokens 1,16,64,256]
                                                   [--k 8] [--out results/moe_loopback.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch

#: TensorRT-LLM's rows stop here (as ``tpcomm.bench.loopback.FI_MAX_TOKENS``), and its world sizes.
FI_MAX_TOKENS = 64
FI_WORLDS = (2, 4, 8, 16)
#: Seconds one child may take (tpcomm compiles its kernels; FlashInfer loads prebuilt modules).
CHILD_TIMEOUT_S = {"tpcomm": 300.0, "trtllm": 120.0}
#: TensorRT-LLM's relative error allowance against the oracle (bf16 outputs, another summation order).
TRTLLM_REL = 8e-3
EPS = 1e-6


@dataclass(frozen=True)
class Config:
    worlds: tuple = (2, 4)
    hiddens: tuple = (3072, 7168)
    tokens: tuple = (1, 16, 64, 256)
    k: int = 8
    calls: int = 50
    replays: int = 20
    out: str | None = None


def inputs(W: int, T: int, K: int, H: int, seed: int):
    """Every rank's permuted expert outputs ``(T * K, H)`` and the shared routing (index, float32 weights),
    the residual and the norm weight."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    perm = torch.randperm(T * K, device="cuda", generator=g)
    index = perm.view(T, K).to(torch.int32)
    weights = torch.rand(T, K, device="cuda", generator=g)
    weights = weights / weights.sum(-1, keepdim=True)
    experts = [torch.randn(T * K, H, device="cuda", generator=g).to(torch.bfloat16) for _ in range(W)]
    res = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    nw = (1 + 0.5 * torch.randn(H, device="cuda", generator=g)).to(torch.bfloat16)
    return experts, index, weights, res, nw


def oracle(experts, index, weights, res, nw):
    import tpcomm

    xs = [tpcomm.moe_finalize_reference(e, weights, index=index) for e in experts]
    return tpcomm.add_rmsnorm_reference(tpcomm.reduce_in_rank_order(xs), res, nw, EPS)


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _emit(row: dict) -> None:
    print("ROW " + json.dumps(row), flush=True)


def tpcomm_rows(W: int, H: int, tokens, K: int, calls: int, replays: int) -> None:
    import tpcomm
    from tpcomm.bench.loopback import graph_us
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    ranks = loopback_group(W, timeout_s=20.0)
    try:
        for T in tokens:
            experts, index, weights, res, nw = inputs(W, T, K, H, seed=T * 31 + H)
            want = oracle(experts, index, weights, res, nw)
            xs = [torch.empty(T, H, dtype=torch.bfloat16, device="cuda") for _ in range(W)]
            fns = {
                "fused": lambda r: ranks[r].fused_moe_finalize_add_rmsnorm(experts[r], weights, res, nw, EPS,
                                                                           index=index),
                "composed": lambda r: ranks[r].fused_add_rmsnorm(
                    tpcomm.moe_finalize(experts[r], weights, index=index, out=xs[r]), res, nw, EPS),
            }
            for op, fn in fns.items():
                got = run_ranks(ranks, lambda rk, fn=fn: fn(rk.rank))
                torch.cuda.synchronize()
                ok = all(_same(g[0], want[0]) and _same(g[1], want[1]) for g in got)
                row = dict(library="tpcomm", op=op, world=W, hidden=H, tokens=T, k=K, checked=ok,
                           algorithm=ranks[0].plan("fused_add_rmsnorm", T * H * 2, H, torch.bfloat16).algorithm)
                if ok:
                    row["us"] = graph_us(fn, [rk.stream for rk in ranks], calls, replays)
                _emit(row)
        for rk in ranks:
            rk.check()
    finally:
        close_group(ranks)


def _call(fn, **kwargs):
    """``fn(**kwargs)`` with the keywords its signature takes (FlashInfer's vary between versions)."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def trtllm_rows(W: int, H: int, tokens, K: int, calls: int, replays: int) -> None:
    import warnings

    import flashinfer.comm as fc

    from tpcomm.bench.loopback import TrtllmLoopback, graph_us, issue_on_streams

    warnings.simplefilter("ignore")
    lb = TrtllmLoopback(W, max(tokens), H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    for T in tokens:
        experts, index, weights, res, nw = inputs(W, T, K, H, seed=T * 31 + H)
        want = oracle(experts, index, weights, res, nw)
        # trtllm_moe_allreduce_fusion's input: expert-major rows (k * T + t) and (K, T) scales
        token_major = [e[index.long()] for e in experts]  # (T, K, H)
        expert_major = [t.transpose(0, 1).reshape(K * T, H).contiguous() for t in token_major]
        scales_kt = weights.t().contiguous()
        zeros = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
        outs = [(torch.empty(T, H, dtype=torch.bfloat16, device="cuda"),
                 torch.empty(T, H, dtype=torch.bfloat16, device="cuda")) for _ in range(W)]

        def finalize(r):
            _call(fc.trtllm_moe_finalize_allreduce_fusion, allreduce_in=experts[r], residual_in=res, norm_weight=nw,
                  expanded_idx_to_permuted_idx=index, norm_out=outs[r][0], residual_out=outs[r][1], quant_out=None,
                  scale_out=None, workspace_ptrs=lb.ws[r], launch_with_pdl=True, world_rank=r, world_size=W,
                  eps=EPS, shared_expert_output=None, expert_scale_factor=weights, routed_scaling_factor=None)

        def moe_ar(r):
            _call(fc.trtllm_moe_allreduce_fusion, world_size=W, world_rank=r, token_num=T, hidden_dim=H,
                  workspace_ptrs=lb.ws[r], launch_with_pdl=True, residual_in=res, rms_gamma=nw, rms_eps=EPS,
                  scale_factor=1.0, moe_reduction_device_num_experts=K, moe_reduction_scale_input=scales_kt,
                  moe_reduction_active_experts_token_input=expert_major[r], moe_reduction_token_input=zeros,
                  layout_code=None, moe_allreduce_out=None, residual_out=outs[r][1], norm_out=outs[r][0],
                  quant_out=None, scale_out=None)

        for op, issue in (("trtllm_finalize", finalize), ("trtllm_moe_ar", moe_ar)):
            row = dict(library="trtllm", op=op, world=W, hidden=H, tokens=T, k=K)
            try:
                issue_on_streams(issue, streams)
                torch.cuda.synchronize()
                err = max(max(_rel(o, want[0]), _rel(ro, want[1])) for o, ro in outs)
                row.update(checked=err < TRTLLM_REL, rel_error=err)
                if row["checked"]:
                    row["us"] = graph_us(issue, streams, calls, replays)
            except Exception as e:  # an API this FlashInfer lacks: reported, the other rows go on
                row.update(checked=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            _emit(row)


def run(cfg: Config) -> int:
    from tabulate import tabulate

    from tpcomm.bench.loopback import _collect, _version

    if not torch.cuda.is_available():
        print("moe_loopback: needs a CUDA GPU")
        return 2
    try:
        import flashinfer.comm  # noqa: F401
        have_fi, notes = True, []
    except Exception as e:
        have_fi, notes = False, [f"FlashInfer not available ({type(e).__name__}: {e})"]
    rows = []
    for W in cfg.worlds:
        for H in cfg.hiddens:
            libs = [("tpcomm", cfg.tokens)]
            fi_tokens = tuple(t for t in cfg.tokens if t <= FI_MAX_TOKENS)
            if have_fi and W in FI_WORLDS and fi_tokens:
                libs.append(("trtllm", fi_tokens))
            for lib, toks in libs:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", lib, str(W), str(H),
                       ",".join(map(str, toks)), str(cfg.k), str(cfg.calls), str(cfg.replays)]
                got, note = _collect(cmd, CHILD_TIMEOUT_S[lib], f"{lib} at world {W}, hidden {H}")
                rows += got
                notes += [note] if note else []
    us = {(r["op"], r["world"], r["hidden"], r["tokens"]): r.get("us") for r in rows}
    ops = ("fused", "composed", "trtllm_finalize", "trtllm_moe_ar")

    def cell(v):
        return "-" if v is None else f"{v:.2f}"

    def ratio(a, b):
        return "-" if a is None or b is None else f"{b / a:.2f}x"

    table = []
    for W in cfg.worlds:
        for H in cfg.hiddens:
            for T in cfg.tokens:
                v = [us.get((op, W, H, T)) for op in ops]
                table.append([W, H, T, *map(cell, v), ratio(v[0], v[1]), ratio(v[0], v[2]), ratio(v[0], v[3])])
    print(tabulate(table, headers=["world", "hidden", "tokens", "fused µs", "composed µs", "TRT-LLM finalize µs",
                                   "TRT-LLM moe_ar µs", "speed-up vs composed", "vs TRT-LLM finalize",
                                   "vs TRT-LLM moe_ar"], tablefmt="github"))
    for n in notes:
        print("note:", n)
    bad = [r for r in rows if not r.get("checked")]
    for r in bad:
        print(f"NOT TIMED {r['library']} {r['op']} w{r['world']} {r['tokens']}x{r['hidden']}: "
              f"{r.get('error') or 'wrong output'}")
    if cfg.out:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
        with open(cfg.out, "w") as f:
            json.dump(dict(config=asdict(cfg), device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=_version("triton"), flashinfer=_version("flashinfer"), rows=rows, notes=notes),
                      f, indent=1)
        print(f"wrote {cfg.out}")
    return 1 if any(r["library"] == "tpcomm" for r in bad) or any(n.startswith("tpcomm") for n in notes) else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        lib, W, H, toks, K, calls, replays = argv[1:8]
        fn = tpcomm_rows if lib == "tpcomm" else trtllm_rows
        fn(int(W), int(H), [int(t) for t in toks.split(",")], int(K), int(calls), int(replays))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def ints(s):
        return tuple(int(v) for v in s.split(","))

    p.add_argument("--worlds", type=ints, default=Config.worlds)
    p.add_argument("--hiddens", type=ints, default=Config.hiddens)
    p.add_argument("--tokens", type=ints, default=Config.tokens)
    p.add_argument("--k", type=int, default=Config.k)
    p.add_argument("--calls", type=int, default=Config.calls)
    p.add_argument("--replays", type=int, default=Config.replays)
    p.add_argument("--out", default=None, help="JSON results path")
    a = p.parse_args(argv)
    return run(Config(a.worlds, a.hiddens, a.tokens, a.k, a.calls, a.replays, a.out))


if __name__ == "__main__":
    sys.exit(main())
