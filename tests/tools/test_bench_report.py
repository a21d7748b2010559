"""CPU tests of ``tpcomm bench``'s output: the summary of synthetic per-rank results (slowest rank,
median, bandwidths, speed-ups, % of copy), the tables, the JSON and the plots; and the command on a
machine without GPUs."""

import json
import os

import pytest

from tpcomm.bench import command as bench_main
from tpcomm.bench.config import BenchConfig
from tpcomm.bench.report import format_report, tables, write_json
from tpcomm.bench.summary import failures, summarize, tpcomm_failed

MIB = 1 << 20


def _item(op, contender, us, T=256, H=4096, mode="graph", note=""):
    n = T * H * 2
    return {"dtype": "bf16", "hidden": H, "tokens": T, "op": op, "bytes": n, "calls": 20,
            "contender": contender, "wall_s": 0.1, "note": note, mode: us}


def _per_rank():
    """Two ranks: rank 1 is slower on replay 0 and faster on replays 1 and 2 (the max differs per replay)."""
    r0 = [_item("copy", "copy_ce", {"us": [20.0, 20.0, 20.0]}), _item("copy", "copy_sm", {"us": [10.0, 10.0, 10.0]}),
          _item("all_reduce", "tpcomm", {"us": [10.0, 13.0, 12.0]}, note="lamport"),
          _item("all_reduce", "nccl", {"us": [30.0, 30.0, 30.0]}),
          _item("all_reduce", "fi_vllm", {"error": "rank 1: check failed: sum off by 1e-1"}),
          _item("all_reduce", "symm_one_shot", {"na": "not here"})]
    r1 = [dict(i) for i in r0]
    r1[2] = _item("all_reduce", "tpcomm", {"us": [16.0, 11.0, 11.0]}, note="lamport")
    return [{"info": {"gpu": "H200", "torch": "x", "triton": "y", "nccl": "z", "flashinfer": "f"},
             "unavailable": {"fi_trtllm_oneshot": "rank 0: ModuleNotFoundError: flashinfer"}, "items": r}
            for r in (r0, r1)]


def _doc():
    cfg = BenchConfig(world_size=2, ops=("all_reduce",), hiddens=(4096,), dtypes=("bf16",), tokens=(256,),
                      modes=("graph",))
    return summarize(_per_rank(), cfg)


def _row(doc, op):
    return next(r for r in doc["rows"] if r["op"] == op)


def test_summary_takes_the_slowest_rank_per_replay_then_the_median():
    res = _row(_doc(), "all_reduce")["results"]["tpcomm"]
    assert res["times_us"] == [16.0, 13.0, 12.0]  # max over ranks, replay by replay
    assert res["median_us"] == 13.0 and res["min_us"] == 12.0 and res["max_us"] == 16.0
    n = 256 * 4096 * 2
    assert res["algbw_GBps"] == pytest.approx(n / 13e-6 / 1e9)
    assert res["busbw_GBps"] == pytest.approx(res["algbw_GBps"])  # W = 2: factor 2 (W - 1) / W = 1
    assert res["note"] == "lamport"


def test_summary_speedups_and_copy_share():
    doc = _doc()
    row = _row(doc, "all_reduce")
    assert row["speedup"]["nccl"] == pytest.approx(30.0 / 13.0)
    assert row["speedup"]["fi_vllm"] is None and row["speedup"]["symm_one_shot"] is None
    # copy bandwidth: the faster copy (SM, 10 µs); tpcomm's busbw at 13 µs is 10/13 of it
    assert row["copy_bw_GBps"] == pytest.approx(256 * 4096 * 2 / 10e-6 / 1e9)
    assert row["results"]["tpcomm"]["pct_of_copy"] == pytest.approx(100 * 10 / 13)
    assert "copy_ce" not in row["speedup"]  # reference rows are not contenders


def test_failures_and_exit_status():
    doc = _doc()
    fails = failures(doc)
    assert len(fails) == 1 and "fi_vllm" in fails[0] and "check failed" in fails[0]
    assert not tpcomm_failed(doc)
    per_rank = _per_rank()
    per_rank[1]["items"][2] = _item("all_reduce", "tpcomm", {"error": "rank 1: check failed: out differs"})
    cfg = BenchConfig(world_size=2, ops=("all_reduce",), hiddens=(4096,), dtypes=("bf16",), tokens=(256,),
                      modes=("graph",))
    assert tpcomm_failed(summarize(per_rank, cfg))


def test_table_cells():
    doc = _doc()
    (_, copy_table, _), (title, table, notes) = tables(doc)
    assert "peer copy" in copy_table
    assert title.startswith("all_reduce") and "graph mode" in title
    line = next(l for l in table.splitlines() if l.startswith("| 4096"))
    assert "13.0 (lamport)" in line and "30.0 (2.31x)" in line and "FAIL" in line and "n/a" in line
    assert "77%" in line  # % of copy
    assert any("FlashInfer vLLM AR FAIL" in n for n in notes) and any("not here" in n for n in notes)
    assert "ModuleNotFoundError" in format_report(doc)


def test_json_and_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from tpcomm.bench.plot import plot_files

    doc = _doc()
    path = os.path.join(tmp_path, "b.json")
    write_json(doc, path)
    with open(path) as f:
        back = json.load(f)
    assert back["rows"][1]["results"]["tpcomm"]["median_us"] == 13.0
    pngs, why = plot_files(doc, os.path.join(tmp_path, "b"))
    assert why is None and [os.path.basename(p) for p in pngs] == ["b-all_reduce-graph.png"]
    with open(pngs[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_without_gpus_exits_2_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(bench_main, "gpu_count", lambda: 0)
    assert bench_main.main() == 2
    out = capsys.readouterr().out
    assert "needs at least 2 CUDA GPUs" in out and "tpcomm demo" in out


def test_estimate_runs_without_gpus(monkeypatch, capsys):
    monkeypatch.setattr(bench_main, "gpu_count", lambda: 0)
    assert bench_main.main(estimate_only=True) == 0
    full = capsys.readouterr().out
    assert "Estimated device time" in full
    assert bench_main.main(estimate_only=True, quick=True) == 0
    quick = capsys.readouterr().out

    def seconds(text):
        return float(text.rsplit("(", 1)[1].split(" s)")[0])
    assert seconds(quick) < seconds(full) <= 360  # the full sweep fits the lead's ~6 minutes


def test_bad_world_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench_main, "gpu_count", lambda: 2)
    assert bench_main.main(world_size=3) == 2
    assert "--world must be between 2 and 2" in capsys.readouterr().out


def test_several_world_sizes_add_up_in_the_estimate(monkeypatch, capsys):
    monkeypatch.setattr(bench_main, "gpu_count", lambda: 0)
    assert bench_main.main(world_size=(2, 4), estimate_only=True, quick=True) == 0
    both = capsys.readouterr().out
    assert bench_main.main(world_size=2, estimate_only=True, quick=True) == 0
    one = capsys.readouterr().out
    assert "2,4 GPUs" in both and float(both.rsplit("(", 1)[1].split(" s)")[0]) > float(
        one.rsplit("(", 1)[1].split(" s)")[0])
    assert bench_main.main(world_size=1, estimate_only=True) == 2
    assert "at least 2" in capsys.readouterr().out
