"""The collectives on ``GPU_WORLD`` GPUs (NCCL group, symmetric memory): every algorithm gives the same bits at real
shapes, interleaved calls of every op, size and algorithm, and all_gather / reduce_scatter inside CUDA
graphs replayed with new inputs. Marked ``gpu``; skipped unless that many CUDA GPUs are visible. Run on the GPU
machine: ``python3 -m pytest -q -m gpu tests/collectives/test_gpu_collectives.py -p no:cacheprovider``.

One launch (module fixture) runs every part in the ranks (``tests/collectives/gpu_ranks.py``); each test
reads its part's summary from both ranks: the failures each rank found (empty when right) and hashes of
the output bits, which must agree between the GPUs.
"""

import pytest

from tests.collectives import gpu_ranks as gcc
from tests.support.gpu_world import GPU_WORLD, NEEDS_GPUS
from tests.support.numerics import Checks
from tpcomm import dispatch
from tpcomm.launch import launch

pytestmark = [pytest.mark.gpu, NEEDS_GPUS]

#: one_shot first: every other algorithm is compared with it.
ALGOS = ["one_shot", *[a for a in dispatch.ALGORITHMS if a != "one_shot"], "fallback"]
#: Hidden sizes of real models (2880: gpt-oss; 4096 .. 8192: Llama / Qwen class; 16384: two tiles of 8192).
HIDDEN = [2880, 4096, 6144, 8192, 16384]
#: Outputs of each case: the all_reduce and the fused op everywhere; the no-residual and Gemma forms at
#: one width of each tiling (one tile of 4096, two tiles of 8192), which is what they change.
ALL_OUTPUTS = ("s", "fused", "no_res", "gemma")
SOME_OUTPUTS = ("s", "fused")
#: Prefixes checked inside the 4096-row calls (batch invariance): one row, three, and a thousand.
PREFIXES = [1, 3, 1000]


def _cases():
    cases = []
    for H in HIDDEN:
        which = ALL_OUTPUTS if H in (4096, 16384) else SOME_OUTPUTS
        for T in (3, 4096):
            cases.append((f"bfloat16-{H}x{T}", "bfloat16", H, T, which, PREFIXES if T == 4096 else []))
    cases += [(f"bfloat16-{H}x1", "bfloat16", H, 1, SOME_OUTPUTS, []) for H in (6144, 16384)]
    cases += [(f"{d}-4096x{T}", d, 4096, T, SOME_OUTPUTS, []) for d in ("float16", "float32") for T in (3, 1000)]
    return cases


CASES = _cases()
#: Kernel timeout of the parts (a peer that is seconds late is a bug here, not a busy machine).
TIMEOUT_S = 10.0

#: (op, T, H, dtype, algorithm): 1 row, thousands of rows, 3 rows, partial tiles (2880 of 4096, a flat
#: all_reduce whose last row holds 4 elements), T < W for reduce_scatter, the fallback between kernels.
INTERLEAVE = [
    ("fused", 1, 6144, "bfloat16", "lamport"),
    ("fused", 4096, 6144, "bfloat16", "two_shot"),
    ("all_gather", 3, 4096, "bfloat16", "auto"),
    ("fused", 3, 2880, "bfloat16", "one_shot"),
    ("reduce_scatter", 4096, 4096, "bfloat16", "auto"),
    ("all_reduce", 1, 4100, "bfloat16", "lamport"),
    ("fused_no_res", 1000, 8192, "float16", "one_shot"),
    ("all_gather", 4096, 2880, "bfloat16", "auto"),
    ("fused", 64, 4096, "bfloat16", "fallback"),
    ("reduce_scatter", 1, 6144, "bfloat16", "auto"),
    ("all_reduce", 2048, 4096, "float32", "two_shot"),
    ("fused", 3, 16384, "bfloat16", "lamport"),
    ("reduce_scatter", 5, 2880, "float16", "auto"),
    ("fused", 17, 4096, "float32", "one_shot"),
]
INTERLEAVE_ROUNDS = 3
#: Largest per-call delay of a rank (µs): a few times a small call's own duration.
MAX_DELAY_US = 30.0

#: Calls captured in one graph (op, T, H, dtype, dim): all_gather along rows and along the hidden dim,
#: reduce_scatter with T divisible by 2, odd, and T < W (rank 1's share is empty), a two-shot fused call.
GRAPH_CALLS = [
    ("all_gather", 64, 4096, "bfloat16", 0),
    ("all_gather", 5, 2880, "float16", 1),
    ("reduce_scatter", 1024, 6144, "bfloat16", 0),
    ("reduce_scatter", 5, 4096, "bfloat16", 0),
    ("reduce_scatter", 1, 8192, "bfloat16", 0),
    ("fused", 256, 4096, "bfloat16", 0),
]
GRAPH_SIDE_CALL = ("all_gather", 1, 4096, "float32", 0)
#: Replays: odd, so the graph's calls end on the other epoch parity than they started.
GRAPH_REPLAYS = 21

