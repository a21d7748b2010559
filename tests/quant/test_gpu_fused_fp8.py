"""Fused FP8 output of ``fused_add_rmsnorm(..., quant=...)`` on ``GPU_WORLD`` GPUs, at the shapes of real
models. Marked ``gpu``; skipped unless that many CUDA GPUs are visible. Run on a machine with GPUs:
``python -m pytest -q -m gpu tests/quant/test_gpu_fused_fp8.py``.

Per case, on both GPUs: bytes and scales equal the standalone Triton quant (``tpcomm.quant``, with the
hardware e4m3fn conversion) and the plain-torch quant of the fused ``out``; ``residual_out`` equals the
reference bit for bit and ``out`` is within its ulp tolerance; the scale rules hold; dequantised values
lie within one FP8 step of the float32 reference; both GPUs hold the same bytes. Then several quantised
calls captured in one CUDA graph and replayed with new inputs equal eager calls.

Spawning ranks, joining NCCL and compiling cost more than the cases: one launch runs everything
(``tests/quant/gpu_ranks.py``) and each parametrized test reads its own case's summary.

Compilations are what take the time, so the sweep is not a full product. Every hidden size and token
count runs every algorithm in bf16; per tile shape (``BLOCK_H`` 4096; 8192; 8192 x 2 tiles) each
algorithm takes two of the four (format, per-token / per-group) combinations, all four over the sweep.
fp16 and fp32, column-major scales, emit_unquantized off and no residual run on a few shapes.
"""

import pytest

from tests.quant import gpu_ranks
from tests.support.gpu_world import GPU_WORLD, NEEDS_GPUS
from tests.support.numerics import Checks
from tpcomm.launch import launch

pytestmark = [pytest.mark.gpu, NEEDS_GPUS]

#: Hidden sizes of real models (2880: gpt-oss; 4096 .. 8192: Llama / Qwen / DeepSeek class; 16384: two
#: tiles of dispatch.MAX_BLOCK_H, so per-token scales come from the first pass's largest |v * w'|).
HIDDEN = [2880, 4096, 6144, 7168, 8192, 16384]
#: Tokens from decode (1, 7) to prefill (1000, 4096).
TOKENS = [1, 7, 64, 1000, 4096]
ALGOS = ["lamport", "one_shot", "two_shot", "fallback"]
TOK, GRP = "fp8_per_token", "fp8_per_group"
COMBOS = [("e4m3fn", TOK), ("e4m3fnuz", GRP), ("e4m3fn", GRP), ("e4m3fnuz", TOK)]
#: Calls captured in the graph; replays: odd, so the graph's launches end on the other epoch parity.
GRAPH_REPLAYS = 21


def group_for(H):
    """128 (DeepSeek's 1 x 128), or 64 where 128 does not divide H (2880 = 64 x 45)."""
    return 128 if H % 128 == 0 else 64


def combo(H, T, algo):
    """The (format, quant) of the bf16 case ``(H, T, algo)``: two combinations per tile shape and
    algorithm, alternating over the shapes, rotating over tile shapes and algorithms."""
    tile = 0 if H <= 4096 else 1 if H <= 8192 else 2
    a = ALGOS.index(algo)
    pair = (COMBOS[(2 * tile + a) % 4], COMBOS[(2 * tile + a + 1) % 4])
    return pair[(HIDDEN.index(H) + TOKENS.index(T)) % 2]


def _case(algo, dtype, fmt, quant, H, T, column_major=False, residual=True, special=False, no_emit=False):
    layout = "tok" if quant == TOK else "col" if column_major else "row"
    flags = "".join(f for f, on in (("-nores", not residual), ("-special", special), ("-noemit", no_emit))
                    if on)
    cid = f"{algo}-{dtype}-{fmt}-{layout}-{H}x{T}{flags}"
    seed = 100_000 * H + 10 * T + ALGOS.index(algo) + 1000 * ("bfloat16", "float16", "float32").index(dtype)
    return (cid, algo, dtype, fmt, quant, group_for(H), column_major, H, T, residual, special, no_emit, seed)


#: bf16 sweep. T = 7 rows carry the special rows (zeros, a dominant element, a NaN, huge values); the
#: calls at 6144 x 64 and 16384 x 1000 also run with emit_unquantized off.
CASES = [_case(a, "bfloat16", *combo(H, T, a), H, T, special=T == 7,
               no_emit=(H, T) in ((6144, 64), (16384, 1000)))
         for H in HIDDEN for T in TOKENS for a in ALGOS]
