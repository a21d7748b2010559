"""tpcomm's Inductor fusion pass on ``parallelize_module`` models (an MLP + RMSNorm block stack on a gloo
device mesh, CPU ranks): every all-reduce -> [residual add] -> RMSNorm [-> FP8 quantiser] site is rewritten
and counted, the output stays within eager tensor parallelism's error of the unsharded model, an unknown
norm runs unfused with a warning; the pass's chaining, cache key, refusals and groups. Hugging Face
models: ``tests/inductor/test_hf.py``.

Most cases compile with ``post_grad_eager`` (Inductor's passes, the graph then run op by op: the rewrite
is Inductor's, without a C++ build); one runs Inductor's code generation.
"""

import pytest
import torch

import tpcomm
from tests.inductor import ranks
from tests.support.numerics import Checks

#: The blocks of the stack that folds every FP8 quantiser (per token, per group with the norm's output
#: used beside it, static with it too), in both residual orders.
QUANTISED_BLOCKS = (("left", "token"), ("right", "group+out"), ("left", "static+out"))


def test_every_site_and_quantiser_is_rewritten_within_eager_error(pool2):
    """fp16, 2-D, ``nn.RMSNorm``: the input projection's site (its sum kept as the first residual) and a
    block per FP8 quantiser; each block's fused FP8 bytes and scales equal the standalone quantiser's of
    the fused output (contract item 4)."""
    results = pool2.run(ranks.stack_case, 11, "fp16", (5, 32), "module", blocks=QUANTISED_BLOCKS, timeout_s=300)
    expected = {"norm, sum kept": 1, "add+norm -> fp8_per_token (float8_e4m3fn)": 1,
                "add+norm -> fp8_per_group (float8_e4m3fn, group 16) (+ out)": 1,
                "add+norm -> fp8_static (float8_e4m3fn) (+ out)": 1}
    check = Checks()
    for r, got in enumerate(results):
        check.that(got["reports"] == [expected] and got["unfused"] == [0] and not got["warnings"],
                   f"rank {r}: rewrote {got['reports']}, expected {[expected]}:\n" + "\n".join(got["report_text"]))
        check.that(all(ranks.within_eager(e, "fp16") for e in got["errors"]),
                   f"rank {r}: errors against the unsharded model {got['errors']}")
        check.that(got["quant_same"] == [True, True], f"rank {r}: FP8 bytes and scales as the standalone "
                                                      f"quantiser's, per block showing them: {got['quant_same']}")
    check.done()


def test_inductor_code_generation_with_dynamic_tokens(pool2):
    """Inductor itself (C++ code generation on CPU): fp32, 3-D activations, ``torch.rms_norm`` called as a
    function, the first norm with no residual, one compilation (``dynamic=True``) for three token counts,
    every site rewritten (the report shows the symbolic token count)."""
    results = pool2.run(ranks.stack_case, 12, "fp32", (1, 5, 32), "function", keep_sum=False,
                        backend="inductor", dynamic_tokens=(3, 8), timeout_s=300)
    check = Checks()
    for r, got in enumerate(results):
        check.that(got["reports"] == [{"norm": 1, "add+norm": 2}],
                   f"rank {r}: one compilation expected, rewrote {got['reports']}:\n" + "\n".join(got["report_text"]))
        check.that(len(got["errors"]) == 3 and all(ranks.within_eager(e, "fp32") for e in got["errors"]),
                   f"rank {r}: errors against the unsharded model {got['errors']}")
    check.done()


def test_an_unknown_norm_runs_unfused_with_a_warning(pool2):
    """An RMSNorm written another way (a power -1/2): no site rewritten, a FusionWarning naming the
    all-reduces left as they were, and the compiled model's output is eager's."""
    results = pool2.run(ranks.stack_case, 13, "bf16", (5, 32), "unknown", timeout_s=300)  # 3 all-reduces
    for r, got in enumerate(results):
        assert got["reports"] == [{}] and got["unfused"] == [3], f"rank {r}: {got['report_text']}"
        assert len(got["warnings"]) == 1 and "no site was rewritten" in got["warnings"][0], got["warnings"]
        assert all(ranks.within_eager(e, "bf16") and e["vs_eager"] <= torch.finfo(torch.bfloat16).eps for e in
                   got["errors"]), f"rank {r}: {got['errors']}"


def test_chaining_cache_key_refusals_and_groups(pool2):
    for r, got in enumerate(pool2.run(ranks.pass_case, timeout_s=300)):
        assert all(got["checks"].values()), f"rank {r}: {got['checks']}\n{got['text']}"


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="comm must be a tpcomm.Communicator"):
        tpcomm.fusion_pass("world")
    with pytest.raises(ValueError, match="backend='cudagraphs'; expected one of inductor, post_grad_eager"):
        tpcomm.compile(torch.nn.Linear(2, 2), None, backend="cudagraphs")
    with pytest.raises(TypeError, match="comm must be a tpcomm.Communicator"):
        tpcomm.compile(torch.nn.Linear(2, 2), None)
