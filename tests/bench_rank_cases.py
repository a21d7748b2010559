"""Rank functions of tests/test_bench_cpu_ranks.py (run by the CPU rank pool, tests/harness.py)."""

from tpcomm.bench import contenders as contenders_mod, rank as bench_rank
from tpcomm.bench.contenders.base import Bound, Contender


class OffByOne(Contender):
    """An all-reduce that forgets the last rank: must fail its check and not be timed."""

    name = "nccl"  # borrows a known name so the summary has a label for it
    label = "broken"
    library = "test"
    ops = ("all_reduce",)

    def bind(self, case, slots, ctx):
        import torch.distributed as dist

        def call(k):
            y = slots.x[k].clone()
            dist.all_reduce(y)
            return y - (slots.x[k] if case.rank == case.world_size - 1 else 0)
        return Bound(call=call, outputs=lambda r: {"sum": r})


def sweep(ctx, cfg, broken: bool = False):
    """``tpcomm.bench.rank.run_rank`` on this pool rank (eager mode on gloo); ``broken`` swaps NCCL for
    :class:`OffByOne`."""
    if not broken:
        return bench_rank.run_rank(ctx.rank, ctx.world_size, cfg)
    make = contenders_mod.make
    contenders_mod.make = lambda names=None: [contenders_mod.Tpcomm(), OffByOne()]
    try:
        return bench_rank.run_rank(ctx.rank, ctx.world_size, cfg)
    finally:
        contenders_mod.make = make
