"""The comparison helpers (``tests/support/numerics.py``) catch what they must: a check that cannot fire
would make every test built on it vacuous."""

import pytest
import torch

from tests.support.numerics import (
    FLOAT_DTYPES,
    Checks,
    assert_ranks_identical,
    assert_same_bits,
    assert_same_values,
    assert_within_ulp,
    dtype_name,
    ulp_distance,
)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_ulp_distance_counts_representable_values(dtype):
    one = torch.ones(1, dtype=dtype)
    up = torch.nextafter(one.float(), torch.tensor([2.0])).to(dtype) if dtype == torch.float32 else None
    step = torch.finfo(dtype).eps
    nxt = up if up is not None else (one + step).to(dtype)
    assert int(ulp_distance(one, nxt)) == 1
    assert int(ulp_distance(torch.tensor([0.0], dtype=dtype), torch.tensor([-0.0], dtype=dtype))) == 0
    tiny = torch.tensor([torch.finfo(dtype).tiny], dtype=dtype)
    assert int(ulp_distance(tiny, -tiny)) == 2 * int(ulp_distance(tiny, torch.zeros(1, dtype=dtype)))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_bit_checks_fire(dtype):
    z = torch.zeros(3, dtype=dtype)
    with pytest.raises(AssertionError):
        assert_same_bits(z, -z, "signed zero")  # -0.0 == +0.0 as floats, not as bits
    nan = torch.full((3,), float("nan"), dtype=dtype)
    assert_same_values(nan, nan.clone(), "NaN matches NaN")
    with pytest.raises(AssertionError):
        assert_same_values(nan, z, "NaN vs 0")
    a = torch.ones(3, dtype=dtype)
    b = a.clone()
    b[1] = 1 + 2 * torch.finfo(dtype).eps
    assert_within_ulp(a, b, 2, "2 ulp")
    with pytest.raises(AssertionError):
        assert_within_ulp(a, b, 1, "2 ulp > 1")
    with pytest.raises(AssertionError):
        assert_within_ulp(a, nan, 1000, "NaN where a value is expected")
    with pytest.raises(AssertionError):
        assert_ranks_identical([a, a, b], "rank 2 differs")


def test_checks_collects_every_failure():
    check = Checks()
    check.that(False, "first")
    check(assert_same_bits, torch.zeros(1), torch.ones(1), "second")
    check.that(True, "not recorded")
    with pytest.raises(AssertionError, match="2 check"):
        check.done()
    assert len(check.failures) == 2
