import pytest, torch, rank_cases
from numerics import *

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 7), (3, 123), (5, 2880), (1, 8200), (1, 16400)], ids=str)
def test_probe(pool, dtype, shape):
    rs = pool.run(rank_cases.fused_case, 1, shape, dtype, also_all_reduce=True)
    for r in rs:
        print(r["plan"], "s", int(ulp_distance(r["s"], r["s_ref"]).max()), "ro", int(ulp_distance(r["residual_out"], r["residual_out_ref"]).max()),
              "out", int(ulp_distance(r["out"], r["out_ref"]).max()), r["x_untouched"])
