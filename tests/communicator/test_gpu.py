"""The correctness checks of the CPU suite on ``GPU_WORLD`` GPUs (NCCL group, symmetric memory), plus CUDA-graph
capture and replay. Marked ``gpu``; skipped unless that many CUDA GPUs are visible. Run on a machine with GPUs:
``python -m pytest -q -m gpu tests/communicator/test_gpu.py``.

Spawning ranks and joining NCCL costs seconds, so each module-scoped fixture launches once and runs
every case inside the ranks (``tests/communicator/gpu_ranks.py``); each parametrized test then reads its own case's
summary from every rank.
"""

import pytest

from tests.communicator import gpu_ranks
from tests.support.gpu_world import GPU_WORLD, NEEDS_GPUS
from tests.support.numerics import Checks, algo_dtype_pairs, dtype_name
from tpcomm.launch import launch

pytestmark = [pytest.mark.gpu, NEEDS_GPUS]

#: Hidden sizes of real models (2880: gpt-oss; 4096, 6144, 7168, 8192: Llama / Qwen / DeepSeek class).
HIDDEN = [2880, 4096, 6144, 7168, 8192]
#: Tokens from decode (1) to prefill (4096).
TOKENS = [1, 16, 64, 256, 1024, 4096]
#: Cases that also run through a communicator with a small workspace (several launches per call).
CHUNKED_HIDDEN, CHUNKED_TOKENS = (4096, 7168), (64, 1024)
#: Bytes per launch of that communicator: at 2 GPUs 256 KiB carries 32 rows of 4096 bf16, so 1024 rows
#: take 32 launches, and 64 rows two; it shrinks with the world size so that two-shot, whose launch
#: carries a share of half a slot per rank, still takes at least two launches for 64 rows.
CHUNK_MAX_BYTES = (512 << 10) // GPU_WORLD
#: Seconds for one launch of every eager case (about 150 cases, most of them small).
EAGER_LAUNCH_TIMEOUT_S = 900

#: Non-contiguous and misaligned inputs (tests.collectives.ranks.layout_of), at one decode and one prefill shape.
LAYOUTS, LAYOUT_SHAPES = ("strided", "transposed", "offset"), ((16, 4096), (1024, 7168))

CASES = ([(f"{a}-{dtype_name(d)}-{H}x{T}", a, dtype_name(d), H, T, H in CHUNKED_HIDDEN and T in CHUNKED_TOKENS,
           "contiguous") for a, d in algo_dtype_pairs() for H in HIDDEN for T in TOKENS]
         + [(f"{a}-{dtype_name(d)}-{H}x{T}-{lay}", a, dtype_name(d), H, T, False, lay)
            for a, d in algo_dtype_pairs() for T, H in LAYOUT_SHAPES for lay in LAYOUTS])
CASE_IDS = [c[0] for c in CASES]
CHUNKED_IDS = [c[0] for c in CASES if c[5]]


@pytest.fixture(scope="module")
def eager():
    """Per rank: ``{case_id: summary}`` from one launch of every case on GPU_WORLD GPUs."""
    return launch(gpu_ranks.eager_cases, GPU_WORLD, "cuda", args=(CASES, CHUNK_MAX_BYTES),
                  timeout_s=EAGER_LAUNCH_TIMEOUT_S)


def _case(eager, case, check):
    """Every rank's summary of ``case``; errors recorded as failures."""
    sums = [per_rank[case] for per_rank in eager]
    for r, s in enumerate(sums):
        check.that(s["error"] is None, f"rank {r} raised:\n{s['error']}")
    return sums


@pytest.mark.parametrize("case", CASE_IDS)
def test_all_reduce_matches_reference(eager, case):
    """all_reduce into a NaN-filled out: every element written, bit-exact, the same on both GPUs."""
    check = Checks()
    sums = _case(eager, case, check)
    for r, s in enumerate(sums):
        if s["error"] is None:
            check.that(s["nan_left"] == 0, f"rank {r}: {s['nan_left']} elements of out never written")
            check.that(s["s_mismatch"] == 0, f"rank {r}: {s['s_mismatch']} elements differ from the reference")
    check.that(len({s.get("hash_s") for s in sums}) == 1, "ranks hold different all_reduce bits")
    check.done()


@pytest.mark.parametrize("case", CASE_IDS)
def test_fused_matches_reference(eager, case):
    """fused_add_rmsnorm (outputs over freed NaN blocks): residual_out bit-exact, out within the ulp
    tolerance, the same on both GPUs, the forced algorithm ran, x untouched."""
    algo = case.split("-")[0]
    check = Checks()
    sums = _case(eager, case, check)
    for r, s in enumerate(sums):
        if s["error"] is None:
            check.that(s["ro_mismatch"] == 0, f"rank {r}: residual_out: {s['ro_mismatch']} elements differ")
            check.that(s["out_max_ulp"] <= s["out_tol"], f"rank {r}: out {s['out_max_ulp']} ulp from the "
                                                         f"reference (tolerance {s['out_tol']})")
            check.that(s["plan_fused"] == algo, f"rank {r}: plan {s['plan_fused']!r}, expected {algo!r}")
            check.that(s["x_untouched"], f"rank {r}: the calls modified x")
    check.that(len({(s.get("hash_out"), s.get("hash_ro")) for s in sums}) == 1, "ranks hold different bits")
    check.done()


