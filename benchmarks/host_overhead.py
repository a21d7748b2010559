"""Host time of one call (the key, the cached launches, the outputs' allocation; on a first call the
checks and the plan), with every Triton launch replaced by a no-op: what an eager call costs before
Triton's own launcher and the GPU. Two CPU ranks; torch's ``y.add_(1)`` on the CPU beside them. Each
number is the mean of the fastest of ``ROUNDS`` rounds, interleaved over the ops (µs per call, rank 0 / rank 1; the
ranks take turns, so
they do not share the cores); two columns: cached launches
through ``kernel[grid]`` (the interpreter's path) and through the compiled kernel's launcher (the path
of CUDA, the launcher itself a no-op here).
With ``--device cuda`` (2 GPUs): the real kernels, the host time per call (issuing ``calls`` calls, then
one synchronize) and a cProfile of rank 0's calls, sorted by own time, written to ``--out``.

    PYTHONPATH=. python benchmarks/host_overhead.py [--calls 2000] [--device cuda --out DIR]
"""
import argparse
import cProfile
import io
import os
import pstats
import time

import torch
import torch.distributed as dist

from tpcomm.launch import launch

#: Rounds; each op runs ``calls / ROUNDS`` calls in every round, and its time is its fastest round's mean.
ROUNDS = 40


def _no_kernel(self, grid):
    return lambda *args, **kwargs: None


def _no_launcher(*args):
    return None


def _replay_as_on_cuda(comm) -> None:
    """Make every cached launch of ``comm`` take the path a CUDA replay takes (pointers as addresses, the
    compiled kernel's launcher called with every parameter), with that launcher a no-op."""
    for entry in comm._calls._entries.values():
        for replay in entry.replays:
            replay.bind_launcher(_no_launcher, 0, None)
        entry.rebuild()


def body(rank, world, calls):
    from triton.runtime.interpreter import InterpretedFunction

    import tpcomm

    comm = tpcomm.Communicator()
    x = torch.randn(1, 6144).to(torch.bfloat16)
    r, w = x.clone(), torch.ones(6144, dtype=torch.bfloat16)
    big = torch.randn(64, 6144).to(torch.bfloat16)
    y = torch.empty_like(x)
    o, ro = torch.empty_like(x), torch.empty_like(x)
    q, s = torch.empty(1, 6144, dtype=torch.float8_e4m3fn), torch.empty(1, 1)
    ops = {"fused T=1": lambda: comm.fused_add_rmsnorm(x, r, w),
           "fused T=1 out=": lambda: comm.fused_add_rmsnorm(x, r, w, out=o, residual_out=ro),
           "fused FP8/token T=1 out=": lambda: comm.fused_add_rmsnorm(x, r, w, quant="fp8_per_token", q_out=q,
                                                                      scales_out=s, residual_out=ro),
           "fused FP8/token T=1": lambda: comm.fused_add_rmsnorm(x, r, w, quant="fp8_per_token"),
           "fused FP8/group T=1": lambda: comm.fused_add_rmsnorm(x, r, w, quant="fp8_per_group"),
           "all_reduce T=1": lambda: comm.all_reduce(x),
           "all_reduce T=1 out=": lambda: comm.all_reduce(x, out=y),
           "all_gather T=64": lambda: comm.all_gather(big),
           "reduce_scatter T=64": lambda: comm.reduce_scatter(big),
           "torch add_ T=1": lambda: y.add_(1)}
    qkv = torch.randn(1, 3072 + 2 * 512).to(torch.bfloat16)  # MiniMax-M2's q and k widths over 2 ranks
    qc, kc = qkv[:, :3072].contiguous(), qkv[:, 3072:3584].contiguous()
    wq, wk = torch.ones(3072, dtype=torch.bfloat16), torch.ones(512, dtype=torch.bfloat16)
    ops["qk norm T=1"] = lambda: comm.fused_qk_rmsnorm(qc, kc, wq, wk)  # recorded: repeated
    ops["qk norm T=1 packed views"] = lambda: comm.fused_qk_rmsnorm(qkv[:, :3072], qkv[:, 3072:3584], wq, wk)
    ops["torch add_ T=1"] = ops.pop("torch add_ T=1")  # the baseline row last
    for f in ops.values():  # the first call of each: compiles and runs the real kernels, then is cached
        f()
    saved = InterpretedFunction.__getitem__
    InterpretedFunction.__getitem__ = _no_kernel  # every launch, first or cached, is a no-op from here on
    res = {}
    try:
        for mode in ("interpreter", "cuda path"):
            if mode == "cuda path":
                _replay_as_on_cuda(comm)
            for f in ops.values():
                for _ in range(20):
                    f()
            best = dict.fromkeys(ops, float("inf"))
            for turn in range(world):  # one rank at a time (no-op launches wait for no peer)
                if turn == rank:
                    for _ in range(ROUNDS):  # short rounds, every op in each: the machine's speed drifts
                        for name, f in ops.items():
                            t = time.perf_counter()
                            for _ in range(calls // ROUNDS):
                                f()
                            best[name] = min(best[name], (time.perf_counter() - t) / (calls // ROUNDS) * 1e6)
                dist.barrier()
            for name in ops:
                res[name, mode] = best[name]
    finally:
        InterpretedFunction.__getitem__ = saved
    comm.close()
    return res


def body_cuda(rank, world, calls, out_dir):
    import tpcomm

    comm = tpcomm.Communicator()
    x = torch.randn(1, 6144, device="cuda").to(torch.bfloat16)
    r, w = x.clone(), torch.ones(6144, dtype=torch.bfloat16, device="cuda")
    ops = {"fused T=1": lambda: comm.fused_add_rmsnorm(x, r, w),
           "fused FP8 T=1": lambda: comm.fused_add_rmsnorm(x, r, w, quant="fp8_per_token"),
           "all_reduce T=1": lambda: comm.all_reduce(x)}
    res = {}
    for name, f in ops.items():
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            f()
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        res[name] = (host / calls * 1e6, (time.perf_counter() - t) / calls * 1e6)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls // 4):
            f()
        prof.disable()
        torch.cuda.synchronize()
        if rank == 0:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            with open(os.path.join(out_dir, f"profile-{name.replace(' ', '_').replace('=', '')}.txt"), "w") as fh:
                fh.write(text.getvalue())
    comm.close()
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=".")
    a = p.parse_args()
    if a.device == "cuda":
        os.makedirs(a.out, exist_ok=True)
        out = launch(body_cuda, 2, "cuda", args=(a.calls, a.out))
        for name in out[0]:
            print(f"{name:16s} " + "  ".join(f"rank {r}: issue {o[name][0]:6.1f} us, with GPU {o[name][1]:6.1f} us"
                                             for r, o in enumerate(out)))
    else:
        out = launch(body, 2, "cpu", args=(a.calls,))
        modes = (("interpreter", "kernel[grid] (interpreter)"), ("cuda path", "compiled launcher (as on CUDA)"))
        print(f"{'us per call, rank 0 / 1':24s}" + "".join(f"{title:>34s}" for _, title in modes))
        for name in dict.fromkeys(k[0] for k in out[0]):
            cells = []
            for mode, _ in modes:  # with the ratio to torch's add_ of the same rank and mode
                cells.append(" / ".join(f"{o[name, mode]:5.1f} ({o[name, mode] / o['torch add_ T=1', mode]:.2f}x)"
                                        for o in out))
            print(f"{name:24s}" + "".join(f"{c:>34s}" for c in cells))
