"""The plain-torch reference (``tpcomm/reference.py``): the fallback and the tests' oracle, checked
against the contract written out by hand and against float64."""
# tpcomm first: on CPU it turns Triton's interpreter on before triton is imported
# isort: skip_file

import pytest
import torch

import tpcomm  # sets TRITON_INTERPRET=1 without CUDA, before triton is imported below
from tests.collectives import ranks
import triton
import triton.language as tl
from tpcomm.env import interpreter_enabled
from tpcomm.kernels.epilogue import tree_sum as kernel_tree_sum
from tpcomm.reference import pairwise_sum
from tests.support.numerics import (Checks, FLOAT_DTYPES, assert_same_bits, assert_within_ulp, bits, dtype_name,
                      residual_input, weight_input)


def test_reduce_in_rank_order_is_rank_order():
    """float32 (2^24, 1, -2^24): in rank order 2^24 + 1 rounds back to 2^24 and the sum is 0; any other
    order starting with -2^24 + 1 gives 1."""
    xs = [torch.tensor([2.0 ** 24]), torch.tensor([1.0]), torch.tensor([-(2.0 ** 24)])]
    assert tpcomm.reduce_in_rank_order(xs).item() == 0.0
    assert tpcomm.reduce_in_rank_order(xs[::-1]).item() == 1.0  # so the order is observable


def test_reduce_in_rank_order_accumulates_in_float32():
    """bf16 (256, 1, 1): a bf16 accumulator gives 256 (256 + 1 rounds to even each time); float32
    gives 258, which bf16 holds exactly."""
    xs = [torch.tensor([v], dtype=torch.bfloat16) for v in (256.0, 1.0, 1.0)]
    y = tpcomm.reduce_in_rank_order(xs)
    assert y.dtype == torch.bfloat16 and y.item() == 258.0, y


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_reduce_in_rank_order_negative_zero(dtype, n):
    """The accumulator starts at +0.0: -0.0 inputs sum to +0.0 (even a single one)."""
    y = tpcomm.reduce_in_rank_order([torch.full((4,), -0.0, dtype=dtype)] * n)
    assert_same_bits(y, torch.zeros(4, dtype=dtype), f"{n} x -0.0")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_reduce_in_rank_order_rounds_once(dtype):
    """T(sum in float32): equal to the float64 sum rounded through float32 to T, for random inputs."""
    xs = [torch.randn(257, generator=torch.Generator().manual_seed(q)).to(dtype) for q in range(3)]
    acc = torch.zeros(257, dtype=torch.float32)
    for x in xs:
        acc = acc + x.float()
    assert_same_bits(tpcomm.reduce_in_rank_order(xs), acc.to(dtype), "rank-order sum")


