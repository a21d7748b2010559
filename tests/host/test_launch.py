"""``tpcomm.launch`` (``tpcomm/launch.py``): rank processes, their set-up, failures and timeouts.
Each launch starts fresh processes (a second or more each), so there are few of them."""

import time

import pytest
import torch

from tests.host import ranks
from tests.support.numerics import Checks
from tpcomm.launch import RankFailure, launch

#: Seconds a launch that must fail fast (a rank sleeping far longer) is given.
SHORT_LAUNCH_TIMEOUT_S = 4.0


def test_launch_returns_results_in_rank_order():
    """Three CPU ranks: results come back in rank order; each rank joined a gloo group of 3 with the
    Triton interpreter on and one thread; a kernel all_reduce works in them."""
    results = launch(ranks.launch_identity, 3, "cpu", args=("tag-7",), timeout_s=120)
    check = Checks()
    check.that(len(results) == 3, f"{len(results)} results")
    for i, res in enumerate(results):
        check.that(res["rank"] == i and res["dist_rank"] == i and res["world_size"] == 3 and res["dist_world"] == 3,
                   f"result {i}: rank {res['rank']} / dist rank {res['dist_rank']} of {res['dist_world']}")
        check.that(res["backend"] == "gloo", f"rank {i}: backend {res['backend']}")
        check.that(res["interpret"] == "1" and res["omp"] == "1" and res["threads"] == 1,
                   f"rank {i}: TRITON_INTERPRET={res['interpret']} OMP_NUM_THREADS={res['omp']} "
                   f"threads={res['threads']}")
        check.that(res["tag"] == "tag-7", f"rank {i}: args not passed: {res['tag']}")
        check.that(res["uses_kernels"], f"rank {i}: the communicator fell back")
        check.that(res["y"] == [[6.0] * 5] * 3 and res["y_dtype"] == "torch.bfloat16",
                   f"rank {i}: all_reduce gave {res['y']} ({res['y_dtype']})")
    check.that(len({res["pid"] for res in results}) == 3, "ranks share a process")
    check.done()


#: Tensors in one rank's result: each travels as a file descriptor fetched from the rank's process, so
#: with this many the rank has exited before the parent has fetched them all (one already fails at times
#: on a busy machine).
RETURNED_TENSORS = 50


def test_launch_returns_tensors():
    """``fn`` may return any picklable value, tensors included, and launch returns it intact."""
    results = launch(ranks.launch_return_tensors, 2, "cpu", args=(RETURNED_TENSORS,), timeout_s=120)
    check = Checks()
    for r, res in enumerate(results):
        want = [[float(r * RETURNED_TENSORS + i)] * 2 for i in range(RETURNED_TENSORS)]
        check.that([t.tolist() for t in res] == want, f"rank {r}: wrong tensors")
    check.done()


def test_rank_that_raises_gives_rank_failure_with_traceback():
    with pytest.raises(RankFailure) as info:
        launch(ranks.launch_raise_on, 2, "cpu", args=(1, "boom-4321"), timeout_s=120)
    msg = str(info.value)
    assert "rank 1" in msg and "Traceback" in msg and "ValueError: boom-4321" in msg and "launch_raise_on" in msg, msg


def test_a_dead_rank_and_what_the_survivors_returned_are_both_reported():
    """One rank exits after set-up; the others catch the PeerTimeoutError their next call raises and
    return it. RankFailure names the dead rank and gives what every survivor returned, in its message
    and in ``outcomes``."""
    from tpcomm import PeerTimeoutError

    with pytest.raises(RankFailure) as info:
        launch(ranks.launch_die_or_catch, 3, "cpu", args=(1.0,), timeout_s=120)
    msg, outcomes = str(info.value), info.value.outcomes
    check = Checks()
    check.that([o.status for o in outcomes] == ["returned", "returned", "died"],
               f"statuses {[o.status for o in outcomes]}: {msg}")
    check.that("rank 2 did not finish: exit code 3" in msg, f"the dead rank is not named with its exit code: {msg}")
    for r in (0, 1):
        value = outcomes[r].value
        check.that(isinstance(value, PeerTimeoutError) and value.peer == 2 and value.rank == r,
                   f"rank {r} returned {value!r}, expected a PeerTimeoutError naming rank 2")
        check.that(f"rank {r} returned: PeerTimeoutError" in msg, f"rank {r}'s outcome missing from: {msg}")
    check.done()


