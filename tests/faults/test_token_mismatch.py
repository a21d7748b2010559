"""A peer whose call has another token count: another signature and another grid. Every rank must raise
``PeerMismatchError`` (a mismatch wins over a timeout of a program with no partner), for every op that
takes ``T``; and the rank with the smaller grid stores its call tag into the larger rank's tags of the
programs it does not have (``sync.tell_mismatch``), which is how those programs end at once on a GPU
(under the interpreter a rank's programs run in order, and later ones find the communicator broken)."""

import pytest
import torch

from tests.support.harness import new_communicator
from tests.support.numerics import raised

BF16 = torch.bfloat16
#: Rows on rank 0 and on rank 1.
ROWS = (5, 2)
CASES = [("all_reduce", "lamport"), ("all_reduce", "one_shot"), ("all_reduce", "two_shot"),
         ("fused_add_rmsnorm", "lamport"), ("fused_add_rmsnorm", "one_shot"), ("fp8_per_token", "lamport"),
         ("qk_norm", None), ("moe_finalize", "lamport")]


def _call(comm, op, T):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 64, generator=g).to(BF16)
    w = torch.ones(64, dtype=BF16)
    if op == "all_reduce":
        return comm.all_reduce(x)
    if op == "fused_add_rmsnorm":
        return comm.fused_add_rmsnorm(x, x.clone(), w, eps=1e-6)
    if op == "fp8_per_token":
        return comm.fused_add_rmsnorm(x, x.clone(), w, eps=1e-6, quant="fp8_per_token")
    if op == "qk_norm":
        return comm.fused_qk_rmsnorm(x, x[:, :16].contiguous(), w, w[:16])
    e, tw = torch.randn(T, 2, 64, generator=g).to(BF16), torch.full((T, 2), 0.5)
    return comm.fused_moe_finalize_add_rmsnorm(e, tw, x.clone(), w, eps=1e-6)


def mismatch_body(ctx, op, algo):
    """A fresh communicator; rank 0 calls with 5 rows, rank 1 with 2. Returns the error raised and, for
    the Lamport all-reduce on rank 0, the high words of its tags from rank 1 of the programs rank 1 does
    not have."""
    comm = new_communicator(timeout_s=20, algo=algo)
    try:
        ws = comm.workspace
        epoch = ws.epoch()
        got = raised(lambda: _call(comm, op, ROWS[ctx.rank]))
        torch.distributed.barrier()  # rank 1's programs have ended (and told) before rank 0 reads its tags
        tags = None
        if op == "all_reduce" and algo == "lamport" and ctx.rank == 0 and min(ROWS[0], ws.max_programs) > ROWS[1]:
            base = ws.flag_bytes + ws.data_bytes + ws.lamport_bytes
            n = 2 * ws.max_programs * ctx.world_size  # int64 tags [parity][program][sender]
            words = ws.buffer[base:base + 8 * n].view(torch.int64).view(2, ws.max_programs, ctx.world_size)
            low = (2 * epoch + 1) & 0xFFFFFFFF
            tags = [(int(t) >> 32, int(t) & 0xFFFFFFFF == low)
                    for t in words[epoch & 1, ROWS[1]:min(ROWS[0], ws.max_programs), 1]]
        return got, tags
    finally:
        comm.close()


@pytest.mark.parametrize("op,algo", CASES, ids=[f"{o}-{a or 'auto'}" for o, a in CASES])
def test_another_token_count_is_a_mismatch_on_every_rank(pool2, op, algo):
    results = pool2.run(mismatch_body, op, algo, timeout_s=120)
    for r, (got, tags) in enumerate(results):
        assert got is not None and got[0] == "PeerMismatchError", f"rank {r}: {got}"
        if tags is not None:  # rank 1's tag of this epoch, with its signature, in every unpartnered slot
            assert tags and all(high != 0 and low for high, low in tags), f"rank {r}: tags {tags}"
