"""``tpcomm soak`` (``tpcomm/soak.py``) on 2 CPU ranks: a short soak passes; a wrong result and a skipped
call are counted (mismatch, hang) and the soak goes on after the hang; every algorithm the dispatch offers
is drawn; the command runs end to end. The 10,000-step GPU soak is run on GPUs (docs/reliability.md)."""

from collections import Counter

import pytest

from tests.tools import ranks
from tpcomm import dispatch, soak
from tpcomm.cli import main as cli_main

#: Steps of the CI soak: 11 calls each, about 1-3 s a step on 2 busy cores.
CI_STEPS = 2


def _cfg(steps, **kw):
    return soak.make_config("cpu", 2, steps, **kw)


def test_short_soak_passes(pools):
    per_rank = pools.get(2).run(ranks.pool_soak, {"steps": CI_STEPS, "seed": 11})
    report, ok = soak.summarize(_cfg(CI_STEPS), per_rank, 0.0)
    assert ok, report
    for r in per_rank:
        want = (CI_STEPS, CI_STEPS * len(soak.KINDS), 0, 0)
        assert (r["steps"], r["calls"], r["mismatches"], r["hangs"]) == want, report
    assert "mismatches 0, hangs 0, checksums agree" in report


def test_soak_counts_a_wrong_result(pools):
    """Rank 0's first all_reduce comes back off by one: one mismatch, on rank 0 only; the soak fails."""
    per_rank = pools.get(2).run(ranks.pool_soak, {"steps": 1, "seed": 12},
                                ("all_reduce", 0, 0, "corrupt"))
    report, ok = soak.summarize(_cfg(1), per_rank, 0.0)
    assert not ok
    assert [r["mismatches"] for r in per_rank] == [1, 0], report
    assert "MISMATCH rank 0: step 0" in report


def test_soak_counts_a_wrong_quantised_byte(pools):
    """Rank 0's first quantised call comes back with one byte of ``q`` off by one bit (its ``out`` right):
    the byte check against the form's reference counts one mismatch, on rank 0 only."""
    algorithms = ("auto",) + tuple(dispatch.ALGORITHMS) + ("fallback",)
    seed = next(s for s in range(100) for c in soak.step_calls(_cfg(1, seed=s), 0, algorithms)
                if c.kind == "fused_quant" and not c.small and c.algorithm != "fallback")
    per_rank = pools.get(2).run(ranks.pool_soak, {"steps": 1, "seed": seed},
                                ("fused_add_rmsnorm", 0, 0, "corrupt_q"))
    report, ok = soak.summarize(_cfg(1), per_rank, 0.0)
    assert not ok
    assert [r["mismatches"] for r in per_rank] == [1, 0], report
    assert "fused_quant" in report.split("MISMATCH rank 0")[1], report


#: A seed whose step 0 makes a kernel all_gather on the default communicator (the call rank 1 skips), in
#: the middle of the step, and whose step 1 makes none there (checked in the test).
HANG_SEED = 6
#: The communicators' timeout there: it also bounds every correct call of the soak, and on 2 cores shared
#: by several test runs a rank can fall half a second behind its peer (0.5 s gave a second, false hang).
HANG_TIMEOUT_S = 2.0


def test_soak_counts_a_hang_and_goes_on(pools):
    """Rank 1 skips its first all_gather that runs a kernel: the waiting rank raises PeerTimeoutError,
    every rank counts one hang, replaces its communicators, and the next step runs clean (the wrapper
    then skips a call again only if the new communicators' first kernel all_gather comes in step 1: the
    seed is chosen so that it does not)."""
    algorithms = ("auto",) + tuple(dispatch.ALGORITHMS) + ("fallback",)
    gathers = [[c for c in soak.step_calls(_cfg(2, seed=HANG_SEED), s, algorithms) if c.kind == "all_gather"][0]
               for s in (0, 1)]
    assert gathers[0].algorithm == "auto" and not gathers[0].small, gathers  # skipped: a kernel call
    assert gathers[1].algorithm == "fallback" or gathers[1].small, gathers  # not skipped again
    cfg = {"steps": 2, "seed": HANG_SEED, "timeout_s": HANG_TIMEOUT_S}
    per_rank = pools.get(2).run(ranks.pool_soak, cfg,
                                ("all_gather", 0, 1, "skip"))
    report, ok = soak.summarize(_cfg(2), per_rank, 0.0)
    assert not ok
    assert [r["hangs"] for r in per_rank] == [1, 1], report
    assert [r["steps"] for r in per_rank] == [2, 2], report
    assert "HANG rank 0: step 0" in report and "PeerTimeoutError" not in report.split("HANG")[0]
    # step 1 (after the hang) made every call
    assert all(r["calls"] >= len(soak.KINDS) for r in per_rank), report


def test_steps_draw_every_algorithm_and_kind():
    """Over 50 steps every kind is called under every algorithm it can take, every quantised form and both
    MoE layouts are drawn (pure: no ranks)."""
    algorithms = ("auto",) + tuple(dispatch.ALGORITHMS) + ("fallback",)
    seen = Counter()
    for step in range(50):
        for c in soak.step_calls(_cfg(50), step, algorithms):
            seen[(c.kind, c.algorithm)] += 1
            seen[("small", c.small)] += 1
            seen[("dtype", c.dtype)] += 1
    for kind in soak.KINDS:
        for a in (("auto", "fallback") if kind in soak.ONE_KERNEL else algorithms):
            assert seen[(kind, a)] > 0, f"{kind} never drawn with {a}"
    assert seen[("small", True)] and seen[("small", False)]
    variants = {c.variant for step in range(50) for c in soak.step_calls(_cfg(50), step, algorithms)}
    assert {v[0] for v in variants if v} >= set(soak.QUANT_FORMS) | {"token", "permuted"}, variants
    assert {d for (k, d) in seen if k == "dtype"} == {"bf16", "fp16", "fp32"}


def test_steps_are_the_same_on_every_rank():
    """The calls depend on (seed, step) only: two draws agree, another seed differs."""
    a = soak.step_calls(_cfg(1, seed=5), 7, ("auto", "one_shot"))
    assert a == soak.step_calls(_cfg(1, seed=5), 7, ("auto", "one_shot"))
    assert a != soak.step_calls(_cfg(1, seed=6), 7, ("auto", "one_shot"))


def test_tpcomm_soak_command(capsys):
    """``tpcomm soak --steps 1 --device cpu``: starts 2 ranks, prints the report, exits 0."""
    status = cli_main(["soak", "--steps", "1", "--device", "cpu", "--seed", "4"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"steps 1, calls {len(soak.KINDS)} per rank (2 ranks, cpu), mismatches 0, hangs 0, checksums agree" in out
    assert out.rstrip().endswith("PASS")


@pytest.mark.parametrize("argv", [["soak", "--steps", "0"], ["soak", "--device", "tpu"]])
def test_tpcomm_soak_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
