"""The bad-input matrix on ``GPU_WORLD`` GPUs (NCCL group, symmetric memory): every CPU case of
``tests/test_bad_inputs.py`` plus the GPU-only rows: a CPU tensor or a tensor on the other GPU given to
a GPU communicator (each tensor argument in turn), and sizes exactly at and one past the Lamport limit
and the default 32 MiB workspace. Marked ``gpu``; skipped without that many GPUs. Run on a machine with GPUs:
``python -m pytest -q -m gpu tests/test_gpu_bad_inputs.py``."""

import pytest

from tests.bad_inputs import ranks
from tests.bad_inputs.test_bad_inputs import check_outcome
from tests.support.gpu_world import GPU_WORLD, NEEDS_GPUS
from tests.support.numerics import Checks
from tpcomm.launch import launch

pytestmark = [pytest.mark.gpu, NEEDS_GPUS]

NAMES = list(ranks.CASES)
GPU_NAMES = list(ranks.GPU_EXPECTED)


@pytest.fixture(scope="module")
def matrix():
    """Per rank: ``{case: summary}`` from one launch running every case on GPU_WORLD GPUs."""
    return launch(ranks.gpu_body, GPU_WORLD, "cuda", args=(NAMES,), timeout_s=600)


@pytest.mark.parametrize("case", NAMES + GPU_NAMES)
def test_gpu_bad_input(matrix, case):
    """The case's documented outcome on both GPUs (see test_bad_inputs.test_bad_input)."""
    expected = ranks.EXPECTED.get(case) or ranks.GPU_EXPECTED[case]
    check = Checks()
    check_outcome(check, [per_rank[case] for per_rank in matrix], case, expected)
    check.done()
