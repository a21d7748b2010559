"""Hugging Face ``transformers`` models sharded over tpcomm (``tpcomm.models``) on CPU ranks: Llama,
Gemma 3 (the ``(1 + w)`` norm) and MiniMax-M2 (the full-width QK norm, the experts sharded), 2 and 3
ranks, and the fused calls each decoder layer makes. Skipped without ``transformers`` (the ``hf``
extra)."""

import pytest

pytest.importorskip("transformers")

from tests.support.numerics import Checks  # noqa: E402
from tests.tools import ranks  # noqa: E402

#: The communicator calls of one decoder layer in one forward pass, per model: Llama's two partial sums
#: each with its residual add and next norm, Gemma's two with their post-norms, MiniMax-M2's QK norm, the
#: attention's partial sum with ``post_attention_layernorm``, and the experts' finalize with the next norm.
LAYER_CALLS = {"llama": {"fused_add_rmsnorm": 2}, "gemma": {"fused_add_rmsnorm": 2},
               "minimax_m2": {"fused_qk_rmsnorm": 1, "fused_add_rmsnorm": 1, "fused_moe_finalize_add_rmsnorm": 1}}


@pytest.mark.parametrize("model,world", [("llama", 2), ("llama", 3), ("gemma", 2), ("gemma", 3), ("minimax_m2", 2),
                                         ("minimax_m2", 3), ("minimax_m2", 4)])
def test_sharded_decoding_equals_the_unsharded_model(pools, model, world):
    """Prefill and greedy decode steps with the KV cache: float32 tokens equal the unsharded model's,
    logits within float32 rounding of the reordered sums, the same tokens on every rank, and every layer
    made its fused calls (one forward pass each: no other collective, none outside the layers)."""
    check = Checks()
    expected = [(layer, LAYER_CALLS[model]) for layer in range(ranks.small(model, world).layers)]
    for r, res in enumerate(pools.get(world).run(ranks.sharded_case, model, "float32")):
        check.that(res["kernels"], f"rank {r}: the communicator fell back")
        check.that(res["same_on_ranks"], f"rank {r}: tokens differ between ranks")
        check.that(res["tokens"] == res["ref_tokens"], f"rank {r}: tokens {res['tokens']} != {res['ref_tokens']}")
        check.that(res["logit_error"] <= 1e-4 * max(1.0, res["logit_scale"]),
                   f"rank {r}: logits off by {res['logit_error']:.3g} (of {res['logit_scale']:.3g})")
        calls = [(layer, ops) for layer, ops in res["calls"]]
        check.that(calls == expected, f"rank {r}: calls per layer and pass {calls}, expected {expected}")
    check.done()


@pytest.mark.parametrize("world,kv_heads,layers", [(4, 2, 1), (8, 4, 1)])
def test_minimax_with_more_ranks_than_kv_heads(pools, world, kv_heads, layers):
    """MiniMax-M2 with W / kv_heads ranks holding each key-value head (its k_proj, v_proj rows and k_norm
    slice replicated, the QK norm told kv_replicas): float32 tokens equal the unsharded model's, logits
    within float32 rounding, the same tokens on every rank, the same fused calls a layer as without
    replication. One layer; 8 ranks two steps (the interpreter's time; tests/tools/test_speculative.py
    decodes 4 ranks with 2 key-value heads and two layers)."""
    check = Checks()
    expected = [(layer, LAYER_CALLS["minimax_m2"]) for layer in range(layers)]
    steps = 3 if world < 8 else 2
    for r, res in enumerate(pools.get(world).run(ranks.sharded_case, "minimax_m2", "float32", kv_heads, layers,
                                                 steps)):
        check.that(res["kernels"] and res["same_on_ranks"], f"rank {r}: fell back or tokens differ between ranks")
        check.that(res["tokens"] == res["ref_tokens"], f"rank {r}: tokens {res['tokens']} != {res['ref_tokens']}")
        check.that(res["logit_error"] <= 1e-4 * max(1.0, res["logit_scale"]),
                   f"rank {r}: logits off by {res['logit_error']:.3g} (of {res['logit_scale']:.3g})")
        check.that(res["calls"] == expected, f"rank {r}: calls {res['calls']}, expected {expected}")
    check.done()


