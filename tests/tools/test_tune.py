"""``tpcomm tune`` on the CPU: the sweep's sizes, the crossover rule on synthetic timings, merging the ranks,
the table it writes (loaded back by a Communicator), the report, the command's refusal without GPUs, and
the rank sweep itself on 2 CPU ranks (eager mode: its times mean nothing, its plumbing is checked)."""

import json
import random

import pytest

from tests.tools import ranks
from tpcomm import dispatch
from tpcomm.cli import main as cli_main
from tpcomm.tune import command, config
from tpcomm.tune.config import TuneConfig, make_config
from tpcomm.tune.crossover import NEVER, Margin, derive, format_bytes, winner
from tpcomm.tune.report import op_table, threshold_lines
from tpcomm.tune.summary import OpTimes, build_table, by_op, choices, differences, merge_ranks

KiB, MiB = 1 << 10, 1 << 20
M = Margin()  # 2 %, 0.3 µs


# -- the sweep --------------------------------------------------------------------------------------

def test_grid_is_geometric_and_spans_the_speed_goals():
    ar = config.all_reduce_sizes()
    assert ar[0] == 8 * KiB and ar[-1] == 64 * MiB and len(ar) == 27
    assert all(1.3 <= b / a <= 1.5 for a, b in zip(ar, ar[1:]))  # 3/2 and 4/3 alternate
    assert all(n % 4 == 0 for n in ar)  # every size is whole fp32 elements too
    t = config.fused_tokens(6144, "bf16")
    assert t[0] == 1 and t[-1] == 16384 and list(t) == sorted(set(t))
    assert 341 in t  # 341 x 6144 x 2 bytes: the largest message LAMPORT_MAX_BYTES takes
    assert 341 * 6144 * 2 <= dispatch.LAMPORT_MAX_BYTES < 342 * 6144 * 2
    assert config.lamport_max_tokens(6144, "bf16") not in config.fused_tokens(6144, "fp32")
    for quick in (False, True):
        q = make_config(2, quick=quick)
        assert q.ar_bytes[0] == 8 * KiB and q.ar_bytes[-1] == 64 * MiB and q.fused_tokens[-1] == 16384


def test_lamport_is_timed_only_for_16_bit_up_to_its_cap():
    bf, fp32 = TuneConfig(world_size=2), TuneConfig(world_size=2, dtype="fp32")
    assert bf.algorithms(dispatch.LAMPORT_MAX_BYTES) == ("lamport", "one_shot", "two_shot")
    assert bf.algorithms(dispatch.LAMPORT_MAX_BYTES + 4) == ("one_shot", "two_shot")
    assert fp32.algorithms(8 * KiB) == ("one_shot", "two_shot")
    assert bf.sizes("fused_add_rmsnorm")[0] == (1 * 6144 * 2, 1)
    assert bf.sizes("all_reduce")[0] == (8 * KiB, None)


@pytest.mark.parametrize("kw,match", [
    ({"world_size": 1}, "world_size"), ({"dtype": "int8"}, "dtype"), ({"hidden": 0}, "hidden"),
    ({"ops": ("all_gather",)}, "ops"), ({"ar_bytes": (64, 32)}, "ar_bytes"),
    ({"dtype": "fp32", "ar_bytes": (6,)}, "ar_bytes"), ({"fused_tokens": (0,)}, "fused_tokens"),
    ({"replays": 0}, "replays"), ({"margin_rel": -0.1}, "margin"),
])
def test_bad_config_names_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        TuneConfig(**{"world_size": 2, **kw})


def test_estimate_is_within_the_time_targets():
    """The sweep's time targets on 2 GPUs: the default sweep within 3 minutes, --quick within 1 (by the
    model in tpcomm/tune/config.py, which errs long)."""
    full, quick = config.estimate_seconds(make_config(2)), config.estimate_seconds(make_config(2, quick=True))
    assert quick < full <= 180 and quick <= 60


def test_output_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config.default_out_path(4) == str(tmp_path / ".cache" / "tpcomm" / "dispatch-w4.json")
    assert config.measurements_path("/x/t.json") == "/x/t-measurements.json"


# -- the rule ---------------------------------------------------------------------------------------

def test_margin():
    assert M.beats(9.0, 10.0) and not M.beats(9.8, 10.0)  # 0.3 µs floor at small times
    assert M.beats(190.0, 200.0) and not M.beats(197.0, 200.0)  # 2 % of 200 µs is 4 µs
    assert not M.beats(None, 1.0) and not M.beats(1.0, None)


