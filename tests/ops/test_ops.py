"""``tpcomm.ops`` (custom ops, registry, wrappers) and ``tpcomm.graphs`` (warm-up, capture guard).

Schema and fake-implementation tests run in the test process (no ranks: fake and meta tensors never
reach a communicator); the rest runs on the CPU rank pools.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tpcomm.graphs as tgraphs
import tpcomm.ops as tops
from tests.ops import ranks
from tests.support.numerics import Checks

OPS = ("all_reduce", "all_reduce_out", "fused_add_rmsnorm")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# -- registration and schemas ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", OPS)
def test_ops_are_registered_in_the_tpcomm_namespace(name):
    op = getattr(torch.ops.tpcomm, name).default
    assert op._schema.name == f"tpcomm::{name}"
    assert op._schema.arguments[0].name == "handle" and str(op._schema.arguments[0].type) == "int"


def test_only_all_reduce_out_mutates_and_only_out():
    """Mutation and aliasing as declared to torch: ``all_reduce_out`` writes ``out`` and returns
    nothing; the other ops write no argument and return new tensors."""
    written = {name: [a.name for a in getattr(torch.ops.tpcomm, name).default._schema.arguments
                      if a.alias_info is not None and a.alias_info.is_write] for name in OPS}
    assert written == {"all_reduce": [], "all_reduce_out": ["out"], "fused_add_rmsnorm": []}
    assert len(torch.ops.tpcomm.all_reduce_out.default._schema.returns) == 0
    for name in ("all_reduce", "fused_add_rmsnorm"):
        assert all(r.alias_info is None for r in getattr(torch.ops.tpcomm, name).default._schema.returns)


# -- fake implementations ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,transpose", [((3, 5), False), ((3, 5), True), ((2, 3, 8), False), ((7,), False),
                                             ((0, 4), False)])
def test_fake_all_reduce_gives_a_contiguous_tensor_like_x(dtype, shape, transpose):
    """As the real op: ``empty_like(x, contiguous)`` (a transposed x gives a contiguous output)."""
    with FakeTensorMode():
        x = torch.empty(shape, dtype=dtype)
        if transpose:
            x = x.t()
        y = torch.ops.tpcomm.all_reduce(12345, x)  # the handle is never looked up by the fake
        assert (y.shape, y.dtype, y.device) == (x.shape, x.dtype, x.device)
        assert y.is_contiguous()
        assert torch.ops.tpcomm.all_reduce_out(12345, x, torch.empty_like(x)) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_fake_fused_add_rmsnorm_gives_one_or_two_outputs(dtype, with_residual):
    with FakeTensorMode():
        x = torch.empty(4, 3, 16, dtype=dtype)
        res = torch.empty_like(x) if with_residual else None
        outs = torch.ops.tpcomm.fused_add_rmsnorm(12345, x, res, torch.empty(16, dtype=torch.float32), 1e-6, True)
        assert len(outs) == (2 if with_residual else 1)
        for t in outs:
            assert (t.shape, t.dtype, t.device) == (x.shape, x.dtype, x.device) and t.is_contiguous()


def test_ops_run_on_meta_tensors_through_the_fake_implementations():
    x = torch.empty(3, 8, device="meta", dtype=torch.bfloat16)
    assert torch.ops.tpcomm.all_reduce(1, x).device.type == "meta"
    outs = torch.ops.tpcomm.fused_add_rmsnorm(1, x, x, torch.empty(8, device="meta"), 1e-6, False)
    assert [t.shape for t in outs] == [x.shape, x.shape]


# -- argument errors without ranks ------------------------------------------------------------------------
def test_register_and_lookup_refuse_bad_arguments():
    with pytest.raises(TypeError, match="comm must be a tpcomm.Communicator or an int handle"):
        tops.register("not a communicator")
    with pytest.raises(TypeError, match="handle"):
        tops.lookup(1.0)
    with pytest.raises(TypeError, match="handle"):
        tops.lookup(True)
    with pytest.raises(LookupError, match="handle 987654"):
        tops.lookup(987654)
    assert tops.handle_of(7) == 7  # an int is taken as a handle


def test_graph_helpers_refuse_bad_arguments():
    with pytest.raises(ValueError, match="capture_guard"):
        tgraphs.capture_guard().__enter__()
    with pytest.raises(TypeError, match=r"comms\[0\]"):
        tgraphs.capture_guard(object()).__enter__()
    with pytest.raises(ValueError, match="unknown ops"):
        tgraphs.warmup(None, [(1, 8)], ops=("all_reduce", "all_gather_twice"))


# -- on ranks ---------------------------------------------------------------------------------------------
# bf16 on 2 ranks, fp32 on 3 (each wrapper runs about 20 calls under the interpreter: one world size each)
@pytest.mark.parametrize("world,shape,dtype", [(2, (2, 40), "bfloat16"), (3, (2, 24), "float32")],
                         ids=["w2-bf16-2x40", "w3-fp32-2x24"])
def test_wrappers_match_the_communicator_methods(pools, world, shape, dtype):
    """Each wrapper (all_reduce new / out / in place, fused with and without residual, Gemma, the FP8
    forms, all_gather and reduce_scatter along dims 0 and -1 with rows not divisible by 3) gives the
    method's bits (and strides) on the same inputs, writes every element of a NaN-filled ``out``, leaves
    its inputs alone."""
    results = pools.get(world).run(ranks.wrappers_match_methods, 2200, shape, dtype)
    check = Checks()
    for r, got in enumerate(results):
        for name, ok in got.items():
            check.that(ok, f"rank {r}: {name} differs from the method (or its inputs changed)")
    check.done()


def test_opcheck(pool2):
    """``torch.library.opcheck`` (schema, fake against real, autograd registration, AOT dispatch with
    static and dynamic shapes) on every op."""
    results = pool2.run(ranks.opcheck_case)
    failures = [f"rank {r}, {name}:\n{err}" for r, rep in enumerate(results) for name, err in rep.items() if err]
    assert not failures, "\n".join(failures)


def test_registry_handles(pool2):
    """Stable and distinct handles, never reused; a closed communicator's handle raises its
    RuntimeError, a garbage-collected one's LookupError; an int handle works as the communicator; a
    bad input through an op raises the communicator's ValueError and the ranks stay in step."""
    results = pool2.run(ranks.registry_case)
    W = pool2.world_size
    for r, got in enumerate(results):
        assert got["h1"] == got["h1_again"] and len({got["h1"], got["h2"], got["h3"]}) == 3, got
        assert got["h3"] > got["h2"] > got["h1"] >= 1  # new handles only: never a reused one
        assert torch.equal(got["by_handle"], torch.full((2, 8), float(sum(range(1, W + 1)))))
        assert got["closed"] is not None and got["closed"][0] == "RuntimeError" and "closed" in got["closed"][1]
        assert got["gone"] == ("LookupError", got["gone"][1]) and f"handle {got['h2']}" in got["gone"][1]
        assert got["bad_weight"][0] == "ValueError" and "weight" in got["bad_weight"][1]
        assert got["fp8_option_without_quant"][0] == "ValueError" and "group_size" in got["fp8_option_without_quant"][1]
        # after: the sum plus the residual (this rank's x)
        assert torch.equal(got["after"], torch.full((2, 8), float(sum(range(1, W + 1)) + r + 1)))
        assert got["bad_register"][0] == "TypeError" and got["bad_handle"][0] == "TypeError"