SPEC = {
    "algorithms": {"cases": CASES, "algos": ALGOS, "timeout_s": TIMEOUT_S},
    "interleave": {"steps": INTERLEAVE, "rounds": INTERLEAVE_ROUNDS, "max_delay_us": MAX_DELAY_US,
                   "timeout_s": TIMEOUT_S},
    "graphs": {"calls": GRAPH_CALLS, "side_call": GRAPH_SIDE_CALL, "replays": GRAPH_REPLAYS,
               "timeout_s": TIMEOUT_S},
}
#: Seconds for the one launch (compiling every kernel variant included).
LAUNCH_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def parts():
    """Per rank: ``{part: summary}`` from one launch on GPU_WORLD GPUs."""
    return launch(gcc.run_all, GPU_WORLD, "cuda", args=(SPEC,), timeout_s=LAUNCH_TIMEOUT_S)


def _part(parts, name, check):
    sums = [per_rank[name] for per_rank in parts]
    for r, s in enumerate(sums):
        check.that("error" not in s, f"rank {r}: the {name} part raised:\n{s.get('error')}")
    return sums


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_algorithm_gives_the_same_bits(parts, case):
    """lamport, one_shot, two_shot and fallback forced on the same wide-range inputs: all_reduce and
    residual_out exactly the reference's; every output of the kernels bit-identical to one-shot's (the
    fallback's norm within the ulp tolerance); the first 1, 3 and 1000 rows alone identical to those rows
    of the 4096-row call (the fallback's norm outputs: test_fallback_norm_is_batch_invariant); both GPUs
    identical."""
    check = Checks()
    sums = _part(parts, "algorithms", check)
    per_rank = [s.get("cases", {}).get(case) for s in sums]
    for r, s in enumerate(per_rank):
        check.that(s is not None, f"rank {r}: case {case} did not run (an earlier case raised)")
        if s is not None:
            check.that(not s["failures"], f"rank {r}:\n" + "\n".join(s["failures"][:20]))
    if all(s is not None for s in per_rank):
        check.that(per_rank[0]["hashes"] == per_rank[1]["hashes"], "the GPUs' output bits differ")
    check.done()


def test_interleaved_calls(parts):
    """INTERLEAVE_ROUNDS rounds of very different calls back to back on one communicator, each GPU
    delayed differently before every call: every output right, both GPUs identical."""
    check = Checks()
    sums = _part(parts, "interleave", check)
    for r, s in enumerate(sums):
        check.that(not s.get("failures", ["no result"]), f"rank {r}:\n" + "\n".join(s.get("failures", [])[:20]))
        check.that(len(s.get("hashes", [])) == INTERLEAVE_ROUNDS * len(INTERLEAVE), f"rank {r}: steps missing")
    check.that(sums[0].get("hashes") == sums[1].get("hashes"), "the GPUs' output bits differ")
    check.done()


def test_gather_and_scatter_in_cuda_graphs(parts):
    """GRAPH_CALLS captured in one graph and another all_gather in a second, replayed GRAPH_REPLAYS times
    with new inputs (interleaved with eager calls): every replay equals the reference and eager calls
    on the same inputs, on both GPUs alike."""
    check = Checks()
    sums = _part(parts, "graphs", check)
    for r, s in enumerate(sums):
        check.that(not s.get("failures", ["no result"]), f"rank {r}:\n" + "\n".join(s.get("failures", [])[:20]))
        check.that(s.get("replays") == GRAPH_REPLAYS, f"rank {r}: {s.get('replays')} replays checked")
    check.that(sums[0].get("hashes") == sums[1].get("hashes"), "the GPUs' output bits differ")
    check.done()


def test_fallback_norm_is_batch_invariant(parts):
    """docs/numerics.md item 1: the number of rows never changes a row's result, for every algorithm:
    the fallback's out, out_no_residual and out_gemma of the first 1, 3 and 1000 rows alone equal those
    rows of the 4096-row call."""
    check = Checks()
    sums = _part(parts, "algorithms", check)
    for r, s in enumerate(sums):
        for case, summary in s.get("cases", {}).items():
            check.that(not summary["fallback_prefix"], f"rank {r} {case}:\n" + "\n".join(summary["fallback_prefix"]))
    check.done()
