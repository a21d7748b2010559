"""``torch.compile`` of code that calls ``tpcomm.ops``, on CPU ranks (Triton's interpreter runs the
kernels inside the compiled graph: the ops are opaque to the compiler, so Inductor calls them as they
are). GPU compile tests: ``tests/ops/test_gpu_graphs.py``.
"""

from tests.ops import ranks
from tests.support.numerics import Checks

#: Token counts of the compiled layer: one compilation with the token dimension dynamic must serve all
#: of them. Each rank's reduce_scatter share must be 2 rows or more: torch specialises sizes 0 and 1,
#: so a share of one row would be a recompilation (correct, but not the one compilation tested here).
TOKENS = (4, 7)


def test_compiled_layer_matches_eager_bit_for_bit(pool2):
    """``torch.compile(fullgraph=True)`` with Inductor of a layer calling every op (matmul, all_reduce,
    fused add + RMSNorm, all_reduce into ``out`` and in place, fused no-residual Gemma, fused FP8 per
    group, reduce_scatter of rows and of columns, all_gather): traces with no graph break (fullgraph
    raises on one), compiles once for every token count, and each call gives eager's bits and strides for
    every output; reduce_scatter's rank-dependent share has tensor_split's size on each rank."""
    results = pool2.run(ranks.compile_case, 32, TOKENS, 2300, timeout_s=300)
    check = Checks()
    for r, got in enumerate(results):
        check.that(got["frames"] == 1, f"rank {r}: compiled {got['frames']} times, expected once")
        for call in got["calls"]:
            check.that(all(call["same"]) and call["none_ok"],
                       f"rank {r}, T={call['T']}: outputs (out, residual, all_reduce chain, q, scales, rows, "
                       f"gathered) equal eager: {call['same']}, None where expected: {call['none_ok']}")
            W = pool2.world_size
            check.that(call["rows"] == call["T"] // W + (r < call["T"] % W),
                       f"rank {r}, T={call['T']}: reduce_scatter gave {call['rows']} rows")
    check.done()


def test_compiled_code_follows_the_communicator(pool2):
    """One compiled function, layers holding different communicators (the world group and a group of
    one rank, whose all_reduce is the identity): each call uses its own layer's communicator, also after
    the communicator of a layer is swapped (a guard on the communicator object, not a stale handle)."""
    results = pool2.run(ranks.compiled_follows_comm_case)
    for r, got in enumerate(results):
        assert all(got["checks"].values()), f"rank {r}: {got['checks']}"
        assert got["frames"] >= 2, f"rank {r}: {got['frames']} compilation(s): the second communicator was not guarded"
