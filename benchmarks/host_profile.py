"""Where the host time of a repeated eager call goes, on ONE GPU with loopback ranks: for each op with its
outputs passed, the whole call, the call with the compiled kernel's launcher replaced by a no-op (tpcomm's
Python: key, cache look-up, checks, replay), and the launcher alone with the recorded parameters; beside
them torch's ``y.add_(1)`` and, where FlashInfer is installed, its TRT-LLM fusion call (the peer's whole
call), all timed the same way; then ``cProfile`` of whole calls.

Method as ``host_loopback.py``: rank 0 issues ``--calls`` calls inside its stream context, then rank 1
(the GPU pairs them); each part is the median over ``--rounds`` rounds of the ranks' mean. Prints µs per
call of each part.

    PYTHONPATH=. python benchmarks/host_profile.py [--calls 200] [--rounds 5] [--hidden 6144] [--tokens 1]
"""
import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from host_loopback import trtllm_ops  # this folder's: the same TRT-LLM calls


def per_call(fn, calls):
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def both_ranks(ranks, fn, calls):
    """µs per call of ``fn(r)`` (``r`` the rank index): each rank's batch in its stream context, the
    mean of the ranks."""
    current = torch.cuda.current_stream()
    streams = [rank.stream for rank in ranks]
    out = []
    for r, s in enumerate(streams):
        s.wait_stream(current)
        with torch.cuda.stream(s):
            out.append(per_call(lambda: fn(r), calls))
    for s in streams:
        current.wait_stream(s)
    torch.cuda.synchronize()
    return sum(out) / len(out)


def _no_launcher(*args):
    return None


def _set_launchers(entries, launchers) -> None:
    """Give each replay its ``(replay, run, raw)`` launcher, then write the entries' repeats again (where
    the tree's entries write code for their launchers)."""
    for rp, run, raw in launchers:
        rp._run = run
        if hasattr(type(rp), "_raw"):
            rp._raw = raw
    for e in entries:
        if hasattr(e, "rebuild"):
            e.rebuild()


def main():
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--tokens", type=int, default=1)
    a = p.parse_args()
    T, H = a.tokens, a.hidden
    ranks = loopback_group(2, timeout_s=30.0)
    try:
        xs = [torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in ranks]
        res = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        w = torch.randn(H, device="cuda").to(torch.bfloat16)
        outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in ranks]
        res_outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in ranks]
        q = [torch.empty(T, H, device="cuda", dtype=torch.float8_e4m3fn) for _ in ranks]
        sc = [torch.empty(T, 1, device="cuda", dtype=torch.float32) for _ in ranks]
        ops = {
            "all_reduce out=": lambda r: ranks[r].all_reduce(xs[r], out=outs[r]),
            "fused out=": lambda r: ranks[r].fused_add_rmsnorm(xs[r], res, w, out=outs[r], residual_out=res_outs[r]),
            "fp8/token out=": lambda r: ranks[r].fused_add_rmsnorm(xs[r], res, w, quant="fp8_per_token", q_out=q[r],
                                                                   scales_out=sc[r], residual_out=res_outs[r]),
        }
        recorded = {}  # per op, each rank's entry that its calls recorded
        for name, fn in ops.items():
            before = [set(rk._calls._entries) for rk in ranks]
            for _ in range(3):
                run_ranks(ranks, lambda rk: fn(rk.rank))
            recorded[name] = [[e for k, e in rk._calls._entries.items() if k not in seen]
                              for rk, seen in zip(ranks, before)]
        torch.cuda.synchronize()
        y = torch.zeros(1, H, device="cuda", dtype=torch.bfloat16)
        parts = {"torch add_": lambda r: y.add_(1)}
        for name, fn in ops.items():
            parts[f"{name}: whole call"] = fn
            parts[f"{name}: tpcomm Python (no launcher)"] = ("no launcher", fn)
            per_rank = recorded[name]
            if not all(len(e) == 1 and len(e[0].replays) == 1 and e[0].direct for e in per_rank):
                print(f"{name}: not one direct replay per call: {per_rank}")
                continue
            rps = [e[0].replays[0] for e in per_rank]

            def launch(r, rps=rps):  # the launcher alone (as a replay calls it), the rank's last call's parameters
                rp = rps[r]
                raw = getattr(rp, "_raw", None)
                if raw is None:
                    rp._run(rp.grid, 1, 1, torch._C._cuda_getCurrentRawStream(0), rp._function, rp._meta, None, None,
                            None, *rp._params)
                else:
                    raw[0](rp.grid, 1, 1, torch._C._cuda_getCurrentRawStream(0), rp._function, raw[1], raw[2], None,
                           None, rp._meta, None, None, None, *rp._params)
            tensors = sum(isinstance(v, torch.Tensor) for v in rps[0]._params)
            parts[f"{name}: launcher alone ({len(rps[0]._params)} params, {tensors} tensors)"] = launch
        # FlashInfer's TRT-LLM calls, outputs given (host_loopback.py's, checked there), where installed
        for name, (fn, _) in trtllm_ops(T, H, ranks, xs, res, w).items():
            parts[name] = lambda r, fn=fn: fn(ranks[r])
        samples = {name: [] for name in parts}
        for _ in range(a.rounds):
            for name, fn in parts.items():
                if isinstance(fn, tuple):  # tpcomm's Python alone: every recorded launcher a no-op
                    fn = fn[1]
                    entries = [e for rk in ranks for e in rk._calls._entries.values()]
                    saved = [(rp, rp._run, getattr(rp, "_raw", None)) for e in entries for rp in e.replays]
                    _set_launchers(entries, [(rp, _no_launcher, None) for rp, _, _ in saved])
                    try:
                        samples[name].append(both_ranks(ranks, fn, a.calls))
                    finally:
                        _set_launchers(entries, saved)
                else:
                    samples[name].append(both_ranks(ranks, fn, a.calls))
        add = statistics.median(samples["torch add_"])
        for name, values in samples.items():
            us = statistics.median(values)
            print(f"{name:62s} {us:8.2f} us  {us / add:5.2f}x add_")
        for name, fn in ops.items():
            prof = cProfile.Profile()
            prof.enable()
            both_ranks(ranks, fn, a.calls)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            print(f"== cProfile {name}, {2 * a.calls} calls\n" + s.getvalue())
        for r in ranks:
            r.check()
    finally:
        close_group(ranks)


if __name__ == "__main__":
    main()