@pytest.mark.parametrize("model", ["llama", "gemma"])
def test_bf16_tokens_are_the_same_on_every_rank(pool2, model):
    for r, res in enumerate(pool2.run(ranks.sharded_case, model, "bfloat16")):
        assert res["same_on_ranks"] and res["kernels"], f"rank {r}: {res}"


@pytest.mark.parametrize("model", ["llama", "gemma", "minimax_m2"])
def test_one_forward_pass_matches_and_leaves_the_model_whole(pool2, model):
    for r, res in enumerate(pool2.run(ranks.prefill_logits_case, model)):
        assert res["error"] <= 1e-4 * max(1.0, res["scale"]), f"rank {r}: {res}"
        assert res["same_bits"] and res["original_untouched"], f"rank {r}: {res}"


@pytest.mark.parametrize("what,word", [("heads", "num_attention_heads"), ("intermediate", "intermediate_size"),
                                       ("minimax_experts", "intermediate_size"),
                                       ("minimax_kv_heads", "num_key_value_heads = 3")])
def test_a_model_that_does_not_divide_is_refused(pool2, what, word):
    for r, res in enumerate(pool2.run(ranks.refused_case, what)):
        assert res is not None and res[0] == "ShardingError" and word in res[1], f"rank {r}: {res}"


@pytest.mark.parametrize("model", ["llama", "gemma"])
def test_the_static_cache_loop_decodes_as_generate_does(model):
    """The loop that decodes loopback ranks one step at a time (``models.demo.static_decode``: a static
    KV cache, no host read inside a step; eagerly here, as CUDA graphs need a GPU) gives the unsharded
    model's tokens and logits of ``generate``, Gemma's sliding window (filled half-way on CPU) included."""
    import torch

    from tpcomm.models import demo

    cfg = ranks.small(model, 2, steps=4)
    m = demo.make_model(cfg)
    prompt = torch.randint(3, cfg.vocab, (1, cfg.prompt), generator=torch.Generator().manual_seed(1))
    tokens, logits = demo.greedy(m, prompt, cfg.steps)
    [(lt, ll)] = demo.static_decode([m], prompt, cfg.steps, lambda step: step(0))
    assert torch.equal(lt, tokens), f"static-cache tokens {lt.tolist()}, generate's {tokens.tolist()}"
    assert torch.allclose(ll, logits, rtol=0, atol=1e-5), float((ll - logits).abs().max())


def test_graph_safe_refuses_sliding_window_layers():
    """A CUDA graph of one decode step is replayed only for models without sliding-window layers (their
    static cache keeps host-side state a graph would freeze): Gemma decodes eagerly, Llama in a graph."""
    from tpcomm.models import demo

    gemma = demo.make_model(ranks.small("gemma", 2, steps=4))
    llama = demo.make_model(ranks.small("llama", 2, steps=4))
    assert not demo.graph_safe(gemma.config) and demo.graph_safe(llama.config)


MAKE_MODEL = """
from dataclasses import replace
from tpcomm.models import demo
demo.make_model(replace(demo.ModelDemoConfig(model="llama", dtype="float32", steps=2), layers=1))
print("MADE")
"""


def test_the_demo_model_loads_without_other_libraries_warnings():
    """Making the demo's model in a fresh process prints nothing but what the demo prints: no torchao
    "Failed to load" lines, no torch pytree deprecation warnings (``demo.QUIET_LOGGERS``), where those
    libraries are installed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", MAKE_MODEL], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0 and proc.stdout.strip() == "MADE", proc.stdout + proc.stderr[-3000:]
    assert "Failed to load" not in proc.stderr and "deprecated" not in proc.stderr, proc.stderr[-3000:]
