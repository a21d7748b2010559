"""``tpcomm.models.moe.TensorParallelSparseMoe`` on CPU ranks against the unsharded Hugging Face
``MiniMaxM2SparseMoeBlock`` in float32: the sharded block's ``residual_out`` and ``out`` equal the
block's output plus the residual and its RMSNorm within float32 rounding, every rank routes alike and
holds the same bits, and both layouts of the expert outputs give the same bits. Rank bodies sit here."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.minimax_m2.modeling_minimax_m2")

#: float32 tolerance: the sharded sums (intermediate columns split over ranks, K experts, ranks) are
#: reordered float32 sums of O(1) terms: a few float32 ulps of values of magnitude ~1 (2**-23 ~ 1.2e-7).
RTOL, ATOL = 2e-5, 2e-5


def _block(seed: int):
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm, MiniMaxM2SparseMoeBlock

    cfg = MiniMaxM2Config(hidden_size=96, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                          rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    block = MiniMaxM2SparseMoeBlock(cfg).eval()
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.2)
        block.experts.gate_up_proj.normal_(0, 0.2)
        block.experts.down_proj.normal_(0, 0.2)
        block.e_score_correction_bias.normal_(0, 0.05)
    norm = MiniMaxM2RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    return block, norm


def _stand_in(block):
    """What :class:`TensorParallelSparseMoe` reads of ``block``, picklable without transformers (the ranks
    then never import it: about 15 s each on a busy 2-core machine). MiniMax-M2's ``silu`` is transformers'
    ``SiLUActivation``, ``torch.nn.functional.silu``: ``torch.nn.SiLU`` here."""
    from types import SimpleNamespace

    assert type(block.experts.act_fn).__name__ in ("SiLU", "SiLUActivation")
    experts = SimpleNamespace(intermediate_dim=block.experts.intermediate_dim, act_fn=torch.nn.SiLU(),
                              gate_up_proj=block.experts.gate_up_proj.detach(),
                              down_proj=block.experts.down_proj.detach())
    return SimpleNamespace(experts=experts, top_k=block.top_k, gate=SimpleNamespace(weight=block.gate.weight.detach()),
                           e_score_correction_bias=block.e_score_correction_bias.detach())


def moe_block_case(ctx, block, x, residual, norm_weight, eps) -> dict:
    from tpcomm.models.moe import TensorParallelSparseMoe

    comm = ctx.comm()
    got = {}
    with torch.no_grad():
        for layout in ("token", "permuted"):
            tp = TensorParallelSparseMoe(block, comm, layout=layout)
            got[layout] = tp(x, residual, norm_weight, eps)
        got["index"] = tp.route(x.view(-1, x.shape[-1]))[1]
    return got


@pytest.mark.parametrize("world, tokens", [(2, 5), (3, 1), (4, 7)])
def test_sharded_block_matches_hf(pools, world, tokens):
    block, norm = _block(11 + world)
    g = torch.Generator().manual_seed(world)
    x = torch.randn((1, tokens, 96), generator=g)
    residual = torch.randn((1, tokens, 96), generator=g)
    with torch.no_grad():
        ref_ro = residual + block(x)
        ref_out = norm(ref_ro)
    results = pools.get(world).run(moe_block_case, _stand_in(block), x, residual, norm.weight.detach(),
                                   norm.variance_epsilon)
    for r, res in enumerate(results):
        out, ro = res["token"]
        torch.testing.assert_close(ro, ref_ro, rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {r} residual_out: {m}")
        torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {r} out: {m}")
        for a, b in zip(res["permuted"], res["token"]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"rank {r}: the layouts differ"
        assert torch.equal(res["index"], results[0]["index"]), f"rank {r} routes otherwise than rank 0"
        for a, b in zip(res["token"], results[0]["token"]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"rank {r}'s bits differ from rank 0's"


def model_layouts_case(ctx) -> dict:
    """One forward pass of the small demo MiniMax-M2 sharded with each layout of the expert outputs."""
    import tpcomm
    from tests.tools import ranks
    from tpcomm.models import demo
    from tpcomm.models.minimax_m2 import shard

    m = demo.make_model(ranks.small("minimax_m2", ctx.world_size))
    ids = torch.randint(3, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), tpcomm.Communicator() as comm:
        return {layout: shard(m, comm, layout=layout)(input_ids=ids).logits for layout in ("token", "permuted")}


def test_the_sharded_model_gives_the_same_bits_with_either_layout(pool2):
    """``minimax_m2.shard(..., layout=...)``: the whole model through the experts' permuted order gives the
    bits of the token order, on every rank."""
    for r, res in enumerate(pool2.run(model_layouts_case)):
        assert torch.equal(res["permuted"].view(torch.int32), res["token"].view(torch.int32)), f"rank {r}"