def test_launch_timeout_kills_the_ranks():
    """Ranks that run past ``timeout_s`` are killed and reported, promptly."""
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(ranks.launch_sleep, 2, "cpu", args=(600,), timeout_s=SHORT_LAUNCH_TIMEOUT_S)
    elapsed = time.monotonic() - t0
    assert "did not finish" in str(info.value) and "killed" in str(info.value), str(info.value)
    # 10 s: killing and joining two processes, beyond the timeout itself
    assert elapsed < SHORT_LAUNCH_TIMEOUT_S + 10, f"launch took {elapsed:.1f} s to give up"


@pytest.mark.parametrize("kwargs,word", [({"world_size": 0}, "world_size"), ({"device": "tpu"}, "device"),
                                         ({"device": "cuda", "world_size": 4096}, "world_size")],
                         ids=["world_size_0", "device_tpu", "more_gpus_than_visible"])
def test_launch_bad_arguments(kwargs, word):
    args = {"world_size": 2, "device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=word):
        launch(ranks.launch_sleep, args["world_size"], args["device"], args=(0,))


@pytest.mark.parametrize("world_size,args,word", [(2.0, (0,), "world_size"), (True, (0,), "world_size"),
                                                  (2, "aot_eager", "args")],
                         ids=["world_size_float", "world_size_bool", "args_string"])
def test_launch_bad_argument_types(world_size, args, word):
    """A string given as ``args`` would be split into characters: a TypeError names ``args`` first."""
    with pytest.raises(TypeError, match=word):
        launch(ranks.launch_sleep, world_size, "cpu", args=args)


@pytest.mark.parametrize("timeout_s", ["auto", 0, -1.0, float("inf"), True], ids=str)
def test_launch_bad_timeout(timeout_s):
    """A timeout that is not a positive, finite number of seconds is refused before any rank starts."""
    with pytest.raises(ValueError, match="timeout_s"):
        launch(ranks.launch_sleep, 2, "cpu", args=(0,), timeout_s=timeout_s)


def test_launch_refuses_a_function_no_rank_can_load():
    """A lambda (not importable by name) is refused before any rank starts, naming the remedy, instead of
    every rank dying while it unpickles its function."""
    t0 = time.monotonic()
    with pytest.raises(TypeError, match="module level"):
        launch(lambda rank, world_size: rank, 2, "cpu")
    assert time.monotonic() - t0 < 2, "ranks were started"


def test_launch_from_python_c_says_why():
    """``fn`` defined under ``python -c`` (as in a REPL or a notebook): a ValueError that says so, before any
    rank starts, instead of "exit code 1" of every rank."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("from tpcomm.launch import launch\n"
            "def work(rank, world_size):\n    return rank\n"
            "try:\n    launch(work, 2, 'cpu')\nexcept ValueError as e:\n    print('RAISED', e)\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RAISED launch: fn work is defined in a __main__ without a file (python -c" in proc.stdout, proc.stdout


def test_each_launch_gives_its_ranks_the_environment_of_that_moment(monkeypatch):
    """Ranks fork from a server started at the first launch (``rank_context``), yet each launch's ranks
    see the launching process's variables as they are at that launch, set and unset."""
    names = ("TPCOMM_TEST_MARK", "TPCOMM_TEST_GONE")
    monkeypatch.setenv("TPCOMM_TEST_GONE", "here")
    monkeypatch.setenv("TPCOMM_TEST_MARK", "first")
    (first, interpreted), = launch(ranks.launch_environment, 1, "cpu", args=(names,), timeout_s=120)
    monkeypatch.setenv("TPCOMM_TEST_MARK", "second")
    monkeypatch.delenv("TPCOMM_TEST_GONE")
    (second, _), = launch(ranks.launch_environment, 1, "cpu", args=(names,), timeout_s=120)
    assert first == {"TPCOMM_TEST_MARK": "first", "TPCOMM_TEST_GONE": "here"}, first
    assert second == {"TPCOMM_TEST_MARK": "second", "TPCOMM_TEST_GONE": None}, second
    assert interpreted, "a CPU rank's kernels do not run under the interpreter"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_rank_after_a_cpu_launch():
    """A CPU launch first (the fork server then starts with the CPU ranks' variables), then one CUDA
    rank: NCCL works in it, its kernels are compiled (no interpreter) and NVLS is off."""
    launch(ranks.launch_sleep, 1, "cpu", args=(0.0,), timeout_s=120)
    (values, nvls, interpreted, device), = launch(ranks.launch_cuda_rank, 1, "cuda", timeout_s=300)
    assert values == [1.0] * 4 and nvls == "0" and not interpreted and device == 0, (values, nvls, interpreted)
