"""CUDA graphs, ``torch.compile`` and the custom ops (``tpcomm.ops``, ``tpcomm.graphs``) on ``GPU_WORLD`` GPUs.
Marked ``gpu``; skipped unless that many CUDA GPUs are visible. Run on a machine with GPUs:
``python -m pytest -q -m gpu tests/ops/test_gpu_graphs.py``.

One launch runs every case inside the ranks (``tests/ops/gpu_ranks.py``); each test reads its case's
summary from every rank. The summaries are printed (run with ``-s`` to see them).
"""

import dataclasses
import os
import sys

import pytest

from tests.ops import gpu_ranks
from tests.support.gpu_world import GPU_WORLD, NEEDS_GPUS
from tests.support.numerics import Checks
from tpcomm.launch import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import tp_decoder  # noqa: E402

pytestmark = [pytest.mark.gpu, NEEDS_GPUS]

#: Replays of the soak graph: hundreds, so every buffer parity and Lamport slot is reused many times
#: with stale data from earlier replays, under a different delayed rank each time.
SOAK_REPLAYS = 300
#: GPU spin before a replay on the delayed rank: up to 200k cycles (about 100 us at H200 clocks), longer
#: than one replay of the soak graph, so the other rank's kernels wait for it.
MAX_SLEEP_CYCLES = 200_000
#: Graphs captured and destroyed; memory and descriptors compared between cycle SAMPLE_AT and the last.
CYCLES, SAMPLE_AT = 60, 5
#: Bound on the reserved-memory growth between the samples: a leaked private pool per graph would hold
#: at least one 2 MiB segment per cycle, 110 MiB over the 55 cycles.
RESERVED_SLACK = 32 << 20
#: Bound on the growth of open file descriptors between the samples (one leaked per graph would be 55).
FD_SLACK = 4

EXAMPLE = tp_decoder.Config("cuda", GPU_WORLD, layers=2, tokens=32, hidden=1024, heads=8, intermediate=2816,
                            dtype="bf16", compile=True, graph=True, replays=5)

CONFIG = {"cases": {
    "guard_errors": {},
    "replay_soak": {"replays": SOAK_REPLAYS, "seed": 5150, "eager_every": 5, "second_every": 3,
                    "max_sleep_cycles": MAX_SLEEP_CYCLES},
    "chained": {"replays": 50, "links": 6, "seed": 6160},
    "capture_destroy": {"cycles": CYCLES, "sample_at": SAMPLE_AT},
    "compile_gpu": {"hidden": 1024, "tokens": (64, 256), "graph_replays": 10, "seed": 7170},
    "example": {"cfg_fields": dataclasses.asdict(EXAMPLE)},
}}
#: ``GPU_GRAPH_CASES=a,b`` runs only those cases (the other tests skip), for a short device run.
if os.environ.get("GPU_GRAPH_CASES"):
    CONFIG["cases"] = {k: v for k, v in CONFIG["cases"].items() if k in os.environ["GPU_GRAPH_CASES"].split(",")}


@pytest.fixture(scope="module")
def results():
    """Per rank: ``{case: summary}``, from one launch of every case on GPU_WORLD GPUs."""
    per_rank = launch(gpu_ranks.all_cases, GPU_WORLD, "cuda", args=(CONFIG,), timeout_s=540)
    for name in CONFIG["cases"]:
        for r, res in enumerate(per_rank):
            s = res[name]
            shown = {k: v for k, v in s.items() if k not in ("digests", "outputs", "error", "messages")}
            print(f"[{name}] rank {r}: {shown}" + (f"\n{s['error']}" if s.get("error") else "")
                  + ("\n  " + "\n  ".join(s["messages"]) if s.get("messages") else ""))
    return per_rank


def _summaries(results, name, check):
    if name not in CONFIG["cases"]:
        pytest.skip(f"{name} not in GPU_GRAPH_CASES")
    sums = [res[name] for res in results]
    for r, s in enumerate(sums):
        check.that(s["error"] is None, f"rank {r} raised:\n{s['error']}")
    return sums


