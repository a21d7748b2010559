"""Rank body of tests/test_large_worlds.py: every op and algorithm on 4 and 8 CPU ranks."""

import torch

import tpcomm
from tpcomm import reference as R


def every_op_every_algorithm(rank: int, world_size: int) -> list[str]:
    """Fused (with and without residual, FP8 per token), all-reduce, all-gather and reduce-scatter under
    every algorithm, T = 5 rows (fewer than 8 ranks: some reduce-scatter shares are empty), bf16 and
    float32 (bf16 only on more than 4 ranks: 8 interpreted ranks on two cores cost a minute a dtype);
    returns what differs from the bit-exact reference (empty when everything is right)."""
    bad: list[str] = []
    dtypes = (torch.bfloat16, torch.float32) if world_size <= 4 else (torch.bfloat16,)
    with tpcomm.Communicator(timeout_s=60) as comm:
        for dtype in dtypes:
            T, H = 5, 40
            xs = [(torch.randn(T, H, generator=torch.Generator().manual_seed(q)) * 4).to(dtype)
                  for q in range(world_size)]
            r = torch.randn(T, H, generator=torch.Generator().manual_seed(99)).to(dtype)
            w = torch.randn(H, generator=torch.Generator().manual_seed(98)).to(dtype)
            s = R.reduce_in_rank_order(xs)
            out_ref, res_ref = R.add_rmsnorm_reference(s, r, w, 1e-6)
            q_ref, sc_ref = R.per_token_quant_reference(out_ref)
            for algo in ("lamport", "one_shot", "two_shot", "fallback"):
                if algo == "lamport" and dtype == torch.float32:
                    continue
                tag = f"{dtype} {algo}"
                with comm.use_algorithm(algo):
                    if not torch.equal(comm.all_reduce(xs[rank]), s):
                        bad.append(f"{tag}: all_reduce")
                    o, ro = comm.fused_add_rmsnorm(xs[rank], r, w, 1e-6)
                    if not (torch.equal(o, out_ref) and torch.equal(ro, res_ref)):
                        bad.append(f"{tag}: fused_add_rmsnorm")
                    q, sc, _, _ = comm.fused_add_rmsnorm(xs[rank], r, w, 1e-6, quant="fp8_per_token")
                    if not (torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sc, sc_ref)):
                        bad.append(f"{tag}: fused FP8")
                    if not torch.equal(comm.all_gather(xs[rank]), torch.cat(xs)):
                        bad.append(f"{tag}: all_gather")
                    if not torch.equal(comm.reduce_scatter(xs[rank]), torch.tensor_split(s, world_size)[rank]):
                        bad.append(f"{tag}: reduce_scatter")
        comm.check()
    return bad


def past_hoisted_ranks(rank: int, world_size: int) -> list[str]:
    """More ranks than the kernels load address-table entries for at their start
    (``kernels.sync.HOISTED_RANKS``): those kernels load each entry where they use it. All-reduce under
    every kernel algorithm, the fused op under Lamport and one-shot, the all-gather; T = 3 x 24 bf16.
    Returns what differs from the bit-exact reference."""
    bad: list[str] = []
    with tpcomm.Communicator(timeout_s=120) as comm:
        T, H = 3, 24
        xs = [(torch.randn(T, H, generator=torch.Generator().manual_seed(q)) * 4).to(torch.bfloat16)
              for q in range(world_size)]
        r = torch.randn(T, H, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
        w = torch.randn(H, generator=torch.Generator().manual_seed(98)).to(torch.bfloat16)
        s = R.reduce_in_rank_order(xs)
        out_ref, res_ref = R.add_rmsnorm_reference(s, r, w, 1e-6)
        for algo in ("lamport", "one_shot", "two_shot"):
            with comm.use_algorithm(algo):
                if not torch.equal(comm.all_reduce(xs[rank]), s):
                    bad.append(f"{algo}: all_reduce")
                if algo != "two_shot":
                    o, ro = comm.fused_add_rmsnorm(xs[rank], r, w, 1e-6)
                    if not (torch.equal(o, out_ref) and torch.equal(ro, res_ref)):
                        bad.append(f"{algo}: fused_add_rmsnorm")
        if not torch.equal(comm.all_gather(xs[rank]), torch.cat(xs)):
            bad.append("all_gather")
        comm.check()
    return bad
