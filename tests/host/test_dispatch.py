"""Dispatch (``tpcomm/dispatch.py``): a pure function of the call's shape, the same on every rank.
Thresholds are measured and will move; these tests pin the invariants, not the numbers."""

import pytest
import torch

from tpcomm import dispatch


@pytest.mark.parametrize("H", [1, 7, 16, 123, 2880, 4096, 6144, 8192, 8200, 16400])
def test_row_config_tiles_the_row(H):
    cfg = dispatch.row_config(H, 4)
    assert cfg.block_h & (cfg.block_h - 1) == 0 and 16 <= cfg.block_h <= dispatch.MAX_BLOCK_H, cfg
    assert cfg.num_tiles * cfg.block_h >= H > (cfg.num_tiles - 1) * cfg.block_h, cfg


@pytest.mark.parametrize("H", [7, 2880, 8200])
def test_row_config_depends_on_hidden_alone(H):
    """The tiling (and so the norm's reduction tree) must not change with the grid cap or rows."""
    a, b = dispatch.row_config(H, 4), dispatch.row_config(H, 264)
    assert (a.block_h, a.num_tiles, a.num_warps) == (b.block_h, b.num_tiles, b.num_warps)


@pytest.mark.parametrize("H", [7, 1024, 2048, 2049, 4096, 6144, 8192, 8193, 16384])
def test_two_shot_row_config_keeps_the_tiles(H):
    """Two-shot may change the warps and the grid cap (no bit depends on them), never the tiling; it
    runs 8-warp programs, twice as many, only on rows of one tile of 4096+ elements."""
    base, two = dispatch.row_config(H, 264), dispatch.row_config(H, 264, two_shot=True)
    assert (two.block_h, two.num_tiles) == (base.block_h, base.num_tiles)
    if base.num_tiles == 1 and base.block_h >= 4096:
        assert (two.num_warps, two.max_programs) == (8, 528)
    else:
        assert two == base


class _Slots:
    """The two things ``all_reduce_width`` reads from a workspace: the grid cap and a half slot's size."""

    def __init__(self, max_programs, half_slot=1 << 30):
        self.max_programs, self.half_slot = max_programs, half_slot

    def half_slot_elems(self, element_size):
        return self.half_slot


@pytest.mark.parametrize("programs", [1, 2, 33, 66, 264])
@pytest.mark.parametrize("n", [1, 8, 2048, 4096, 6144, 8192, 16 * 6144, 64 * 4096, 64 * 6144, 256 * 8192])
def test_lamport_all_reduce_rows(n, programs):
    """A Lamport all-reduce takes the narrowest row that leaves no program more than one row; failing
    that the fewer rows per program of 4096 and 8192 (4096 on a tie); other algorithms keep
    ``ALL_REDUCE_ROW``."""
    ws = _Slots(programs)
    width = dispatch.all_reduce_width(n, 2, ws, "lamport")

    def per_program(w):
        return -(-(-(-n // w)) // programs)

    fits = [w for w in dispatch.LAMPORT_ALL_REDUCE_ROWS if per_program(w) == 1]
    if fits:
        assert width == min(n, fits[0]) and per_program(width) == 1
    else:
        assert width in (4096, 8192) and per_program(width) == min(per_program(4096), per_program(8192))
        assert width == 8192 or per_program(4096) <= per_program(8192)
    assert dispatch.all_reduce_width(n, 2, ws, "one_shot") == min(n, dispatch.ALL_REDUCE_ROW)
    assert dispatch.all_reduce_width(n, 2, _Slots(programs, half_slot=1000), "lamport") <= 992


def test_lamport_all_reduce_rows_at_decode_sizes():
    """The widths themselves where they were measured (2 loopback ranks of one H200: 66 programs)."""
    ws = _Slots(66)
    assert [dispatch.all_reduce_width(t * 6144, 2, ws, "lamport") for t in (1, 16, 64, 256)] == [2048, 2048, 8192,
                                                                                                  8192]


def test_row_config_rejects_empty_rows():
    with pytest.raises(ValueError, match="hidden"):
        dispatch.row_config(0, 4)


@pytest.mark.parametrize("n_rows", [0, 1, 3, 4, 5, 1000])
def test_grid_is_capped(n_rows):
    g = dispatch.row_config(64, 4).grid(n_rows)
    assert 1 <= g <= 4 and g == max(1, min(n_rows, 4))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.float64, torch.float8_e4m3fn], ids=str)
def test_dtypes_without_kernels_fall_back(dtype):
    assert dispatch.choose("all_reduce", 2, 1024, 512, dtype).algorithm == "fallback"


@pytest.mark.parametrize("kwargs", [{"world_size": 1}, {"kernels_available": False}, {"forced": "fallback"}],
                         ids=["one_rank", "no_workspace", "forced"])
def test_fallback_conditions(kwargs):
    args = {"op": "fused_add_rmsnorm", "world_size": 2, "nbytes": 4096, "hidden": 2048,
            "dtype": torch.bfloat16, **kwargs}
    assert dispatch.choose(**args).algorithm == "fallback"


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("nbytes", [2, 4096, 1 << 20, 64 << 20])
def test_kernels_for_float_dtypes(dtype, nbytes, world):
    """Every float message of any size runs a kernel algorithm on two or more ranks; Lamport (a 16-bit
    sentinel) never gets fp32."""
    plan = dispatch.choose("all_reduce", world, nbytes, 4096, dtype)
    assert plan.algorithm != "fallback" and not (plan.algorithm == "lamport" and dtype == torch.float32), plan


def test_table_thresholds_must_be_integers():
    text = '{"entries": {"all_reduce": {"2": {"lamport_max_bytes": 1.9, "two_shot_min_bytes": 8}}}}'
    with pytest.raises(ValueError, match="integers"):
        dispatch.CrossoverTable.from_json(text)


def test_load_table_reads_a_bounded_amount():
    """A path that never ends (/dev/zero) is refused after MAX_TABLE_BYTES, not read forever."""
    with pytest.raises(ValueError, match="larger than"):
        dispatch.load_table("/dev/zero")


def test_reasons_name_the_thresholds_the_size_fell_between():
    """A plan's reason gives the message's size and the thresholds it was compared with, in MiB / KiB where
    they are whole, and why Lamport was not taken."""
    table = dispatch.CrossoverTable({"all_reduce": {2: dispatch.Crossover(1 << 20, 3 << 20, "a test table")}})
    lamport = dispatch.choose("all_reduce", 2, 8 << 10, 4096, torch.bfloat16, table=table).reason
    one_shot = dispatch.choose("all_reduce", 2, 2 << 20, 4096, torch.bfloat16, table=table).reason
    fp32 = dispatch.choose("all_reduce", 2, 1000, 4096, torch.float32, table=table).reason
    two_shot = dispatch.choose("all_reduce", 2, 3 << 20, 4096, torch.bfloat16, table=table).reason
    assert lamport == "16-bit message of 8 KiB a rank, at most Lamport's 1 MiB (a test table)"
    assert one_shot == "message of 2 MiB a rank, under two-shot's 3 MiB; above Lamport's 1 MiB (a test table)"
    assert fp32 == "message of 1000 bytes a rank, under two-shot's 3 MiB; Lamport takes 16-bit data only (a test table)"
    assert two_shot == "message of 3 MiB a rank, at least two-shot's 3 MiB (a test table)"