def _times(lam, one, two):
    return {"lamport": list(lam), "one_shot": list(one), "two_shot": list(two)}


SIZES = [1 * MiB, 2 * MiB, 3 * MiB, 4 * MiB, 6 * MiB, 8 * MiB, 12 * MiB, 16 * MiB]


def test_clean_crossings():
    d = derive(SIZES, _times([8, 9, 10, 11, None, None, None, None],
                             [9, 9.5, 10.5, 10, 14, 18, 26, 34],
                             [10, 10.5, 11, 11.5, 14, 16, 22, 28]))
    # Lamport not beaten through 3 MiB (10 vs 10.5), beaten at 4 MiB (11 vs 10); two-shot ties at 6 MiB
    # (one-shot's, below its first win) and beats one-shot from 8 MiB on.
    assert (d.lamport_max_bytes, d.two_shot_min_bytes, d.notes) == (3 * MiB, 8 * MiB, [])


def test_noise_within_the_margin_does_not_split_a_range():
    # one-shot 0.2 µs ahead of Lamport at 2 MiB (noise) and 1 % ahead of two-shot at 12 MiB (noise)
    d = derive(SIZES, _times([8, 9.2, 10, 11, None, None, None, None],
                             [9, 9.0, 10.5, 9, 14, 20, 26.6, 40],
                             [10, 10.5, 11, 11.5, 14.5, 16, 26.9, 30]))
    assert (d.lamport_max_bytes, d.two_shot_min_bytes, d.notes) == (3 * MiB, 8 * MiB, [])


def test_lamport_losing_at_the_smallest_size_turns_it_off():
    d = derive(SIZES[:2], _times([10, 11], [9, 10], [12, 13]))
    assert d.lamport_max_bytes == 0


def test_lamport_winning_up_to_its_cap_stops_at_the_last_size_measured():
    d = derive(SIZES, _times([1, 1, 1, 1, None, None, None, None], [9] * 8, [9.5] * 8))
    assert d.lamport_max_bytes == 4 * MiB
    # a Lamport time above the cap is ignored: the dispatch never uses it there
    d = derive(SIZES, _times([1] * 8, [9] * 8, [9.5] * 8), lamport_cap=3 * MiB)
    assert d.lamport_max_bytes == 3 * MiB


def test_lamport_winning_again_after_a_loss_is_reported():
    d = derive(SIZES[:4], _times([8, 12, 8, 9], [9, 10, 10, 11], [10, 11, 11, 12]))
    assert d.lamport_max_bytes == 1 * MiB
    assert len(d.notes) == 1 and "Lamport beats the others again at 3 MiB" in d.notes[0]


def test_two_shot_that_never_wins_is_never_used():
    d = derive(SIZES, _times([None] * 8, [10 * i for i in range(1, 9)], [10 * i + 5 for i in range(1, 9)]))
    assert d.two_shot_min_bytes == NEVER > max(SIZES) and d.notes == []
    assert format_bytes(d.two_shot_min_bytes) == "never"


def test_two_shot_losing_at_the_largest_size_is_never_used_and_reported():
    d = derive(SIZES, _times([None] * 8, [10, 20, 30, 40, 50, 60, 70, 80], [10, 20, 30, 30, 40, 50, 60, 90]))
    assert d.two_shot_min_bytes == NEVER
    assert len(d.notes) == 1 and "loses at a larger size" in d.notes[0]


def test_two_shot_is_kept_from_the_contiguous_range_and_an_early_win_is_reported():
    # two-shot wins at 2 MiB, loses at 3 MiB, then wins from 6 MiB on (tie at 4 MiB goes to one-shot)
    d = derive(SIZES, _times([None] * 8, [10, 20, 30, 40, 50, 60, 70, 80], [10, 15, 35, 40, 40, 50, 60, 70]))
    assert d.two_shot_min_bytes == 6 * MiB
    assert len(d.notes) == 1 and "beats one-shot at 2 MiB" in d.notes[0]


def test_fp32_has_no_lamport_threshold():
    d = derive(SIZES[:3], {"one_shot": [1, 2, 3], "two_shot": [2, 2.5, 2.0]})
    assert d.lamport_max_bytes is None and d.two_shot_min_bytes == 3 * MiB


