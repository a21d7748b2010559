"""Seconds per call of a fused add + RMSNorm and an all-reduce (5 x 2880 bf16) on 2 CPU ranks under
Triton's interpreter, after a first call: the CPU path's own speed (docs/performance.md, "CPU ranks").

    python benchmarks/cpu_call_time.py [--calls 5]
"""

import argparse
import time

import torch

import tpcomm
from tpcomm.launch import launch


def _rank(rank: int, world_size: int, calls: int) -> float:
    with tpcomm.Communicator() as comm:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(5, 2880, generator=g).to(torch.bfloat16)
        r = torch.randn(5, 2880, generator=g).to(torch.bfloat16)
        w = torch.ones(2880, dtype=torch.bfloat16)
        comm.fused_add_rmsnorm(x, r, w)  # compiles nothing under the interpreter, but warms the caches
        t0 = time.perf_counter()
        for _ in range(calls):
            comm.fused_add_rmsnorm(x, r, w)
            comm.all_reduce(x)
        return (time.perf_counter() - t0) / (2 * calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    per_rank = launch(_rank, 2, "cpu", args=(args.calls,))
    print("seconds per call, by rank:", " ".join(f"{s:.3f}" for s in per_rank))


if __name__ == "__main__":
    main()
