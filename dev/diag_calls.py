"""Call-by-call smoke run on 2 GPUs: every op under every algorithm once, each followed by a device
synchronisation and a timestamped line per rank, so a hang or a timeout shows which call it was (and
``faulthandler`` dumps every rank's stack after 45 s). Worth running first after a kernel change.

    PYTHONPATH=. python dev/diag_calls.py
"""
import faulthandler
import os
import sys
import time

import torch

H = 4096


def body(rank, world):
    import tpcomm

    faulthandler.dump_traceback_later(45, exit=True)

    def timed(what, fn):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        print(f"[r{rank} {time.strftime('%H:%M:%S')}] {what}: {time.perf_counter() - t:.2f} s", flush=True)

    comm = tpcomm.Communicator()
    print(f"[r{rank}] uses_kernels={comm.uses_kernels}", flush=True)
    w = torch.randn(H, device="cuda").bfloat16()
    for algo in ("one_shot", "lamport", "two_shot"):
        for T in (1, 3, 64):
            x = torch.randn(T, H, device="cuda").bfloat16()
            r = torch.randn_like(x)
            with comm.use_algorithm(algo):
                timed(f"{algo} T={T} all_reduce", lambda: comm.all_reduce(x))
                timed(f"{algo} T={T} fused", lambda: comm.fused_add_rmsnorm(x, r, w))
                timed(f"{algo} T={T} fused fp8", lambda: comm.fused_add_rmsnorm(x, r, w, quant="fp8_per_token"))
    timed("all_gather", lambda: comm.all_gather(x))
    timed("reduce_scatter", lambda: comm.reduce_scatter(x))
    timed("all_gather int32", lambda: comm.all_gather(x.to(torch.int32)))
    comm.close()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tpcomm.launch import launch

    print(launch(body, 2, "cuda", timeout_s=50))
