"""Rank bodies of the tools' tests, run by the CPU rank pool as ``fn(ctx, *args)``: the bench sweep
(``tests/tools/test_bench_cpu_ranks.py``), ``tpcomm tune``'s sweep (``tests/tools/test_tune.py``), the soak
(``tests/tools/test_soak.py``) and Hugging Face models sharded over tpcomm (``tests/tools/test_models.py``).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist

from tests.support.harness import new_communicator
from tpcomm import soak
from tpcomm.bench import contenders as contenders_mod, rank as bench_rank
from tpcomm.bench.contenders.base import Bound, Contender
from tpcomm.models import demo
from tpcomm.tune.config import TuneConfig
from tpcomm.tune.rank import measure


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


def tiny_sweep(ctx, cfg: TuneConfig) -> dict:
    """The sweep of ``cfg`` on this rank in eager mode; graph mode must be refused on CPU ranks first
    (before anything collective)."""
    comm = ctx.comm()
    try:
        measure(comm, cfg, graph=True)
        refused = None
    except ValueError as e:
        refused = str(e)
    result = measure(comm, cfg, graph=False, show_progress=False)
    result["graph_refused"] = refused
    return result


def plans_with_table(ctx, path: str, probes: list) -> list:
    """A new communicator with ``TPCOMM_DISPATCH_TABLE=path``: the algorithm it plans for each
    ``(op, nbytes, hidden)`` of ``probes`` (bf16), and the table it loaded (as JSON)."""
    comm = new_communicator(env={"TPCOMM_DISPATCH_TABLE": path})
    try:
        plans = [comm.plan(op, n, h, torch.bfloat16).algorithm for op, n, h in probes]
        return [plans, comm.table.to_json()]
    finally:
        comm.close()


class _Wrapped:
    """A Communicator whose ``method`` misbehaves on its kernel call ``at`` (0-based, counting the calls of
    ``method`` that run a kernel) on rank ``rank``: ``corrupt`` adds 1 to the result, ``skip`` returns a
    result without making the call, ``corrupt_q`` (counting only calls with a ``quant`` form) flips the
    lowest bit of the first quantised byte. (Skipping a call that goes through ``torch.distributed`` would
    leave the peers' gloo collectives unmatched: a deadlock of the test harness, not of tpcomm.)"""

    def __init__(self, comm, method: str, at: int, rank: int, how: str):
        self._comm, self._method, self._at, self._rank, self._how = comm, method, at, rank, how
        self._count = 0

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name != self._method:
            return attr

        def call(x, *args, **kwargs):
            plan = self._comm.plan(name, x.numel() * x.element_size(), x.shape[-1], x.dtype)
            if plan.algorithm == "fallback" or self._how == "corrupt_q" and kwargs.get("quant") is None:
                return attr(x, *args, **kwargs)
            i, self._count = self._count, self._count + 1
            if i != self._at or self._comm.rank != self._rank:
                return attr(x, *args, **kwargs)
            if self._how == "skip":
                return torch.zeros_like(x)
            if self._how == "corrupt_q":
                q, *rest = attr(x, *args, **kwargs)
                q.view(torch.uint8).view(-1)[0] ^= 1
                return (q, *rest)
            return attr(x, *args, **kwargs) + 1
        return call


def _make_comms(cfg, method, at, rank, how):
    default, small = soak.default_make_comms(cfg)
    return [_Wrapped(default, method, at, rank, how), small]


def pool_soak(ctx, cfg_kwargs: dict, fault: tuple | None = None) -> dict:
    """``soak.soak_rank`` on this pool rank with ``soak.make_config("cpu", ...)``; ``fault`` is
    ``(method, at, rank, how)`` for the default communicator (see ``_Wrapped``), or None."""
    cfg = soak.make_config("cpu", ctx.world_size, **cfg_kwargs)
    make = functools.partial(_make_comms, method=fault[0], at=fault[1], rank=fault[2], how=fault[3]) if fault \
        else None
    return soak.soak_rank(ctx.rank, ctx.world_size, cfg, make_comms=make)


def small(model: str, world: int, dtype: str = "float32", steps: int = 3,
          kv_heads: int | None = None) -> demo.ModelDemoConfig:
    """A small model of ``model``'s kind whose heads and MLP divide by ``world``: two layers of 64-wide
    heads (``2 W`` of them, ``W`` key-value heads unless ``kv_heads`` says otherwise)."""
    heads = 2 * world
    return replace(demo.ModelDemoConfig(model=model, dtype=dtype, steps=steps), layers=2, heads=heads,
                   kv_heads=kv_heads or world, hidden=64 * heads, intermediate=96 * world, vocab=256, prompt=5)


def sharded_case(ctx, model: str, dtype: str, kv_heads: int | None = None, layers: int = 2, steps: int = 3) -> dict:
    """Greedy decoding with the shard against the unsharded model: ``demo.run_rank``'s report."""
    cfg = replace(small(model, ctx.world_size, dtype, steps=steps, kv_heads=kv_heads), layers=layers)
    return demo.run_rank(ctx.rank, ctx.world_size, cfg)


def speculative_case(ctx, k: int, steps: int, layers: int = 2, kv_heads: int | None = None) -> dict:
    """Speculative decoding of the sharded MiniMax-M2 with its draft: ``speculative_demo.run_rank``'s report."""
    from tpcomm.models import speculative_demo

    cfg = replace(small("minimax_m2", ctx.world_size, steps=steps, kv_heads=kv_heads), layers=layers)
    return speculative_demo.run_rank(ctx.rank, ctx.world_size, cfg, k)


def prefill_logits_case(ctx, model: str) -> dict:
    """One forward pass over a prompt (no cache): the shard's logits against the unsharded model's, and
    whether every rank's logits have the same bits."""
    import tpcomm
    from tpcomm.models import shard

    cfg = small(model, ctx.world_size)
    m = demo.make_model(cfg)
    ids = torch.randint(3, cfg.vocab, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        ref = m(input_ids=ids).logits
        with tpcomm.Communicator() as comm:
            got = shard(m, comm)(input_ids=ids).logits
            everyone = [torch.empty_like(got) for _ in range(ctx.world_size)]
            dist.all_gather(everyone, got.contiguous())
    return dict(error=float((got - ref).abs().max()), scale=float(ref.abs().max()),
                same_bits=all(torch.equal(e.view(torch.int32), everyone[0].view(torch.int32)) for e in everyone),
                original_untouched=m.model.layers[0].self_attn.q_proj.weight.shape[0] == cfg.heads * 64)


def refused_case(ctx, what: str):
    """``shard`` of a model that cannot be split over this many ranks: ``(type, message)`` raised."""
    import tpcomm
    from tests.support.numerics import raised
    from tpcomm.models import shard

    cfg = small("minimax_m2" if what.startswith("minimax") else "llama", ctx.world_size)
    if what == "heads":
        cfg = replace(cfg, heads=ctx.world_size + 1, kv_heads=ctx.world_size + 1, hidden=64 * (ctx.world_size + 1))
    elif what == "intermediate":
        cfg = replace(cfg, intermediate=96 * ctx.world_size + 1)
    elif what == "minimax_experts":  # the experts' intermediate size is half the config's (make_model)
        cfg = replace(cfg, intermediate=96 * ctx.world_size + 2)
    elif what == "minimax_kv_heads":  # 3: neither divisible by 2 ranks nor dividing 2
        cfg = replace(cfg, heads=6 * ctx.world_size, kv_heads=3, hidden=64 * 6 * ctx.world_size)
    m = demo.make_model(cfg)
    with tpcomm.Communicator() as comm:
        return raised(lambda: shard(m, comm))


def demo_rows(ctx, quick: bool = True) -> list:
    """``tpcomm demo``'s rows of this rank (its communicator is its own, as under ``tpcomm.launch``)."""
    from tpcomm import demo as ops_demo

    return ops_demo.run_rank(ctx.rank, ctx.world_size, ops_demo.make_config("cpu", ctx.world_size, quick))