def _no_failures(results, name):
    check = Checks()
    sums = _summaries(results, name, check)
    for r, s in enumerate(sums):
        if s["error"] is None:
            check.that(s["failures"] == 0, f"rank {r}: {s['failures']} failures:\n" + "\n".join(s["messages"]))
    return check, sums


def test_replay_soak(results):
    """One graph of nine calls (Lamport, one-shot and two-shot all-reduce and fused, FP8, all_gather,
    reduce_scatter) replayed SOAK_REPLAYS times with new inputs and a different rank delayed each time,
    interleaved with a second graph on a second communicator and with eager calls: every replay
    matches the reference and the eager calls bit for bit, identically on both GPUs."""
    check, sums = _no_failures(results, "replay_soak")
    if all(s["error"] is None for s in sums):
        check.that(set(sums[0]["plans"].values()) >= {"lamport", "one_shot", "two_shot"},
                   f"the graph does not hold all three algorithms: {sums[0]['plans']}")
        check.that(len(sums[0]["digests"]) == SOAK_REPLAYS // 10, f"{len(sums[0]['digests'])} digests")
        check.that(sums[0]["digests"] == sums[1]["digests"], "the GPUs' replay outputs differ")
    check.done()


def test_chained_in_place_calls_in_a_graph(results):
    """Six in-place all_reduce calls and six fused calls, each fed by the previous one, in one graph:
    exact integer results and bit-identical to the eager chain over 50 replays."""
    _no_failures(results, "chained")[0].done()


def test_capture_and_destroy_keeps_memory_and_descriptors_flat(results):
    check, sums = _no_failures(results, "capture_destroy")
    for r, s in enumerate(sums):
        if s["error"] is None:
            a, b = s["samples"][SAMPLE_AT], s["samples"][CYCLES]
            check.that(b["allocated"] == a["allocated"], f"rank {r}: allocated {a['allocated']} -> {b['allocated']}")
            check.that(b["reserved"] - a["reserved"] <= RESERVED_SLACK, f"rank {r}: reserved {a['reserved']} -> "
                                                                         f"{b['reserved']}")
            check.that(b["fds"] - a["fds"] <= FD_SLACK, f"rank {r}: open descriptors {a['fds']} -> {b['fds']}")
    check.done()


def test_compile_on_gpu(results):
    """Inductor, fullgraph, dynamic tokens: one compilation, bit-identical to eager; the compiled layer in
    a CUDA graph equals it outside; mode="reduce-overhead" equals eager and skips no CUDA graph."""
    check, sums = _no_failures(results, "compile_gpu")
    for r, s in enumerate(sums):
        if s["error"] is None:
            check.that(s["frames"] == 1, f"rank {r}: {s['frames']} compilations of the layer, expected 1")
            check.that(s["cudagraph_skips"] == 0, f"rank {r}: Inductor skipped {s['cudagraph_skips']} CUDA graphs")
    check.done()


@pytest.mark.parametrize("case", ["first_use", "side_stream", "nested"])
def test_capture_guard_refusals(results, case):
    """capture_guard refuses a first call of a shape during capture, a call from a side stream during
    capture, and being entered during capture; the communicator keeps working after each refusal."""
    check = Checks()
    for r, s in enumerate(_summaries(results, "guard_errors", check)):
        if s["error"] is None:
            err, after_ok = s["seen"][case]
            check.that(err == "GraphCaptureError", f"rank {r}: {case} raised {err}")
            check.that(after_ok, f"rank {r}: the eager all_reduce after {case} was wrong")
    check.done()


def test_example_tp_decoder_on_gpus(results):
    """examples/tp_decoder.py on GPU_WORLD GPUs: eager, compiled and CUDA-graph replays match the float64
    reference, ranks agree, and each replay equals the compiled model outside the graph bit for bit."""
    check = Checks()
    sums = _summaries(results, "example", check)
    if all(s["error"] is None for s in sums):
        rows, ok = tp_decoder.check(EXAMPLE, sums)
        print("\n".join(" | ".join(str(c) for c in row) for row in rows))
        check.that(ok, f"example check failed: {rows}")
    check.done()
