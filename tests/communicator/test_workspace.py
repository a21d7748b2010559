"""Workspace (``tpcomm/workspace.py``) on CPU ranks: shared-memory files never outlive set-up, layout,
epochs, scratch that holds garbage, Lamport buffers re-armed."""

import glob
import os

import pytest
import torch

from tests.communicator import ranks
from tests.support.harness import shm_files
from tests.support.numerics import Checks, assert_same_bits, assert_within_ulp, out_ulp_tolerance
from tpcomm.launch import RankFailure, launch
from tpcomm.workspace import Workspace


def _files_of(pids) -> list[str]:
    """tpcomm shared-memory files created by any of ``pids`` (names are tpcomm-<pid>-<tag>-r<rank>)."""
    return sorted(n for n in shm_files() for p in pids if n.startswith(f"tpcomm-{p}-"))


def test_no_shm_files_after_create_and_close(pool):
    """The files are unlinked as soon as every rank has mapped them: none while the communicator lives,
    none after close."""
    results = pool.run(ranks.life_cycle_case)
    check = Checks()
    for r, res in enumerate(results):
        for when in ("after_create", "after_close", "after_all"):
            check.that(res[when] == [], f"rank {r}: /dev/shm holds {res[when]} {when.replace('_', ' ')}")
    check.that(_files_of(pool.pids) == [], f"files of the pool's ranks left: {_files_of(pool.pids)}")
    check.done()


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_no_shm_files_after_a_rank_dies(tmp_path, how):
    """A rank dies right after creating its Communicator (``os._exit`` or an exception): launch reports
    RankFailure, the survivor's next call raises PeerTimeoutError naming the dead rank, and no
    tpcomm file of any rank is left in /dev/shm (files there before the launch are an earlier run's,
    even when the ranks reuse their pids)."""
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(RankFailure) as info:
        launch(ranks.launch_die_after_comm, 2, "cpu", args=(str(tmp_path), how, 1, 0.1), timeout_s=120)
    pids = [int(open(p).read()) for p in sorted(glob.glob(str(tmp_path / "rank*.pid")))]
    seen_path = tmp_path / "rank0.seen"
    seen = open(seen_path).read() if seen_path.exists() else None
    check = Checks()
    check.that(len(pids) == 2, f"ranks that started: {pids}")
    left = [n for n in _files_of(pids) if n not in before]
    check.that(left == [], f"left in /dev/shm: {left}")
    msg = str(info.value)
    if how == "exit":
        check.that("[1]" in msg and "did not finish" in msg and "rank 1 did not finish: exit code" in msg,
                   f"RankFailure does not say rank 1 vanished, with its exit code: {msg}")
    else:
        check.that("rank 1" in msg and "fails on purpose" in msg, f"RankFailure lacks rank 1's error: {msg}")
    check.that(seen is not None and "PeerTimeoutError" in seen and "rank 1" in seen,
               f"the survivor saw {seen}, expected a PeerTimeoutError naming rank 1")
    check.done()


@pytest.mark.parametrize("H", [1, 7, 16, 123, 2880, 8200])
@pytest.mark.parametrize("element_size", [2, 4])
def test_row_stride_is_aligned(H, element_size):
    """Rows start 16-element aligned in a slot (Triton specialises on divisibility by 16) and hold H."""
    stride = Workspace.row_stride(H, element_size)
    assert stride % 16 == 0 and H <= stride < H + 16, f"row_stride({H}, {element_size}) = {stride}"


@pytest.mark.parametrize("H,dtype,max_bytes", [(123, torch.bfloat16, 4096), (300, torch.float32, 4096),
                                               (2880, torch.float16, None), (4097, torch.float32, 16384)],
                         ids=["123-bf16-4096", "300-fp32-4096", "2880-fp16-default", "4097-fp32-16384"])