@pytest.mark.parametrize("sizes,times,match", [
    ([], {}, "sizes"), ([2, 1], {"one_shot": [1, 1]}, "ascending"), ([1, 1], {"one_shot": [1, 1]}, "ascending"),
    ([1, 2], {"one_shot": [1]}, "1 values for 2 sizes"), ([1], {"nccl": [1]}, "unknown algorithm"),
])
def test_derive_bad_input(sizes, times, match):
    with pytest.raises(ValueError, match=match):
        derive(sizes, times)


@pytest.mark.parametrize("seed", range(6))
def test_the_tuned_choice_is_within_the_margin_of_the_fastest(seed):
    """Latency + bytes / bandwidth models with one crossing each (Lamport: lowest latency, lowest
    bandwidth; two-shot: highest of both), noise of up to a quarter of the margin: at every size, the
    algorithm the tuned table makes the dispatch choose is within the margin of the fastest measured."""
    rng = random.Random(seed)
    sizes = list(config.all_reduce_sizes())
    lat = {"lamport": rng.uniform(5, 7), "one_shot": rng.uniform(7, 9), "two_shot": rng.uniform(9, 12)}
    gbps = {"lamport": rng.uniform(80, 150), "one_shot": rng.uniform(180, 250), "two_shot": rng.uniform(280, 380)}

    def t(a, n):
        base = lat[a] + n / (gbps[a] * 1e3)
        return base + rng.uniform(-1, 1) * max(M.abs_us, M.rel * base) / 4

    times = {a: [t(a, n) if (a != "lamport" or n <= dispatch.LAMPORT_MAX_BYTES) else None for n in sizes]
             for a in lat}
    d = derive(sizes, times, M)
    assert d.notes == []
    cfg = TuneConfig(world_size=2)
    table = build_table(cfg, {"all_reduce": d}, "synthetic", "test")
    picks = choices(OpTimes("all_reduce", sizes, [None] * len(sizes), times), cfg, table)
    for i, (n, pick) in enumerate(zip(sizes, picks)):
        best = min(ts[i] for ts in times.values() if ts[i] is not None)
        got = times[pick][i]
        assert got <= best + max(M.abs_us, M.rel * got) + 1e-9, (format_bytes(n), pick, got, best)


def test_winner_is_the_raw_fastest():
    assert winner({"lamport": None, "one_shot": 5.0, "two_shot": 4.9}) == "two_shot"
    assert winner({"one_shot": None}) is None


# -- the ranks' results -------------------------------------------------------------------------------

def _item(op, n, algo, us=None, tokens=None, **kw):
    it = {"op": op, "bytes": n, "tokens": tokens, "algorithm": algo, "calls": 20, **kw}
    if us is not None:
        it["us"] = us
    return it


def test_merge_takes_the_slowest_rank_per_replay_then_the_median():
    na = _item("all_reduce", 8192, "two_shot", na="x")
    r0 = {"items": [_item("all_reduce", 8192, "one_shot", [1.0, 5.0, 2.0, 9.0]), na]}
    r1 = {"items": [_item("all_reduce", 8192, "one_shot", [3.0, 1.0, 4.0]), na]}
    m = merge_ranks([r0, r1])
    assert m[0]["times_us"] == [3.0, 5.0, 4.0] and m[0]["median_us"] == 4.0 and m[0]["replays"] == 3
    assert m[0]["min_us"] == 3.0 and m[0]["max_us"] == 5.0
    assert m[1]["na"] == "x" and "median_us" not in m[1]


def test_merge_reports_an_error_of_any_rank_and_refuses_misaligned_ranks():
    r0 = {"items": [_item("all_reduce", 8192, "lamport", [1.0])]}
    r1 = {"items": [_item("all_reduce", 8192, "lamport", error="rank 1: boom")]}
    assert merge_ranks([r0, r1])[0]["error"] == "rank 1: boom"
    r2 = {"items": [_item("all_reduce", 16384, "lamport", [1.0])]}
    with pytest.raises(ValueError, match="differs between ranks"):
        merge_ranks([r0, r2])
    with pytest.raises(ValueError, match="items"):
        merge_ranks([r0, {"items": []}])