@pytest.mark.parametrize("case", CHUNKED_IDS)
def test_chunked_equals_whole(eager, case):
    """The same calls through a communicator of CHUNK_MAX_BYTES: several launches, identical bits."""
    check = Checks()
    sums = _case(eager, case, check)
    for r, s in enumerate(sums):
        if s["error"] is None:
            check.that(s["chunk_launches"] > 1, f"rank {r}: {s['chunk_launches']} launch(es): not chunked")
            for name in ("chunk_out_mismatch", "chunk_ro_mismatch", "chunk_s_mismatch"):
                check.that(s[name] == 0, f"rank {r}: {name} = {s[name]}")
    check.done()


SPECIAL_PAIRS = [(a, dtype_name(d)) for a, d in algo_dtype_pairs()]


@pytest.fixture(scope="module")
def special():
    return launch(gpu_ranks.gpu_special_values, GPU_WORLD, "cuda", args=(SPECIAL_PAIRS,), timeout_s=300)


@pytest.mark.parametrize("pair", [f"{a}-{d}" for a, d in SPECIAL_PAIRS])
def test_negative_zero_nan_and_inf(special, pair):
    """-0.0 gives +0.0 (the Lamport sentinel's bits never leak); NaN and Inf propagate as IEEE says."""
    check = Checks()
    for r, per_rank in enumerate(special):
        check.that(not per_rank[pair], f"rank {r}: " + "\n".join(per_rank[pair]))
    check.done()


#: Replays of the captured graph: odd, so the graph's calls end on the other epoch parity than they
#: started, and many, so every buffer is reused with stale data from earlier replays in it.
GRAPH_REPLAYS = 51


def test_cuda_graph_replay():
    """Several fused and all_reduce calls (Lamport and one-shot) captured in one CUDA graph, a second
    graph beside it; replayed GRAPH_REPLAYS times with new inputs copied into the captured inputs,
    interleaved with eager calls; every replay equals eager on the same inputs and the reference, on
    both GPUs identically."""
    results = launch(gpu_ranks.graph_replays, GPU_WORLD, "cuda", args=(GRAPH_REPLAYS, 4242), timeout_s=600)
    check = Checks()
    for r, res in enumerate(results):
        check.that(not res["failures"], f"rank {r}: {len(res['failures'])} failures:\n" +
                   "\n".join(res["failures"][:20]))
        check.that(len(res["digests"]) == GRAPH_REPLAYS, f"rank {r}: {len(res['digests'])} replays checked")
    check.that(results[0]["digests"] == results[1]["digests"], "the GPUs' graph outputs differ")
    check.done()


#: A short kernel timeout on the GPU (measured with %globaltimer, so the wall time should follow it).
GPU_TIMEOUT_S = 0.5
#: (algo, op, rows): one row, and 4096 rows, which gives every program of the grid (two per SM; two-shot: four) many
#: rows, so a wait per row would add up to many timeouts.
TIMEOUT_CONFIGS = [(a, op, T) for a in sorted({a for a, _ in algo_dtype_pairs()})
                   for op, T in (("all_reduce", 1), ("fused_add_rmsnorm", 1), ("fused_add_rmsnorm", 4096))]


@pytest.fixture(scope="module")
def peer_timeouts():
    return launch(gpu_ranks.gpu_peer_timeout, GPU_WORLD, "cuda", args=(GPU_TIMEOUT_S, TIMEOUT_CONFIGS),
                  timeout_s=600)[0]


@pytest.mark.parametrize("algo,op,T", TIMEOUT_CONFIGS, ids=[f"{a}-{o}-{t}" for a, o, t in TIMEOUT_CONFIGS])
def test_peer_timeout_names_the_missing_peer(peer_timeouts, algo, op, T):
    """Rank 1 skips a call: rank 0 gets PeerTimeoutError naming peer 1, after about one timeout
    whatever the number of rows (every wait is bounded, and a launch gives up once)."""
    seen = peer_timeouts[f"{algo}-{op}-{T}"]
    err = seen["error"]
    check = Checks()
    check.that(err is not None and err["type"] == "PeerTimeoutError" and err.get("peer") == 1,
               f"rank 0 saw {err}")
    # 2 s: the timeout plus a launch and a synchronisation, with room for a busy host
    check.that(seen["elapsed"] < GPU_TIMEOUT_S + 2,
               f"took {seen['elapsed']:.1f} s to report a {GPU_TIMEOUT_S} s timeout")
    check.done()
