"""``tpcomm bench``'s sweep on two CPU ranks (gloo, Triton's interpreter): eager mode only, tiny shapes.
It runs the real rank loop (inputs, checks, agreement, timing, summary) without a GPU; the GPU-only
contenders (symmetric memory, FlashInfer, the peer copy) report themselves unavailable."""

from tests.tools import ranks as cases
from tpcomm.bench.config import BenchConfig
from tpcomm.bench.report import format_report
from tpcomm.bench.summary import failures, summarize, tpcomm_failed

CFG = dict(world_size=2, hiddens=(64,), dtypes=("bf16",), tokens=(2,), modes=("graph", "eager"),
           contenders=("nccl", "torch_epilogue"), graph_calls=2, replays=1, min_replays=1, warmup_replays=0)


def test_sweep_on_cpu_ranks(pool2):
    cfg = BenchConfig(ops=("fused", "all_gather", "reduce_scatter"), **CFG)
    doc = summarize(pool2.run(cases.sweep, cfg, timeout_s=240), cfg)
    rows = {(r["op"], r["mode"]): r for r in doc["rows"]}
    for op in ("fused", "all_gather", "reduce_scatter"):
        eager = rows[(op, "eager")]["results"]
        assert eager["tpcomm"].get("median_us", 0) > 0 and eager["nccl"].get("median_us", 0) > 0, eager
        assert rows[(op, "eager")]["speedup"]["nccl"] > 0
        assert rows[(op, "graph")]["results"]["tpcomm"]["na"] == "graph mode needs CUDA"
    assert rows[("fused", "eager")]["results"]["torch_epilogue"]["median_us"] > 0
    assert {"copy_ce", "copy_sm"} <= set(doc["unavailable"])
    assert not failures(doc) and not tpcomm_failed(doc)
    assert "all_gather" in format_report(doc)
    assert doc["environment"]["pdl"] is False  # CPU ranks never launch with PDL
    assert doc["environment"]["tpcomm_commit"]  # the tests run from a git checkout


def test_a_wrong_contender_is_reported_and_not_timed(pool2):
    cfg = BenchConfig(ops=("all_reduce",), **CFG)
    doc = summarize(pool2.run(cases.sweep, cfg, True, timeout_s=240), cfg)
    row = next(r for r in doc["rows"] if r["op"] == "all_reduce" and r["mode"] == "eager")
    assert "check failed" in row["results"]["nccl"]["error"] and "median_us" not in row["results"]["nccl"]
    assert row["results"]["tpcomm"]["median_us"] > 0
    assert not tpcomm_failed(doc) and len(failures(doc)) == 1


def test_fused_fp8_against_the_unfused_tpcomm(pool2):
    """The fused FP8 output's baseline row: tpcomm's bf16 fused call + the standalone quant kernel, checked bit for
    bit like tpcomm's fused FP8 call and timed beside it."""
    cfg = BenchConfig(ops=("fused_fp8",), **{**CFG, "contenders": ("tpcomm_unfused",)})
    doc = summarize(pool2.run(cases.sweep, cfg, timeout_s=240), cfg)
    eager = next(r for r in doc["rows"] if r["op"] == "fused_fp8" and r["mode"] == "eager")
    assert eager["results"]["tpcomm_unfused"].get("median_us", 0) > 0, eager["results"]
    assert eager["results"]["tpcomm"].get("median_us", 0) > 0
    assert not failures(doc) and not tpcomm_failed(doc)
