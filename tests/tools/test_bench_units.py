"""CPU tests of ``tpcomm bench``'s pure parts: bandwidth formulas, sweep sizing, argument parsing and the
correctness comparison (no ranks, no GPU)."""

import argparse

import pytest
import torch

from tpcomm.arguments import add_bench_arguments, choice_list, int_list
from tpcomm.bench import metrics
from tpcomm.bench.checks import REL_TOL, Case, compare
from tpcomm.bench.config import (
    FULL_HIDDENS,
    FULL_TOKENS,
    BenchConfig,
    calls_per_replay,
    message_bytes,
    replay_count,
    runs_shape,
    set_capacity,
)

# -- metrics ------------------------------------------------------------------------------------------

def test_algbw_is_bytes_over_time():
    assert metrics.algbw_gbps(1_000_000, 10.0) == pytest.approx(100.0)  # 1 MB in 10 µs = 100 GB/s


@pytest.mark.parametrize("op,W,factor", [("all_reduce", 2, 1.0), ("fused", 4, 1.5), ("fused_fp8", 8, 1.75),
                                         ("all_gather", 2, 0.5), ("reduce_scatter", 4, 0.75), ("copy", 8, 1.0)])
def test_busbw_factor_follows_nccl_tests(op, W, factor):
    assert metrics.busbw_gbps(op, 2_000_000, 10.0, W) == pytest.approx(200.0 * factor)


def test_bandwidth_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="us must be > 0"):
        metrics.algbw_gbps(1, 0.0)
    with pytest.raises(ValueError, match="op must be one of"):
        metrics.busbw_gbps("all_to_all", 1, 1.0, 2)
    with pytest.raises(ValueError, match="world_size"):
        metrics.busbw_gbps("all_reduce", 1, 1.0, 0)


def test_speedup_and_copy_percent():
    assert metrics.speedup(30.0, 10.0) == pytest.approx(3.0)  # the other takes 3x as long
    assert metrics.speedup(None, 10.0) is None and metrics.speedup(3.0, None) is None
    assert metrics.copy_percent(340.0, 400.0) == pytest.approx(85.0)
    assert metrics.copy_percent(340.0, None) is None


# -- config -------------------------------------------------------------------------------------------

def test_every_input_set_fits_its_buffer():
    """Buffers sized by set_capacity hold every set calls_per_replay asks for, at every size of the full
    sweep (a smaller buffer would make a symmetric-memory view run past its allocation)."""
    cfg = BenchConfig(world_size=2)
    top = max(FULL_TOKENS) * max(FULL_HIDDENS) * 4
    for T in FULL_TOKENS + (3, 5000):
        for H in FULL_HIDDENS:
            for d in ("bf16", "fp16", "fp32"):
                n = message_bytes(T, H, d)
                K = calls_per_replay(n, cfg)
                assert 2 <= K <= cfg.graph_calls or (K == cfg.graph_calls == 1)
                assert all(set_capacity(k, top, cfg) >= n for k in range(K)), (T, H, d, K)
    assert all(set_capacity(k, top, cfg) % 16 == 0 for k in range(cfg.graph_calls))  # viewable as any dtype


def test_large_messages_use_fewer_calls():
    cfg = BenchConfig(world_size=2)
    assert calls_per_replay(1 << 10, cfg) == cfg.graph_calls
    assert calls_per_replay(256 << 20, cfg) == 4  # 1 GiB of input sets
    assert calls_per_replay(4 << 30, cfg) == 2


def test_replay_count_bounds():
    cfg = BenchConfig(world_size=2, replays=30, min_replays=8, target_ms=60.0)
    assert replay_count(0.5, cfg) == 30   # short replays: the most
    assert replay_count(4.0, cfg) == 15   # 60 ms of timing
    assert replay_count(100.0, cfg) == 8  # long replays: the fewest


def test_rows_split_evenly_for_gather_and_scatter():
    assert runs_shape("all_gather", 3, 2) and runs_shape("reduce_scatter", 6, 4)
    assert runs_shape("all_gather", 4, 2) is None and runs_shape("all_reduce", 3, 2) is None


@pytest.mark.parametrize("kw,match", [(dict(world_size=1), "world_size"), (dict(ops=("all_to_all",)), "ops"),
                                      (dict(tokens=(0,)), "tokens"), (dict(dtypes=()), "dtypes"),
                                      (dict(modes=("lazy",)), "modes"), (dict(eps=-1.0), "eps")])
def test_config_rejects_bad_values(kw, match):
    args = dict(world_size=2)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        BenchConfig(**args)


# -- arguments ----------------------------------------------------------------------------------------

def _parse(*argv):
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    return p.parse_args(list(argv))


def test_arguments_default_to_the_full_sweep():
    a = _parse()
    assert (a.ops, a.hidden, a.dtype, a.tokens, a.modes, a.contenders) == (None,) * 6
    assert not a.quick and not a.eager and not a.estimate


def test_arguments_parse_lists():
    a = _parse("--ops", "fused,all_gather", "--hidden", "2880,8192", "--dtype", "fp16", "--tokens", "1,16384",
               "--modes", "eager", "--contenders", "nccl,fi_vllm", "--quick", "--world", "2,4")
    assert a.ops == ("fused", "all_gather") and a.hidden == (2880, 8192) and a.dtype == ("fp16",)
    assert a.tokens == (1, 16384) and a.modes == ("eager",) and a.contenders == ("nccl", "fi_vllm") and a.quick
    assert a.world == (2, 4)