def _norm64(v, w, eps):
    """RMSNorm in float64."""
    v, w = v.double(), w.double()
    return v * torch.rsqrt((v * v).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("H", [1, 7, 123, 2880])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_add_rmsnorm_reference_against_float64(dtype, H):
    """residual_out is the once-rounded sum; out is float64's RMSNorm within the ulp tolerance of the
    float32 computation (1 ulp for 16-bit; for fp32 a few ulp from float32's own rounding)."""
    s = residual_input(1, (5, H), dtype)
    r = residual_input(2, (5, H), dtype)
    w = weight_input(3, H, dtype)
    out, ro = tpcomm.add_rmsnorm_reference(s, r, w, 1e-6)
    check = Checks()
    check(assert_same_bits, ro, (s.double() + r.double()).to(torch.float32).to(dtype), "residual_out")
    # fp32: float32 arithmetic (sum of squares, sqrt, division, two products) against float64
    tol = 1 if dtype != torch.float32 else 8
    check(assert_within_ulp, out, _norm64(ro, w, 1e-6).to(dtype), tol, "out")
    check.done()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_add_rmsnorm_reference_forms(dtype):
    """No residual: (norm(s), None). Gemma: the same as a float32 weight of 1 + w. A float32 weight
    with 16-bit s is used unrounded."""
    s = residual_input(4, (3, 64), dtype)
    w = weight_input(5, 64, dtype, gemma=True)
    check = Checks()
    out, ro = tpcomm.add_rmsnorm_reference(s, None, w, 1e-6)
    check.that(ro is None, "residual_out is not None without a residual")
    check(assert_within_ulp, out, _norm64(s, w, 1e-6).to(dtype), 1 if dtype != torch.float32 else 8,
          "no residual")
    g, _ = tpcomm.add_rmsnorm_reference(s, None, w, 1e-6, gemma=True)
    p, _ = tpcomm.add_rmsnorm_reference(s, None, 1.0 + w.float(), 1e-6)
    check(assert_same_bits, g, p, "gemma vs weight 1 + w")
    w32 = weight_input(6, 64, torch.float32) + 1e-3  # not representable in 16 bits
    a, _ = tpcomm.add_rmsnorm_reference(s, None, w32, 1e-6)
    b, _ = tpcomm.add_rmsnorm_reference(s, None, w32.to(dtype), 1e-6)
    check.that(dtype == torch.float32 or not torch.equal(bits(a), bits(b)),
               "a float32 weight gave the bits of its 16-bit rounding")
    check.done()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32], ids=dtype_name)
def test_collective_references(pool, dtype):
    """all_reduce_reference / fused_add_rmsnorm_reference over gloo equal the local rank-order
    reference (integers: exact through dist.all_reduce)."""
    results = pool.run(ranks.reference_collective_case, dtype)
    check = Checks()
    for r, res in enumerate(results):
        if dtype.is_floating_point:
            check(assert_same_bits, res["ar"], res["ar_local"], f"rank {r} all_reduce_reference")
            check(assert_same_bits, res["out"], res["out_local"], f"rank {r} fused out")
            check(assert_same_bits, res["ro"], res["ro_local"], f"rank {r} fused residual_out")
        else:
            check.that(torch.equal(res["ar"], res["ar_local"]), f"rank {r}: {res['ar']} != {res['ar_local']}")
    check.done()


def _wide_rows() -> torch.Tensor:
    """Rows of squares with everything a sum of squares must survive: a range of 2^240, subnormals,
    zeros, float32's largest values, Inf and NaN."""
    g = torch.Generator().manual_seed(7)
    wide = (torch.randn(8192, generator=g) * torch.exp2(torch.randint(-60, 60, (8192,), generator=g).float())) ** 2
    big = torch.zeros(8192)
    big[:3] = 3e38
    inf, nan = wide.clone(), wide.clone()
    inf[5] = float("inf")
    nan[9] = float("nan")
    sub = torch.zeros(8192)
    sub[::2] = 1e-45
    return torch.stack([wide, big, inf, nan, sub, torch.zeros(8192), torch.rand(8192, generator=g)])


@triton.jit
def _tree_sum_rows_kernel(x_ptr, out_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    tl.store(out_ptr + row, kernel_tree_sum(tl.load(x_ptr + row * N + tl.arange(0, N))))


def test_tree_sum_kernel_adds_by_pairs_like_the_reference():
    """``epilogue.tree_sum`` (the kernels' sum of squares, here under Triton's interpreter) adds by pairs,
    ``((l0 + l1) + (l2 + l3)) + ...``, as :func:`tpcomm.reference.pairwise_sum` (``sum_of_squares``'s last
    step) does."""
    if not interpreter_enabled():
        pytest.skip("runs under Triton's interpreter (the GPU tests check the kernels' norms)")
    x = _wide_rows()
    out = torch.empty(x.shape[0])
    _tree_sum_rows_kernel[(x.shape[0],)](x, out, N=x.shape[1])
    assert_same_bits(out.unsqueeze(-1), pairwise_sum(x), "kernel sum of squares")