def test_layout(pool2, H, dtype, max_bytes):
    """A slot holds at least max_bytes (256-byte aligned); rows_per_launch rows fit one slot and one
    more would not; every rank maps every peer (distinct addresses, the same on both tables' offsets)."""
    results = pool2.run(ranks.workspace_layout_case, H, dtype, max_bytes)
    es = torch.empty((), dtype=dtype).element_size()
    check = Checks()
    for r, res in enumerate(results):
        slot, stride, rows = res["slot_bytes"], res["row_stride"], res["rows_per_launch"]
        check.that(slot % 256 == 0 and slot >= (max_bytes or 1 << 20), f"rank {r}: slot_bytes {slot}")
        check.that(rows * stride * es <= slot < (rows + 1) * stride * es,
                   f"rank {r}: {rows} rows of {stride} x {es} bytes in a {slot}-byte slot")
        check.that(len(set(res["flag_table"])) == pool2.world_size, f"rank {r}: flag_table {res['flag_table']}")
        offsets = {b - f for b, f in zip(res["buf_table"], res["flag_table"])}
        check.that(len(offsets) == 1, f"rank {r}: receive buffers at different offsets {offsets}")
    check.done()


#: (op, shape, max_bytes) calls: grids of 1 and 4 programs, a flat all_reduce of several rows, and a
#: chunked call (13 rows of 300 bf16 in 4096-byte slots: 3 launches).
EPOCH_CALLS = [("fused", (1, 64), None), ("fused", (9, 64), None), ("all_reduce", (3 * 4096,), None),
               ("fused", (13, 300), 4096)]
#: Epoch steps each EPOCH_CALLS call must make: one per launch.
EPOCH_STEPS = [1, 1, 1, 3]


@pytest.mark.parametrize("algo", ["lamport", "one_shot"])
def test_epoch_advances_once_per_launch(pool, algo):
    results = pool.run(ranks.epoch_case, EPOCH_CALLS, algo=algo)
    check = Checks()
    for r, steps in enumerate(results):
        got = [after - before for before, after in steps]
        check.that(got == EPOCH_STEPS, f"rank {r}: epoch steps {got}, expected {EPOCH_STEPS} for {EPOCH_CALLS}")
    check.that(len({tuple(s) for s in results}) == 1, f"ranks disagree on epochs: {results}")
    check.done()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_garbage_in_receive_buffers_is_never_read(pool, dtype):
    """Receive buffers filled with NaN bytes between calls: results still exact (one-shot)."""
    results = pool.run(ranks.poisoned_scratch_case, 1700, (5, 123), dtype, algo="one_shot")
    check = Checks()
    for r, res in enumerate(results):
        check(assert_same_bits, res["y"], res["s_ref"], f"rank {r} all_reduce")
        check(assert_same_bits, res["residual_out"], res["residual_out_ref"], f"rank {r} residual_out")
        check(assert_within_ulp, res["out"], res["out_ref"], out_ulp_tolerance(dtype, 123), f"rank {r} out")
    check.done()


def test_lamport_buffers_are_rearmed(pool):
    """After Lamport calls of several shapes (inputs with -0.0 in them), every word of every rank's
    Lamport buffers holds the sentinel again, so the next call cannot mistake stale data for new; the
    call tags (never re-armed) hold their fill or a tag."""
    shapes = [(1, 64), (5, 123), (2, 8200), (9, 16)]
    results = pool.run(ranks.lamport_rearmed_case, shapes)
    check = Checks()
    for r, res in enumerate(results):
        check.that(res["plans"] == ["lamport"] * len(shapes), f"rank {r}: plans {res['plans']}")
        check.that(res["sentinel_words"] == res["words"],
                   f"rank {r}: {res['words'] - res['sentinel_words']} of {res['words']} Lamport words not re-armed")
        check.that(res["bad_tags"] == 0, f"rank {r}: {res['bad_tags']} call tags hold neither fill nor a tag")
    check.done()


def test_shm_file_names_carry_the_pid():
    """The cleanup checks above find files by ``tpcomm-<pid>-`` and would pass vacuously if the naming
    changed: keep them honest."""
    src = open(os.path.join(os.path.dirname(ranks.tpcomm.__file__), "workspace.py")).read()
    assert "/dev/shm/tpcomm-{os.getpid()}-" in src, "workspace file naming changed; update _files_of"
