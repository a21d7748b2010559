"""Development timing on ONE GPU: tpcomm's kernels run with a group of one rank (no peer traffic, no
waits), to see what a kernel body costs apart from NVLink. Useful on a machine with one GPU:
fused bf16 against fused FP8 per algorithm, the standalone quant, a launch floor. Every output is
checked bit for bit against ``tpcomm.reference`` before it is timed. Not a published number: the
published ones come from ``tpcomm bench`` on 2 GPUs.

A group of one rank normally falls back (nothing to communicate); this script patches the set-up and
the dispatch so the kernels run with ``WORLD = 1``.

    PYTHONPATH=. python dev/dev_single.py [--out DIR] [--variant NAME]

``--variant`` sets another launch configuration before anything compiles (see ``VARIANTS``); its
outputs are checked like the rest.
"""
import argparse
import importlib
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import triton

sys.path.insert(0, os.path.dirname(__file__))
from dev_fused import graph_time  # noqa: E402


def _patch(module: str, name: str, value):
    """Set ``name`` of the module ``module`` (``tpcomm.<module>``) to ``value``, before anything compiles."""
    setattr(importlib.import_module(f"tpcomm.{module}"), name, value)


def _patch_warps(n):
    from tpcomm import dispatch
    row_config = dispatch.row_config

    def with_warps(hidden, max_programs, two_shot=False, **kw):
        cfg = row_config(hidden, max_programs, two_shot, **kw)
        return dispatch.RowConfig(cfg.block_h, cfg.num_tiles, n, cfg.max_programs)
    dispatch.row_config = with_warps


#: ``--variant`` name -> the launch configuration it sets before anything compiles. The kernel variants
#: measured against the kernels (docs/design.md) are deleted once decided; git keeps them.
VARIANTS = {
    "warps8": lambda: _patch_warps(8),
    "warps4": lambda: _patch_warps(4),
    "warps32": lambda: _patch_warps(32),  # 8192-wide tiles: 64 registers a thread at most, no spill (sm_90 build)
    "ar_rows_2048": lambda: _patch("dispatch", "ALL_REDUCE_ROW", 2048),
    "ar_rows_1024": lambda: _patch("dispatch", "ALL_REDUCE_ROW", 1024),
}


@triton.jit
def _empty_kernel(p):
    pass


def patch_for_one_rank():
    """Let a Communicator on a group of one rank build its workspace and run the kernels."""
    from tpcomm import communicator as C, dispatch
    from tpcomm.workspace import Workspace

    choose = dispatch.choose

    def choose_any_world(op, world_size, *a, **k):
        return choose(op, max(world_size, 2), *a, **k)

    def set_up(self):
        self.workspace = Workspace(self.group, self.device, self.max_bytes, self._local_programs(),
                                   self.timeout_s,
                                   lamport_slot_bytes=min(self.max_bytes, dispatch.LAMPORT_MAX_BYTES),
                                   pdl=self.env.pdl)
        return None

    dispatch.choose = choose_any_world
    C.Communicator._set_up = set_up


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--variant", default="", choices=["", *VARIANTS])
    ap.add_argument("--hidden", default="6144,7168")
    ap.add_argument("--tokens", default="1,16,64,256,1024,4096")
    args = ap.parse_args()
    if args.variant:
        VARIANTS[args.variant]()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    patch_for_one_rank()
    import tpcomm
    from tpcomm import reference as R

    comm = tpcomm.Communicator()
    assert comm.uses_kernels
    log = []

    def emit(**row):
        log.append(row)
        print(json.dumps(row), flush=True)

    dummy = torch.zeros(1, device="cuda")
    emit(case="empty_kernel", us=graph_time(lambda: _empty_kernel[(1,)](dummy)))
    ok = True
    for H in [int(h) for h in args.hidden.split(",")]:
        for T in [int(t) for t in args.tokens.split(",")]:
            g = torch.Generator(device="cuda").manual_seed(H + T)
            x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
            r = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
            w = torch.randn(H, device="cuda", generator=g).to(torch.bfloat16)
            o_ref, ro_ref = R.add_rmsnorm_reference(x, r, w, 1e-6)
            q_ref, s_ref = R.per_token_quant_reference(o_ref)
            emit(case="torch_copy", H=H, T=T, us=graph_time(lambda: x.clone()))
            emit(case="standalone_quant", H=H, T=T,
                 us=graph_time(lambda: tpcomm.per_token_quant_fp8(o_ref)))
            for algo in ("lamport", "one_shot", "two_shot"):
                if algo == "lamport" and T * H * 2 > (4 << 20):
                    continue
                with comm.use_algorithm(algo):
                    o, ro = comm.fused_add_rmsnorm(x, r, w, 1e-6)
                    q, s, ro2, _ = comm.fused_add_rmsnorm(x, r, w, 1e-6, quant="fp8_per_token")
                    good = (torch.equal(o, o_ref) and torch.equal(ro, ro_ref) and torch.equal(ro2, ro_ref)
                            and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
                            and torch.equal(s, s_ref))
                    ok &= good
                    bf = graph_time(lambda: comm.fused_add_rmsnorm(x, r, w, 1e-6))
                    f8 = graph_time(lambda: comm.fused_add_rmsnorm(x, r, w, 1e-6, quant="fp8_per_token"))
                    ar = graph_time(lambda: comm.all_reduce(x))
                emit(case="fused", algo=algo, H=H, T=T, exact=good, bf16_us=bf, fp8_us=f8, all_reduce_us=ar,
                     fp8_over_bf16=f8 / bf - 1)
    comm.close()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"dev_single{'_' + args.variant if args.variant else ''}.json"), "w") as f:
        json.dump(log, f, indent=1)
    dist.destroy_process_group()
    print("ALL EXACT" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
