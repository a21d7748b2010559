"""Hugging Face transformers' own tensor parallelism (``DistributedConfig(tp_size=2)``: the model's
``base_model_tp_plan``, a vocabulary-parallel embedding) compiled with tpcomm's fusion pass, unchanged, on
two CPU ranks: a Llama (the hand-written HF norm: 2 add+norm sites per decoder layer, and the embedding's
all-reduce before the first norm, whose sum is the first residual) and a Gemma 3 (``1 + w`` norms after
each projection, with no residual: 2 norm sites per layer; its embedding is scaled before any norm, so
its all-reduce stays). Small random-weight models built from a config and saved in a temporary
directory (no network); logits against the unsharded model in float64, within eager tensor
parallelism's error.
"""

import pytest
import torch

from tests.inductor import ranks
from tests.support.numerics import Checks

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' tensor-parallel loading needs it

LAYERS = 2
#: Expected rewrites per family: 2 per decoder layer, plus the embedding's site where a norm follows it.
EXPECTED = {"llama": ({"norm, sum kept": 1, "add+norm": 2 * LAYERS}, 0),
            "gemma3": ({"norm": 2 * LAYERS}, 1)}


def _config(family: str):
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **sizes, sliding_window=16, layer_types=["sliding_attention", "full_attention"]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{family: path}`` of each model saved with random weights; norm weights moved off their initial
    value (ones, zeros for Gemma) so that the norms' weights take part in the comparison."""
    paths = {}
    for family in EXPECTED:
        torch.manual_seed(0)
        model = _config(family)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.25 * torch.randn_like(p))
        paths[family] = str(tmp_path_factory.mktemp(family))
        model.save_pretrained(paths[family])
    return paths


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("family", list(EXPECTED))
def test_hf_tensor_parallel_model_gets_fused_sites(pool2, saved, family, dtype_name):
    counts, unfused = EXPECTED[family]
    results = pool2.run(ranks.hf_case, saved[family], dtype_name, timeout_s=300)
    print(f"{family} {dtype_name}: logits' relative max error against the unsharded model: eager TP "
          f"{results[0]['eager']:.2g}, compiled with the pass {results[0]['compiled']:.2g}; {results[0]['counts']}")
    check = Checks()
    for r, got in enumerate(results):
        check.that(got["graphs"] == 1 and got["counts"] == counts and len(got["unfused"]) == unfused,
                   f"rank {r}: expected {counts} and {unfused} unfused:\n{got['text']}")
        check.that(ranks.within_eager(got, dtype_name), f"rank {r}: logits' errors against the unsharded model: "
                                                  f"eager {got['eager']:.3g}, compiled {got['compiled']:.3g}")
    check.done()
