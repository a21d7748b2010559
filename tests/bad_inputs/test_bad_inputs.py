"""The bad-input matrix: every unusual or wrong input gives the right result (through a kernel or the
fallback) or an exception that names the argument — never a wrong value and never a write outside the
output (guard regions around every view). The cases are in ``tests/bad_inputs/ranks.py``, their expected
outcomes in ``ranks.EXPECTED``, and each one is a row of the table in ``docs/reliability.md``.

Each case runs on both rank kinds (the ``matrix`` fixture): 2 CPU ranks (the pool), and ``GPU_WORLD``
GPUs (NCCL group, symmetric memory; marked ``gpu``, skipped without that many GPUs). The GPU-only rows
(``test_gpu_bad_input``) are a CPU tensor or a tensor on the other GPU given to a GPU communicator (each
tensor argument in turn), and sizes exactly at and one past the Lamport limit and the default 32 MiB
workspace. Run the GPU part on a machine with GPUs: ``python -m pytest -q -m gpu tests/bad_inputs``.

All cases of a rank kind run in one call (module fixture): a call per case would cost more in round trips
than the cases themselves.
"""

import os
import re

import pytest

from tests.bad_inputs import ranks
from tests.support.gpu_world import GPU_WORLD, NEEDS_GPUS
from tests.support.numerics import Checks
from tpcomm.launch import launch

NAMES = list(ranks.CASES)
GPU_NAMES = list(ranks.GPU_EXPECTED)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "reliability.md")


#: The rank kinds every case runs on: CPU pool ranks, and GPUs (marked ``gpu``).
RANK_KINDS = ["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, NEEDS_GPUS])]


@pytest.fixture(scope="module")
def cpu_matrix(pools):
    """Per rank: ``{case: summary}`` from one run of every case on 2 CPU ranks."""
    return pools.get(2).run(ranks.pool_body, NAMES)


@pytest.fixture(scope="module")
def gpu_matrix():
    """Per rank: ``{case: summary}`` from one launch running every case (and the GPU-only rows) on
    GPU_WORLD GPUs."""
    return launch(ranks.gpu_body, GPU_WORLD, "cuda", args=(NAMES,), timeout_s=600)


@pytest.fixture(scope="module", params=RANK_KINDS)
def matrix(request):
    """The matrix of one rank kind (``cpu_matrix`` or ``gpu_matrix``)."""
    return request.getfixturevalue(f"{request.param}_matrix")


def check_outcome(check: Checks, per_rank: list, name: str, expected: dict) -> None:
    """Every rank's summary of ``name`` against ``expected`` (see ``ranks.result/raises``)."""
    for r, s in enumerate(per_rank):
        raised = s["raised"]
        if expected["kind"] == "raises":
            check.that(raised is not None, f"rank {r}: {name}: raised nothing, expected {expected['type']}")
            if raised is not None:
                typ, msg = raised
                check.that(typ == expected["type"], f"rank {r}: {name}: raised {typ} ({msg!r}), "
                                                     f"expected {expected['type']}")
                check.that(re.search(rf"\b{expected['arg']}\b", msg) is not None,
                           f"rank {r}: {name}: the message does not name {expected['arg']!r}: {msg!r}")
                check.that(msg.startswith(f"{expected['op']}:"),
                           f"rank {r}: {name}: the message is not prefixed with {expected['op']!r}: {msg!r}")
        else:
            check.that(raised is None, f"rank {r}: {name}: raised {raised}")
            want = expected["launches"]
            got = s["launches"]
            check.that(got == want if want is not None else (got or 0) >= 1,
                       f"rank {r}: {name}: {got} kernel launches, expected {want if want is not None else '>= 1'}")
        for f in s["failures"]:
            check.that(False, f"rank {r}: {name}: {f}")
        check.that(s["in_step"], f"rank {r}: {name}: a correct all_reduce right after the case failed")


@pytest.mark.parametrize("case", NAMES)
def test_bad_input(matrix, case):
    """The case's documented outcome on every rank (CPU and GPU): the exact result (guards untouched, inputs
    unchanged) after the expected number of kernel launches, or the exception naming the argument;
    and the ranks still in step afterwards."""
    check = Checks()
    check_outcome(check, [per_rank[case] for per_rank in matrix], case, ranks.EXPECTED[case])
    check.done()


@pytest.mark.gpu
@NEEDS_GPUS
@pytest.mark.parametrize("case", GPU_NAMES)
def test_gpu_bad_input(gpu_matrix, case):
    """A GPU-only row's documented outcome on every GPU (see test_bad_input)."""
    check = Checks()
    expected = ranks.EXPECTED.get(case) or ranks.GPU_EXPECTED[case]
    check_outcome(check, [per_rank[case] for per_rank in gpu_matrix], case, expected)
    check.done()


def test_every_case_has_an_expected_outcome():
    assert set(ranks.EXPECTED) == set(ranks.CASES), (
        set(ranks.EXPECTED) ^ set(ranks.CASES))
    assert set(ranks.GPU_EXPECTED) == set(ranks.GPU_ONLY) | set(ranks.GPU_SIZES)


def test_the_reliability_doc_has_a_row_per_case():
    """docs/reliability.md lists every case (CPU and GPU) with the outcome the tests expect."""
    text = open(DOC).read()
    rows = [ranks.doc_row(n, o) for n, o in ranks.EXPECTED.items()]
    rows += [ranks.doc_row(n, o, gpu=True) for n, o in ranks.GPU_EXPECTED.items()]
    missing = [row for row in rows if row not in text]
    assert not missing, ("rows missing from docs/reliability.md (print the table with "
                         "`python -m tests.bad_inputs.ranks`):\n" + "\n".join(missing))


@pytest.mark.parametrize("layout", ["flat", "offset", "strided", "transposed", "expanded"])
def test_guard_detects_a_write_outside_the_view(layout):
    """The guard check itself can fail: a write just outside the view is seen."""
    import torch

    g = ranks.Guarded(torch.arange(12, dtype=torch.float32).reshape(3, 4), layout)
    assert g.changed_outside() == 0 and g.changed_anywhere() == 0
    outside = g.outside.nonzero()[0].tolist()
    g.buf[tuple(outside)] = 1.0
    assert g.changed_outside() == 1 and g.changed_anywhere() == 1