@pytest.mark.parametrize("argv", [("--ops", "fused,bogus"), ("--tokens", "0"), ("--hidden", "x"),
                                  ("--dtype", "int8"), ("--contenders", "mpi"), ("--graph-calls", "0")])
def test_arguments_refuse_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert "error" in capsys.readouterr().err


def test_list_types():
    assert int_list("1, 2,3") == (1, 2, 3)
    with pytest.raises(argparse.ArgumentTypeError):
        int_list("")
    with pytest.raises(argparse.ArgumentTypeError):
        choice_list(("a", "b"))("a,c")


# -- the correctness comparison -----------------------------------------------------------------------

def _case(op, dtype="bf16", T=4, H=64):
    return Case(op, T, H, dtype, 2, 0, 1e-6, "cpu")


def test_compare_exact_needs_bits_and_close_allows_rounding():
    torch.manual_seed(0)
    ref = torch.randn(4, 64).to(torch.bfloat16)
    nudged = ref.clone()
    nudged.view(torch.int16)[0, 0] += 1  # one ulp
    assert compare(_case("all_reduce"), {"sum": ref.clone()}, {"sum": ref}, exact=True) is None
    assert "not bit-exact" in compare(_case("all_reduce"), {"sum": nudged}, {"sum": ref}, exact=True)
    assert compare(_case("all_reduce"), {"sum": nudged}, {"sum": ref}, exact=False) is None


def test_compare_fails_a_lost_rank_nan_and_a_wrong_shape():
    torch.manual_seed(1)
    a, b = torch.randn(4, 64), torch.randn(4, 64)
    ref = (a + b).to(torch.bfloat16)
    lost = compare(_case("all_reduce"), {"sum": a.to(torch.bfloat16)}, {"sum": ref}, exact=False)
    assert "relative" in lost
    nan = ref.clone()
    nan[2, 3] = float("nan")
    assert compare(_case("all_reduce"), {"sum": nan}, {"sum": ref}, exact=False)
    assert "shape" in compare(_case("all_reduce"), {"sum": ref[:2]}, {"sum": ref}, exact=False)
    assert "no sum" in compare(_case("all_reduce"), {}, {"sum": ref}, exact=False)


def test_compare_gather_is_exact_for_everyone():
    ref = torch.randn(4, 64).to(torch.float16)
    off = ref.clone()
    off.view(torch.int16)[1, 1] += 1
    assert "not bit-exact" in compare(_case("all_gather", "fp16"), {"gathered": off}, {"gathered": ref},
                                      exact=False)


def test_compare_fp8_dequantised():
    torch.manual_seed(2)
    out = torch.randn(4, 64)
    scale = out.abs().amax(-1, keepdim=True) / 448
    q = (out / scale).to(torch.float8_e4m3fn)
    want = {"q": q, "scale": scale}
    assert compare(_case("fused_fp8"), {"q": q.clone(), "scale": scale.clone()}, want, exact=False) is None
    assert "dequantised" in compare(_case("fused_fp8"), {"q": (-out / scale).to(torch.float8_e4m3fn),
                                                         "scale": scale}, want, exact=False)


def test_tolerances_separate_rounding_from_a_lost_share():
    assert REL_TOL[torch.bfloat16] < 0.1 and REL_TOL[torch.float16] < REL_TOL[torch.bfloat16]


def test_loopback_mode_takes_one_world_size_and_needs_a_gpu(capsys):
    from tpcomm.bench.args import run_bench

    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    assert run_bench(p.parse_args(["--loopback", "--world", "2,4"])) == 2
    assert "one size" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert run_bench(p.parse_args(["--loopback"])) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("options,words", [(["--estimate", "--loopback"], "--loopback has no estimate"),
                                           (["--programs", "4"], "--programs applies with --loopback only"),
                                           (["--run", "x"], "--run applies with --render only")])
def test_options_that_do_not_go_together_are_refused(capsys, options, words):
    from tpcomm.bench.args import run_bench

    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    assert run_bench(p.parse_args(options)) == 2
    assert words in capsys.readouterr().out


def test_a_loopback_child_killed_midway_keeps_its_finished_rows():
    """``bench --loopback`` runs each library in a child with a time limit: the rows a child printed
    before it was killed, or before it failed, are kept, and the note says what happened."""
    import sys

    from tpcomm.bench.loopback import _collect

    script = ("import json, sys, time\n"
              "print('ROW ' + json.dumps({'op': 'all_reduce', 'tokens': 1}), flush=True)\n"
              "print('noise', flush=True)\n"
              "print('ROW ' + json.dumps({'op': 'fused', 'tokens': 1}), flush=True)\n"
              "time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))\n")
    rows, note = _collect([sys.executable, "-c", script, "60", "0"], 3.0, "trtllm at hidden 8192")
    assert [r["op"] for r in rows] == ["all_reduce", "fused"]
    assert note == "trtllm at hidden 8192: killed after 3 s with 2 rows done"
    rows, note = _collect([sys.executable, "-c", script, "0", "3"], 30.0, "tpcomm at hidden 6144")
    assert len(rows) == 2 and note.startswith("tpcomm at hidden 6144: exit 3")
    rows, note = _collect([sys.executable, "-c", script, "0", "0"], 30.0, "x")
    assert len(rows) == 2 and note == ""