def test_warmup_records_signatures_and_guard_on_cpu(pool2):
    """warmup makes one call per (shape, dtype, op) and records each signature; the same signature
    with new tensors counts as warmed, another shape does not. capture_guard enters and leaves on
    CPU ranks (nothing is captured there) and refuses a closed communicator."""
    results = pool2.run(ranks.warmup_case, [(2, 32), (1, 32)])
    for got in results:
        assert got["calls"] == 6 and got["count"] == 6, got
        assert got["seen"] == {"all_reduce": True, "fused": True, "fused_no_res": True, "other_shape": False}
        assert got["guard"] and got["inside"]
        assert got["closed"][0] == "ValueError" and "closed" in got["closed"][1]


def test_warmup_covers_every_op(pool2):
    """Every op of tpcomm.ops can be warmed up, the FP8 forms and the gathers included: one call and one
    recorded signature each; a static scale of another shape than the warm-up's is the same signature."""
    results = pool2.run(ranks.warmup_case, [(2, 128)], tgraphs.WARMUP_OPS, topk=2)
    for got in results:
        n = len(tgraphs.WARMUP_OPS)  # moe_finalize is local: no communicator, no signature
        assert got["calls"] == n and got["count"] == n - 1, got
        assert got["scale_shapes"] == 0, f"scales of shape () and (1, 1) added {got['scale_shapes']} signatures"


def test_warmup_qk_norm_and_moe(pool2):
    """warmup of the QK norm (q's width from the shape, k's from k_width) and the MoE ops (topk, the
    permuted layout, a shared output): a model's later calls of those shapes through the ops, with new
    tensors and another scaling, add no signature (the capture guard accepts them); another k width, K
    or layout does. Without topk, or with a shape not (T, H), warmup refuses."""
    for got in pool2.run(ranks.warmup_qk_moe_case):
        assert got["calls"] == 6 and got["count"] == 4, got  # moe_finalize records no signature
        assert got["qk"] == [0, 0] and got["moe"] == [0, 0], got
        assert got["qk_other_k"] == 1 and got["moe_other_K"] == 1 and got["moe_token_order"] == 1, got
        assert got["no_topk"][0] == "ValueError" and "topk" in got["no_topk"][1]
        assert got["not_2d"][0] == "ValueError" and "(T, H)" in got["not_2d"][1]
