"""Rank bodies of ``tests/test_models.py``: Hugging Face models sharded over tpcomm against the same
model unsharded, on CPU ranks (each rank builds the same seeded model and computes the reference
itself)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from tpcomm.models import demo


def small(model: str, world: int, dtype: str = "float32", steps: int = 3) -> demo.ModelDemoConfig:
    """A small model of ``model``'s kind whose heads and MLP divide by ``world``: two layers of 64-wide
    heads (``2 W`` of them, ``W`` key-value heads)."""
    heads = 2 * world
    return replace(demo.ModelDemoConfig(model=model, dtype=dtype, steps=steps), layers=2, heads=heads,
                   kv_heads=world, hidden=64 * heads, intermediate=96 * world, vocab=256, prompt=5)


def sharded_case(ctx, model: str, dtype: str) -> dict:
    """Greedy decoding with the shard against the unsharded model: ``demo.run_rank``'s report."""
    return demo.run_rank(ctx.rank, ctx.world_size, small(model, ctx.world_size, dtype))


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
    from numerics import raised

    import tpcomm
    from tpcomm.models import shard

    cfg = small("llama", ctx.world_size)
    if what == "heads":
        cfg = replace(cfg, heads=ctx.world_size + 1, kv_heads=ctx.world_size + 1, hidden=64 * (ctx.world_size + 1))
    elif what == "intermediate":
        cfg = replace(cfg, intermediate=96 * ctx.world_size + 1)
    m = demo.make_model(cfg)
    with tpcomm.Communicator() as comm:
        return raised(lambda: shard(m, comm))
