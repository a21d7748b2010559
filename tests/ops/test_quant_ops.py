"""The standalone FP8 quantisers as ``torch.library`` ops (``tpcomm/ops/quant.py``): the ops' bytes are the
Triton quantisers' (the wrappers and the functions of ``tpcomm.quant`` on the same input), their fake
implementations give the real outputs' shapes, dtypes and strides (``torch.library.opcheck``), and a
tensor that is not 2-D is refused while tracing too. Single process: the quantisers are local."""

import pytest
import torch

import tpcomm
import tpcomm.ops as tops

X = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
SCALE = torch.tensor(0.01)


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_ops_give_the_quantisers_bytes():
    assert all(map(_same, tops.per_token_quant_fp8(X), tpcomm.per_token_quant_fp8(X)))
    for column_major in (False, True):
        for ue8m0 in (False, True):
            got = tops.per_group_quant_fp8(X, 16, column_major_scales=column_major, ue8m0=ue8m0)
            want = tpcomm.per_group_quant_fp8(X, 16, column_major_scales=column_major, ue8m0=ue8m0)
            assert all(map(_same, got, want)), (column_major, ue8m0)
    assert _same(tops.static_quant_fp8(X, SCALE), tpcomm.static_quant_fp8(X, SCALE))


@pytest.mark.parametrize("op,args", [
    ("per_token_quant_fp8", (X, torch.float8_e4m3fn)),
    ("per_group_quant_fp8", (X, 16, torch.float8_e4m3fn, True, False)),
    ("static_quant_fp8", (X, SCALE, torch.float8_e4m3fn)),
])
def test_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.tpcomm, op).default, args)


def test_a_tensor_that_is_not_2d_is_refused_while_tracing():
    with pytest.raises(ValueError, match="x must be 2-D"):  # eagerly
        tops.per_token_quant_fp8(X.view(1, 5, 64))
    with pytest.raises(RuntimeError, match="x must be 2-D"):  # by the fake implementation, in Dynamo's error
        torch.compile(tops.per_token_quant_fp8, backend="aot_eager", fullgraph=True)(X.view(1, 5, 64))
