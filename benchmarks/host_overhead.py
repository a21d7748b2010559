"""Host time of one call (Python checks, the plan, signatures, tensor views), with the Triton kernels
replaced by no-ops: what an eager call costs before Triton's own launcher and the GPU. Two CPU ranks.

    PYTHONPATH=. python benchmarks/host_overhead.py [--calls 2000]
"""
import argparse
import time

import torch

from tpcomm.launch import launch


class _NoKernel:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def body(rank, world, calls):
    import tpcomm
    from tpcomm.kernels import gather, lamport, one_shot, two_shot

    comm = tpcomm.Communicator()
    x = torch.randn(1, 6144).to(torch.bfloat16)
    r, w = x.clone(), torch.ones(6144, dtype=torch.bfloat16)
    big = torch.randn(64, 6144).to(torch.bfloat16)
    ops = {"fused T=1": lambda: comm.fused_add_rmsnorm(x, r, w),
           "fused FP8 T=1": lambda: comm.fused_add_rmsnorm(x, r, w, quant="fp8_per_token"),
           "all_reduce T=1": lambda: comm.all_reduce(x),
           "all_gather T=64": lambda: comm.all_gather(big),
           "reduce_scatter T=64": lambda: comm.reduce_scatter(big)}
    for f in ops.values():  # compile once under the interpreter, with the real kernels
        f()
    saved = (lamport._lamport_kernel, one_shot._one_shot_kernel, two_shot._two_shot_kernel,
             gather._all_gather_kernel)
    lamport._lamport_kernel = one_shot._one_shot_kernel = two_shot._two_shot_kernel = \
        gather._all_gather_kernel = _NoKernel()
    res = {}
    for name, f in ops.items():
        t = time.perf_counter()
        for _ in range(calls):
            f()
        res[name] = (time.perf_counter() - t) / calls * 1e6
    (lamport._lamport_kernel, one_shot._one_shot_kernel, two_shot._two_shot_kernel,
     gather._all_gather_kernel) = saved
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    out = launch(body, 2, "cpu", args=(a.calls,))
    for name in out[0]:
        print(f"{name:22s} " + "  ".join(f"rank {r}: {o[name]:6.1f} us" for r, o in enumerate(out)))