def test_by_op_arranges_sizes_and_algorithms():
    merged = merge_ranks([{"items": [
        _item("fused_add_rmsnorm", 24576, "lamport", [3.0], tokens=2),
        _item("fused_add_rmsnorm", 24576, "one_shot", [4.0], tokens=2),
        _item("fused_add_rmsnorm", 12288, "one_shot", [2.0], tokens=1), _item("all_reduce", 8192, "one_shot", [1.0])]}])
    t = by_op(merged, "fused_add_rmsnorm")
    assert t.sizes == [12288, 24576] and t.tokens == [1, 2]
    assert t.median_us == {"lamport": [None, 3.0], "one_shot": [2.0, 4.0], "two_shot": [None, None]}
    with pytest.raises(ValueError, match="no measurements"):
        by_op(merged, "nope")


# -- the table and the report -------------------------------------------------------------------------

def test_table_round_trips_and_keeps_the_default_lamport_for_fp32():
    cfg = TuneConfig(world_size=4, dtype="fp32")
    table = build_table(cfg, {"all_reduce": derive(SIZES[:2], {"one_shot": [1, 2], "two_shot": [2, 1]})}, "src", "dev")
    back = dispatch.CrossoverTable.from_json(table.to_json())
    c = back.lookup("all_reduce", 4)
    assert c.lamport_max_bytes == dispatch.DEFAULT_TABLE.lookup("all_reduce", 4).lamport_max_bytes
    assert c.two_shot_min_bytes == 2 * MiB and "kept from the defaults" in c.source and back.device == "dev"
    assert set(back.entries) == {"all_reduce"} and set(back.entries["all_reduce"]) == {4}
    # ops the tune did not measure fall back to the defaults
    assert back.lookup("fused_add_rmsnorm", 4) == dispatch.DEFAULT_TABLE.lookup("fused_add_rmsnorm", 4)


def _fused_times():
    sizes = [12288 * t for t in (1, 256, 512, 1024)]
    return OpTimes("fused_add_rmsnorm", sizes, [1, 256, 512, 1024],
                   {"lamport": [5.0, 19.5, None, None], "one_shot": [6.0, 19.4, 30.0, 63.0],
                    "two_shot": [7.0, 21.0, 25.0, 48.0]})


def test_differences_from_the_default_table_name_both_picks_and_times():
    cfg = TuneConfig(world_size=2)
    t = _fused_times()
    d = derive(t.sizes, t.median_us)
    assert (d.lamport_max_bytes, d.two_shot_min_bytes) == (3 * MiB, 6 * MiB)
    table = build_table(cfg, {"fused_add_rmsnorm": d}, "src", "dev")
    # a base table with two-shot from 12 MiB runs one-shot at 512 tokens (6 MiB), the tuned table two-shot
    base = dispatch.CrossoverTable({"fused_add_rmsnorm": {2: dispatch.Crossover(4 * MiB, 12 * MiB)}})
    diffs = differences(t, cfg, table, base)
    assert diffs == [{"bytes": 6 * MiB, "tokens": 512, "base": "one_shot", "tuned": "two_shot",
                      "base_us": 30.0, "tuned_us": 25.0}]
    text = "\n".join(threshold_lines("fused_add_rmsnorm", cfg, d, table, diffs, base))
    assert "two_shot_min_bytes 6 MiB (default 12 MiB)" in text and "the tuned pick saves 17%" in text


def test_op_table_marks_the_fastest_and_only_differing_default_picks():
    cfg = TuneConfig(world_size=2)
    t = _fused_times()
    table = build_table(cfg, {"fused_add_rmsnorm": derive(t.sizes, t.median_us)}, "src", "dev")
    base = dispatch.CrossoverTable({"fused_add_rmsnorm": {2: dispatch.Crossover(4 * MiB, 12 * MiB)}})
    lines = op_table(t, cfg, table, base).splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["size/rank", "tokens", "lamport µs", "one_shot µs",
                                                              "two_shot µs", "tuned pick", "default pick"]
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in lines[2:]]
    assert cells[0] == ["12 KiB", "1", "5.0*", "6.0", "7.0", "lamport", ""]
    assert cells[1] == ["3 MiB", "256", "19.5", "19.4*", "21.0", "lamport", ""]  # a tie: Lamport kept
    assert cells[2] == ["6 MiB", "512", "-", "30.0", "25.0*", "two_shot", "one_shot"]


# -- the command --------------------------------------------------------------------------------------

def test_command_refuses_a_machine_without_gpus(capsys):
    assert cli_main(["tune"]) == 2
    out = capsys.readouterr().out
    assert "needs at least 2 CUDA GPUs" in out and "no CPU mode" in out
    assert cli_main(["tune", "--estimate", "--quick"]) == 0
    assert "Estimated device time" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["tune", "--ops", "all_gather"], ["tune", "--dtype", "int8"],
                                  ["tune", "--margin-pct", "-1"], ["tune", "--hidden", "0"]])
