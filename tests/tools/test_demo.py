"""``tpcomm demo`` (tpcomm/demo.py, tpcomm/demo_other_ops.py): its quick sweep on 2 CPU ranks covers every
op and every quantised form and passes; the table's µs/call column shows only where calls were timed."""

from tests.tools import ranks
from tpcomm import demo_other_ops
from tpcomm.demo import OPS, Row, format_table, merge_rows


def test_the_demo_covers_every_op_and_passes(pool2):
    """Every op of the API (the all-reduce, the fused norm with and without residual and Gemma's weight,
    the all-gather, the reduce-scatter, the QK norm, the MoE finalize) and every quantised form has a
    row, and every row's checks pass on every rank."""
    rows = merge_rows(pool2.run(ranks.demo_rows, True))
    names = " ".join(r.op for r in rows)
    for op in [name for name, *_ in OPS] + ["tp_mlp", "all_gather", "reduce_scatter", "fused_qk_rmsnorm",
                                            "fused_moe_finalize_add_rmsnorm"]:
        assert op in names, f"no row for {op}: {names}"
    for form in demo_other_ops.QUANT_FORMS:
        assert f"quant={form}" in names, f"no row for quant={form}"
    failed = [f"{r.op} {r.shape}: {r.note}" for r in rows if not r.ok]
    assert not failed, failed


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
