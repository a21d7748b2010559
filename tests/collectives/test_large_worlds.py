"""4 and 8 ranks on CPU (the world sizes of 4- and 8-GPU nodes, as CPU ranks): every op under every
algorithm, bit-exact against the reference, on every rank."""

import pytest

from tests.collectives import ranks
from tpcomm.launch import launch


@pytest.mark.parametrize("world_size", [4, 8])
def test_every_op_and_algorithm_on_many_ranks(world_size):
    results = launch(ranks.every_op_every_algorithm, world_size, "cpu", timeout_s=600)
    bad = {r: b for r, b in enumerate(results) if b}
    assert not bad, f"differences from the reference, by rank: {bad}"


def test_more_ranks_than_hoisted_table_entries():
    from tpcomm.kernels.sync import HOISTED_RANKS

    world_size = HOISTED_RANKS.value + 1
    results = launch(ranks.past_hoisted_ranks, world_size, "cpu", timeout_s=600)
    bad = {r: b for r, b in enumerate(results) if b}
    assert not bad, f"differences from the reference, by rank: {bad}"
