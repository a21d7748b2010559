"""Fixtures: persistent CPU rank pools (one per world size, shared by the whole session).

``pool`` is parametrised over the world sizes the CPU suite covers; ``pool2`` / ``pool3`` pin one.
A pool killed by a failing or hung test is restarted for the next test that asks for it.
"""

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # tpcomm and the ``tests`` package from this checkout (spawned ranks too)
    sys.path.insert(0, _ROOT)

import tpcomm  # noqa: E402,F401  (first: on CPU it turns the interpreter on before any test imports Triton)
from tests.support import harness  # noqa: E402

#: World sizes of the CPU suite: 2 (the common TP pair) and 3 (odd: no power-of-two shortcuts).
WORLD_SIZES = (2, 3)


@pytest.fixture(scope="session")
def pools():
    manager = harness.PoolManager()
    yield manager
    manager.close()


@pytest.fixture(params=WORLD_SIZES, ids=[f"w{w}" for w in WORLD_SIZES])
def pool(request, pools):
    return pools.get(request.param)


@pytest.fixture
def pool2(pools):
    return pools.get(2)


@pytest.fixture
def pool3(pools):
    return pools.get(3)