#: fp16 and fp32 (one combination per algorithm and dtype; fp16's per-group scales column-major).
CASES += [_case(a, d, *COMBOS[(ALGOS.index(a) + 2 * k) % 4], 4096, T,
                column_major=d == "float16" and COMBOS[(ALGOS.index(a) + 2 * k) % 4][1] == GRP)
          for k, d in enumerate(("float16", "float32")) for a in ALGOS
          if not (a == "lamport" and d == "float32") for T in (7, 1000)]
#: Column-major per-group scales in bf16; no residual on a two-tile row.
CASES += [_case(a, "bfloat16", "e4m3fn", GRP, 7168, T, column_major=True) for a in ALGOS for T in (7, 1000)]
CASES += [_case(a, "bfloat16", "e4m3fn", TOK, 16384, 7, residual=False) for a in ALGOS]
CASE_IDS = [c[0] for c in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS)

#: (algo, dtype, format, quant, group, column_major, H, T), each a variant the sweep compiled.
GRAPH_CALLS = [("lamport", "bfloat16", *combo(4096, 64, "lamport"), 128, False, 4096, 64),
               ("one_shot", "bfloat16", "e4m3fn", GRP, 128, True, 7168, 7),
               ("two_shot", "bfloat16", *combo(6144, 1000, "two_shot"), 128, False, 6144, 1000),
               ("lamport", "float16", *COMBOS[0], 128, False, 4096, 7),
               ("one_shot", "bfloat16", *combo(16384, 64, "one_shot"), 128, False, 16384, 64)]


@pytest.fixture(scope="module")
def runs():
    """Per rank: ``{"cases": {case_id: summary}, "graph": {...}}`` from one launch on GPU_WORLD GPUs."""
    return launch(gpu_ranks.fp8_gpu_body, GPU_WORLD, "cuda", args=(CASES, GRAPH_CALLS, GRAPH_REPLAYS),
                  timeout_s=580)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fused_fp8_gpu_equals_standalone_quant(runs, case):
    """Bytes and scales == tpcomm.quant and the torch quant of the fused out; residual_out, out,
    scale rules, dequantised error; both GPUs alike; emit_unquantized off gives the same bytes."""
    cid, algo = case[0], case[1]
    check = Checks()
    sums = [per_rank["cases"][cid] for per_rank in runs]
    for r, s in enumerate(sums):
        p = f"rank {r}"
        check.that(s["error"] is None, f"{p} raised:\n{s['error']}")
        if s["error"] is not None:
            continue
        check.that(s["plan"] == algo, f"{p}: plan {s['plan']!r}, expected {algo!r}")
        for key, what in (("q_std", "bytes vs tpcomm.quant"), ("s_std", "scales vs tpcomm.quant"),
                          ("q_ref", "bytes vs the torch quant"), ("s_ref", "scales vs the torch quant"),
                          ("ro", "residual_out vs the reference")):
            check.that(s[key] == 0, f"{p}: {what}: {s[key]} elements differ (-1: shape or strides)")
        check.that(s["out_max_ulp"] <= s["out_tol"], f"{p}: out {s['out_max_ulp']} ulp from the reference "
                                                     f"(tolerance {s['out_tol']})")
        for failure in s["rules"]:
            check.that(False, f"{p}: {failure}")
        check.that(s["dequant"] is None, f"{p}: {s['dequant']}")
        if "no_emit_q" in s:
            check.that(s["no_emit_out"], f"{p}: out returned without emit_unquantized")
            for key in ("no_emit_q", "no_emit_s", "no_emit_ro"):
                check.that(s[key] == 0, f"{p}: emit_unquantized=False: {key} = {s[key]}")
    if all(s["error"] is None for s in sums):
        check.that(len({(s["hash_q"], s["hash_s"]) for s in sums}) == 1, "the GPUs hold different bytes")
    check.done()


def test_fused_fp8_cuda_graph_replay(runs):
    """Quantised calls of every algorithm in one CUDA graph, replayed GRAPH_REPLAYS times with new
    inputs: each replay equals eager calls and the standalone quant of its out, on both GPUs alike."""
    check = Checks()
    for r, per_rank in enumerate(runs):
        g = per_rank["graph"]
        check.that(not g["failures"],
                   f"rank {r}: {len(g['failures'])} failures:\n" + "\n".join(g["failures"][:20]))
        check.that(len(g["digests"]) == GRAPH_REPLAYS, f"rank {r}: {len(g['digests'])} replays checked")
    check.that(runs[0]["graph"]["digests"] == runs[1]["graph"]["digests"], "the GPUs' replayed scales differ")
    check.done()
