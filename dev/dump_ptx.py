"""Compile the one-shot kernel for this GPU and report whether the data accesses are 16-byte (v4).

    PYTHONPATH=. python dev/dump_ptx.py OUTDIR
"""
import sys

import torch

from tpcomm.kernels.one_shot import _one_shot_kernel

out = sys.argv[1] if len(sys.argv) > 1 else "."
H = 6144
x = torch.empty(H, device="cuda", dtype=torch.bfloat16)
tbl = torch.zeros(2, dtype=torch.int64, device="cuda")
st = torch.zeros(2, dtype=torch.int32, device="cuda")
k = _one_shot_kernel.warmup(x, x, x, x, x, tbl, tbl, st, st, 1, H, H, H, 1 << 20, 2 << 20, 132, 1e-6,
                            10**9, 0, WORLD=2, BLOCK_H=8192, NUM_TILES=1, NORM=True, HAS_RESIDUAL=True,
                            GEMMA=False, num_warps=8, grid=(1,))
ptx = k.asm["ptx"]
open(f"{out}/one_shot.ptx", "w").write(ptx)
for pat in ("ld.global.v4", "st.global.v4", "ld.global.cg.v4", "ld.acquire.sys", "atom.release.sys", "globaltimer"):
    print(pat, ptx.count(pat))
print("regs", k.n_regs, "spills", k.n_spills)