def test_command_rejects_bad_options(argv):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2


def test_command_line_reproduces_the_config():
    cfg = make_config(2, hidden=4096, ops=("all_reduce",), quick=True, margin_rel=0.05)
    assert command.command_line(cfg, "/t.json") == ("tpcomm tune --world 2 --hidden 4096 --dtype bf16 --ops "
                                                    "all_reduce --quick --margin-pct 5 --margin-us 0.3 --out /t.json")


def _per_rank(items_by_rank, fallback=None):
    info = {"host": "h", "gpu": "GPU", "torch": "t", "triton": "tr"}
    return [{"info": info, "fallback": fallback, "items": items} for items in items_by_rank]


def test_finish_refuses_failed_measurements_and_the_fallback(tmp_path, capsys):
    cfg = TuneConfig(world_size=2, ops=("all_reduce",), ar_bytes=(8192,))
    out = str(tmp_path / "t.json")
    bad = _per_rank([[_item("all_reduce", 8192, "one_shot", [1.0])],
                     [_item("all_reduce", 8192, "one_shot", error="check failed: sum not bit-exact")]])
    assert command.finish(cfg, bad, out, "cmd") == 1
    assert not (tmp_path / "t.json").exists()
    assert "sum not bit-exact" in json.loads((tmp_path / "t-measurements.json").read_text())["measurements"][0]["error"]
    assert command.finish(cfg, _per_rank([[], []], fallback="the group spans several hosts"), out, "cmd") == 1
    assert "nothing to tune" in capsys.readouterr().out


def test_sweep_on_cpu_ranks_then_the_table_is_loaded_by_a_communicator(pools, tmp_path, capsys):
    """The rank sweep (eager, 2 CPU ranks, tiny shapes): every algorithm passes its check and is timed;
    ``finish`` writes a table; a new Communicator with ``TPCOMM_DISPATCH_TABLE`` loads it and plans by it."""
    cfg = TuneConfig(world_size=2, hidden=16, ar_bytes=(64,), fused_tokens=(1, 3), graph_calls=1, replays=1,
                     min_replays=1, warmup_replays=0)
    pool = pools.get(2)
    per_rank = pool.run(ranks.tiny_sweep, cfg)
    assert all(r["graph_refused"] == "measure: graph mode needs CUDA ranks (NCCL)" for r in per_rank)
    got = [(it["op"], it["bytes"], it["algorithm"]) for it in per_rank[0]["items"]]
    assert got == [(op, n, a) for op, n in (("all_reduce", 64), ("fused_add_rmsnorm", 32), ("fused_add_rmsnorm", 96))
                   for a in ("lamport", "one_shot", "two_shot")]
    assert all(len(it.get("us", [])) == 1 for r in per_rank for it in r["items"]), per_rank
    out = tmp_path / "dispatch-w2.json"
    assert command.finish(cfg, per_rank, str(out), "tpcomm tune --world 2") == 0
    printed = capsys.readouterr().out
    assert f"export TPCOMM_DISPATCH_TABLE={out}" in printed and "### fused_add_rmsnorm" in printed
    raw = json.loads((tmp_path / "dispatch-w2-measurements.json").read_text())
    assert len(raw["measurements"]) == 9 and raw["environment"]["command"] == "tpcomm tune --world 2"
    table = dispatch.CrossoverTable.from_json(out.read_text())
    # rewrite the thresholds to known values, so the plans below tell the table was used
    table.entries["all_reduce"][2] = dispatch.Crossover(0, 64 * KiB, "test")
    table.entries["fused_add_rmsnorm"][2] = dispatch.Crossover(16 * KiB, 32 * KiB, "test")
    out.write_text(table.to_json())
    probes = [("all_reduce", 8 * KiB, 0), ("all_reduce", 64 * KiB, 0), ("fused_add_rmsnorm", 8 * KiB, 16),
              ("fused_add_rmsnorm", 24 * KiB, 16), ("fused_add_rmsnorm", 32 * KiB, 16)]
    for plans, loaded in pool.run(ranks.plans_with_table, str(out), probes):
        assert plans == ["one_shot", "two_shot", "lamport", "one_shot", "two_shot"]
        assert dispatch.CrossoverTable.from_json(loaded).lookup("all_reduce", 2).source == "test"
