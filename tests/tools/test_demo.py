"""``tpcomm demo``'s table (tpcomm/demo.py): the µs/call column shows only where calls were timed."""

from tpcomm.demo import Row, format_table


def _row(time_us):
    return Row(op="all_reduce", shape="5 x 2880", dtype="bfloat16", algorithm="lamport", error=0.0,
               error_unit="ulp", residual_exact=True, ranks_identical=True, time_us=time_us, ok=True)


def test_cpu_table_has_no_time_column():
    header = format_table([_row(None), _row(None)]).splitlines()[0]
    assert "µs/call" not in header and header.rstrip(" |").endswith("check"), header


def test_gpu_table_has_the_time_column():
    lines = format_table([_row(12.34), _row(None)]).splitlines()
    assert "µs/call" in lines[0], lines[0]
    assert "12.3" in lines[2] and "| -" in lines[3], lines
