"""Development sweep on 2 GPUs: num_warps of the row kernels (Lamport and one-shot, fused, hidden 6144
bf16, CUDA graph) at decode sizes. Patches tpcomm.dispatch.row_config for the experiment only.

    PYTHONPATH=. python dev/dev_warps.py
"""
import dataclasses
import os

import torch
from dev_fused import graph_time


def body(rank, world):
    import tpcomm
    import tpcomm.dispatch as d

    orig = d.row_config
    comms = {}
    for algo in ("lamport", "one_shot"):
        os.environ["TPCOMM_ALGO"] = algo
        comms[algo] = tpcomm.Communicator()
    rows = []
    H = int(os.environ.get("DEV_H", "6144"))
    for warps in (2, 4, 8, 16):
        d.row_config = lambda h, mp, two_shot=False, w=warps, **kw: dataclasses.replace(orig(h, mp, two_shot, **kw),
                                                                                       num_warps=w)
        for T in (1, 16, 64, 256):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
            row = dict(warps=warps, T=T)
            for algo, c in comms.items():
                row[algo] = graph_time(lambda: c.fused_add_rmsnorm(x, r, w, 1e-6))
            rows.append(row)
    d.row_config = orig
    torch.cuda.synchronize()
    for c in comms.values():
        c.check()
        c.close()
    return rows


if __name__ == "__main__":
    from tpcomm.launch import launch

    for row in launch(body, 2, "cuda")[0]:
        print(row)
