"""Where the host time of a repeated eager call goes, on ONE GPU with loopback ranks: each part of the
cached path timed alone (the call's key, the cache look-up, the new output, the replay's launch through
the compiled kernel's launcher with tensors and with addresses), then ``cProfile`` of whole calls.

Method as ``host_loopback.py``: rank 0 issues ``--calls`` calls, then rank 1 (the GPU pairs them); a part
that launches nothing runs ``--calls`` times alone. Prints µs per call of each part and the profile's top
entries by own time.

    PYTHONPATH=. python benchmarks/host_profile.py [--calls 200] [--hidden 6144] [--tokens 1]
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

from tpcomm import call_cache


def per_call(fn, calls):
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def both_ranks(ranks, fn, calls):
    """µs per call of ``fn(rank)``: each rank's batch in its stream context, the median of the ranks."""
    current = torch.cuda.current_stream()
    out = []
    for rank in ranks:
        rank.stream.wait_stream(current)
        with torch.cuda.stream(rank.stream):
            out.append(per_call(lambda: fn(rank), calls))
    for rank in ranks:
        current.wait_stream(rank.stream)
    torch.cuda.synchronize()
    return sum(out) / len(out)


def main():
    from tpcomm.loopback import close_group, loopback_group, run_ranks

    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--tokens", type=int, default=1)
    a = p.parse_args()
    T, H = a.tokens, a.hidden
    ranks = loopback_group(2, timeout_s=30.0)
    try:
        xs = [torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in ranks]
        res = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        w = torch.randn(H, device="cuda").to(torch.bfloat16)
        ops = {"all_reduce": lambda rk: rk.all_reduce(xs[rk.rank]),
               "fused": lambda rk: rk.fused_add_rmsnorm(xs[rk.rank], res, w)}
        for fn in ops.values():
            for _ in range(3):
                run_ranks(ranks, fn)
        torch.cuda.synchronize()
        y = torch.zeros(1, H, device="cuda", dtype=torch.bfloat16)
        rows = [("torch add_", both_ranks(ranks, lambda rk: y.add_(1), a.calls))]
        for name, fn in ops.items():
            rows.append((f"{name}: whole call", both_ranks(ranks, fn, a.calls)))
        rk = ranks[0]
        x = xs[0]
        key = call_cache.all_reduce_key(x, None, rk.algorithm, True)
        entry = rk._calls.get(key)
        rows.append(("all_reduce: key",
                     per_call(lambda: call_cache.all_reduce_key(x, None, rk.algorithm, True), a.calls)))
        rows.append(("all_reduce: cache get", per_call(lambda: rk._calls.get(key), a.calls)))
        o = entry.outputs[0]
        rows.append(("all_reduce: new output",
                     per_call(lambda: torch.empty_strided(o[0], o[1], dtype=o[2], device=o[3]), a.calls)))
        rows.append(("raw stream handle", per_call(lambda: torch._C._cuda_getCurrentRawStream(0), a.calls)))
        rows.append(("error word check", per_call(lambda: rk.workspace._err_words[0], a.calls)))
        outs = [torch.empty_like(x) for _ in ranks]
        entries = [r._calls.get(call_cache.all_reduce_key(xs[r.rank], None, r.algorithm, True)) for r in ranks]
        rows.append(("all_reduce: _replay", both_ranks(
            ranks, lambda r: r._replay("all_reduce", entries[r.rank], (xs[r.rank], outs[r.rank])), a.calls)))
        raw = {}
        for r in ranks:
            rp = entries[r.rank].replays[0]
            raw[r.rank] = rp
        print("replays per call:", len(entries[0].replays), "direct:", entries[0].direct,
              "params:", len(raw[0]._params),
              "tensor params:", sum(isinstance(v, torch.Tensor) for v in raw[0]._params))

        def launch(r):
            rp = raw[r.rank]
            rp.launch((xs[r.rank], outs[r.rank]), torch._C._cuda_getCurrentRawStream(0))
        rows.append(("all_reduce: replay.launch", both_ranks(ranks, launch, a.calls)))
        # the same launch with every tensor parameter passed as its address
        ints = {r.rank: [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in raw[r.rank]._params]
                for r in ranks}

        def launch_ints(r):
            rp = raw[r.rank]
            params = ints[r.rank]
            for j, targets in zip(rp._sources, rp._targets):
                ptr = (xs[r.rank], outs[r.rank])[j].data_ptr()
                for i in targets:
                    params[i] = ptr
            rp._run(rp.grid, 1, 1, torch._C._cuda_getCurrentRawStream(0), rp._function, rp._meta, None, None, None,
                    *params)
        rows.append(("all_reduce: launcher, addresses only", both_ranks(ranks, launch_ints, a.calls)))
        launcher = raw[0]._run
        print("launcher:", type(launcher), {k: getattr(launcher, k, None) for k in (
            "global_scratch_size", "profile_scratch_size", "launch_pdl", "launch_cooperative_grid")})
        for name, us in rows:
            print(f"{name:40s} {us:8.2f} us")
        for name, fn in ops.items():
            prof = cProfile.Profile()
            prof.enable()
            both_ranks(ranks, fn, a.calls)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print(f"== cProfile {name}, {2 * a.calls} calls\n" + s.getvalue())
        for r in ranks:
            r.check()
    finally:
        close_group(ranks)


if __name__ == "__main__":
    main()
