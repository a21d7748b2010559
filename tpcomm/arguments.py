"""The ``tpcomm`` command's arguments: the value types (each raises ``ArgumentTypeError`` with the value it
got, which argparse turns into a usage error naming the option) and every subcommand's options
(:func:`build_parser`).

Standard library only, and no import from the rest of tpcomm: the console script's front
(``tpcomm_cli.py`` beside the package) loads this file by its path and parses the command line before
anything imports the tpcomm package, whose ``__init__`` imports torch and Triton (about 2 s), so
``tpcomm --help`` and a bad option answer at once. The choices below are the package's own
(``tpcomm.bench.config.OPS``, ``tpcomm.bench.contenders.NAMES``, ``tpcomm.tune.config.OPS``);
``tests/host/test_arguments.py`` checks that they agree.
"""

from __future__ import annotations

import argparse


def _int_at_least(text: str, low: int, what: str = "") -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}{what}, got {text}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def world_size(text: str) -> int:
    """A number of ranks: an integer >= 2 (one rank needs no communication)."""
    return _int_at_least(text, 2, " (ranks)")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    v = _float(text)
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return v


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    v = _float(text)
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return v


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _ints_at_least(text: str, low: int, what: str = "") -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < low for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {low}{what}, got {text!r}")
    return tuple(dict.fromkeys(vals))  # a value given twice counts once


def int_list(text: str) -> tuple[int, ...]:
    """``"1,16,64"`` -> ``(1, 16, 64)``; every value >= 1; repeats dropped."""
    return _ints_at_least(text, 1)


def world_list(text: str) -> tuple[int, ...]:
    """``"2,4"`` -> ``(2, 4)``: numbers of ranks, each >= 2; repeats dropped."""
    return _ints_at_least(text, 2, " (ranks)")


def choice_list(allowed) -> callable:
    """An argparse type: comma-separated names, each one of ``allowed``; repeats dropped."""
    def parse(text: str) -> tuple[str, ...]:
        vals = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [v for v in vals if v not in allowed]
        if not vals or bad:
            raise argparse.ArgumentTypeError(f"expected comma-separated names from {', '.join(allowed)}, "
                                             f"got {text!r}")
        return tuple(dict.fromkeys(vals))  # a name given twice counts once
    return parse


#: ``tpcomm bench --ops`` (``tpcomm.bench.config.OPS``), ``--modes``, ``--dtype``, ``--contenders``
#: (``tpcomm.bench.contenders.NAMES``, in column order).
BENCH_OPS = ("fused", "fused_fp8", "all_reduce", "all_gather", "reduce_scatter")
BENCH_MODES = ("graph", "eager")
DTYPE_NAMES = ("bf16", "fp16", "fp32")
BENCH_CONTENDERS = ("tpcomm", "tpcomm_unfused", "nccl", "symm_one_shot", "symm_two_shot", "symm_all_gather",
                    "symm_reduce_scatter", "fi_trtllm_oneshot", "fi_trtllm_twoshot", "fi_vllm", "torch_epilogue",
                    "copy_ce", "copy_sm")
#: ``tpcomm tune --ops`` (``tpcomm.tune.config.OPS``, in that order).
TUNE_OPS = ("all_reduce", "fused_add_rmsnorm")


def tune_ops(text: str) -> tuple[str, ...]:
    """``tpcomm tune --ops``: comma-separated names from :data:`TUNE_OPS`, returned in that order."""
    vals = tuple(t.strip() for t in text.split(",") if t.strip())
    if not vals or any(v not in TUNE_OPS for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated ops from {','.join(TUNE_OPS)}, got {text!r}")
    return tuple(op for op in TUNE_OPS if op in vals)


def add_bench_arguments(b: argparse.ArgumentParser) -> None:
    """The options of ``tpcomm bench``; defaults (None) are the full sweep of
    ``tpcomm.bench.config.BenchConfig``."""
    b.add_argument("--world", type=world_list, default=None,
                   help="GPUs, or comma-separated world sizes to run one after another, e.g. 2,4,8 "
                        "(default: all visible)")
    b.add_argument("--ops", type=choice_list(BENCH_OPS), default=None,
                   help=f"comma-separated, from {','.join(BENCH_OPS)} (default: all but fused_fp8, which is added "
                        "when tpcomm's fused_add_rmsnorm takes quant=)")
    b.add_argument("--hidden", type=int_list, default=None,
                   help="comma-separated hidden sizes (default 2880,4096,6144,7168,8192)")
    b.add_argument("--dtype", type=choice_list(DTYPE_NAMES), default=None,
                   help="comma-separated, from bf16,fp16,fp32 (default bf16,fp16)")
    b.add_argument("--tokens", type=int_list, default=None,
                   help="comma-separated token counts (default 1,16,64,256,1024,4096,16384)")
    b.add_argument("--modes", type=choice_list(BENCH_MODES), default=None,
                   help="graph (CUDA graphs), eager (host overhead included), or both (default)")
    b.add_argument("--eager", action="store_true", help="eager mode only (same as --modes eager)")
    b.add_argument("--contenders", type=choice_list(BENCH_CONTENDERS), default=None,
                   help="only these alternatives (tpcomm and the peer copies always run): "
                        + ",".join(BENCH_CONTENDERS))
    b.add_argument("--quick", action="store_true",
                   help="hidden 6144, bf16, tokens 16,256,4096 (about a minute on 2 H200s); other options "
                        "given explicitly still apply")
    b.add_argument("--estimate", action="store_true",
                   help="print the expected device time of the sweep and exit (no GPU needed)")
    b.add_argument("--json", default=None, metavar="PATH",
                   help="the run's JSON document (default out/bench[-quick]-w<world>.json); the PNGs "
                        "(<stem>-<op>-<mode>.png) go beside it")
    b.add_argument("--results", default=None, metavar="PATH",
                   help="also append the run's rows, with its machine, commit and versions, to this results "
                        "file (JSON lines; tpcomm.bench.results)")
    b.add_argument("--render", default=None, metavar="PATH",
                   help="print the tables of one run of this results file and exit (no GPU): the latest, "
                        "or the one --run names")
    b.add_argument("--run", default=None, help="with --render: a run id, or its date or commit")
    b.add_argument("--graph-calls", type=positive_int, default=20,
                   help="most calls per graph (fewer for messages over 50 MiB, see set_bytes)")
    b.add_argument("--replays", type=positive_int, default=20, help="most timed replays per row")
    b.add_argument("--eps", type=non_negative_float, default=1e-6, help="RMSNorm epsilon (default 1e-6)")
    b.add_argument("--loopback", action="store_true",
                   help="ONE GPU: tpcomm's loopback ranks beside FlashInfer's TRT-LLM one-shot as loopback ranks "
                        "(all-reduce, fused, fused FP8; bf16; graph mode; --world one size, default 2; --hidden "
                        "default 4096,6144,8192; --tokens default 1,16,64,256,1024,4096; TRT-LLM up to 64 tokens)")
    b.add_argument("--programs", type=positive_int, default=None,
                   help="with --loopback: tpcomm's grid cap (default: tpcomm.loopback's, SMs / world)")


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``tpcomm tune``."""
    p.add_argument("--world", type=world_size, default=None, help="GPUs, >= 2 (default: all visible)")
    p.add_argument("--hidden", type=positive_int, default=6144,
                   help="hidden size of the fused op's rows (default 6144); the all-reduce is flat")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16",
                   help="default bf16; fp32 has no Lamport (its threshold is kept from the defaults)")
    p.add_argument("--ops", type=tune_ops, default=TUNE_OPS,
                   help=f"comma-separated, from {','.join(TUNE_OPS)} (default both)")
    p.add_argument("--quick", action="store_true",
                   help="11 sizes per op and fewer replays (about a minute on 2 H200s)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="the table (default ~/.cache/tpcomm/dispatch-w<world>.json); the raw measurements "
                        "go beside it (<stem>-measurements.json)")
    p.add_argument("--estimate", action="store_true",
                   help="print the expected device time of the sweep and exit (no GPU needed)")
    p.add_argument("--graph-calls", type=positive_int, default=None, help="most calls per graph (default 20)")
    p.add_argument("--replays", type=positive_int, default=None,
                   help="most timed replays per measurement (default 30, 20 with --quick)")
    p.add_argument("--margin-pct", type=non_negative_float, default=2.0,
                   help="tie margin, relative part: an algorithm beats another only when faster by more "
                        "than max(margin-us, margin-pct %% of the other's time) (default 2)")
    p.add_argument("--margin-us", type=non_negative_float, default=0.3, help="tie margin, absolute part (default 0.3)")


def build_parser(version: str) -> argparse.ArgumentParser:
    """The parser of the ``tpcomm`` command (``version``: what ``--version`` prints)."""
    p = argparse.ArgumentParser(
        prog="tpcomm",
        description="Tensor-parallel all-reduce fused with residual add + RMSNorm (Triton), on the GPUs "
                    "of one node or on CPU ranks under Triton's interpreter.")
    p.add_argument("--version", action="version", version=f"tpcomm {version}")
    sub = p.add_subparsers(dest="command", metavar="{demo,bench,check,soak,tune}")
    sub.required = True

    d = sub.add_parser("demo", help="run every op (at model shapes) and a tensor-parallel MLP block, checked "
                                    "against the reference",
                       description="Start the ranks, run the all-reduce and the fused add + RMSNorm at model "
                                   "shapes, a tensor-parallel MLP block, the all-gather, the reduce-scatter, the "
                                   "QK norm, the MoE finalize and every quantised form, check each result against "
                                   "its reference on every rank; exit 1 on any mismatch.")
    d.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when >= 2 GPUs are visible, else cpu (Triton interpreter)")
    d.add_argument("--world", type=world_size, default=None,
                   help="ranks (default: every visible GPU, or 2 CPU ranks)")
    d.add_argument("--quick", action="store_true", help="a smaller sweep (without --model)")
    d.add_argument("--model", choices=("llama", "gemma", "minimax_m2"), default=None,
                   help="instead: a Hugging Face Llama (or Gemma 3, MiniMax-M2) of seeded random weights, sharded "
                        "over tpcomm, greedy decoding against the unsharded model (needs the hf extra; on a "
                        "machine with one GPU the ranks are loopback ranks of that GPU)")
    d.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="with --model: one dtype (default both)")
    d.add_argument("--steps", type=positive_int, default=None,
                   help="with --model: greedy decode steps (default 8)")
    d.add_argument("--heads", type=positive_int, default=None,
                   help="with --model: query heads of 128 (default 4 per CPU rank, 16 on GPUs)")
    d.add_argument("--kv-heads", type=positive_int, default=None,
                   help="with --model: key-value heads (default half the query heads); MiniMax-M2 takes fewer "
                        "than the ranks, each then replicated on world / kv-heads ranks")
    d.add_argument("--speculative", type=positive_int, default=None, metavar="K",
                   help="with --model minimax_m2: speculative decoding, an Eagle-style draft head proposing K "
                        "tokens a step, verified by the target")

    b = sub.add_parser("bench", help="time tpcomm against NCCL, torch symmetric memory and FlashInfer "
                                     "(GPU only)",
                       description="Time every op against the alternatives in the same run, in CUDA graphs "
                                   "and eagerly (GPU only): each contender checked first, median over "
                                   "replays of the slowest rank. Prints tables; writes JSON and PNG plots.")
    add_bench_arguments(b)

    c = sub.add_parser("check", help="print what this machine supports and why",
                       description="Print versions, GPUs, peer access and links between every pair, the "
                                   "interpreter, TPCOMM_* settings, the algorithms available (and why not) and "
                                   "what a Communicator would do.")
    c.add_argument("--world", type=world_size, default=None,
                   help="world size of the plans printed (default: every GPU here, or 2 CPU ranks)")

    s = sub.add_parser("soak", help="many steps of mixed calls under random rank skew, every result checked",
                       description="Run STEPS steps, each a mix of every op under every algorithm: fused calls "
                                   "(small and large token counts, with and without residual, Gemma, a quantised "
                                   "form), all-reduces, all-gathers, reduce-scatters, the QK norm and the MoE "
                                   "finalize, each rank delayed by a different random time before every call; "
                                   "check every result exactly. Reports steps, calls, mismatches, hangs; exit 1 "
                                   "on any.")
    s.add_argument("--steps", type=positive_int, default=200, help="steps to run (default 200)")
    s.add_argument("--world", type=world_size, default=None,
                   help="ranks (default: every visible GPU, or 2 CPU ranks)")
    s.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when >= 2 GPUs are visible, else cpu (Triton interpreter)")
    s.add_argument("--seed", type=int, default=0,
                   help="seed of the inputs, call mix and delays (default 0): a failing run is repeated by its seed")
    s.add_argument("--timeout", type=positive_float, default=10.0,
                   help="seconds a kernel waits for a peer before the call counts as a hang (default 10)")
    s.add_argument("--max-delay", type=non_negative_float, default=None,
                   help="largest random delay before a call: microseconds on GPU (default 20), seconds "
                        "on CPU (default 0.03)")

    t = sub.add_parser("tune", help="measure the dispatch's crossovers on this machine's GPUs and write a "
                                    "table (GPU only)",
                       description="Time every algorithm the dispatch can choose (each forced, checked, in "
                                   "CUDA graphs, slowest rank, median) for all_reduce and fused_add_rmsnorm "
                                   "over a sweep of message sizes; derive lamport_max_bytes and "
                                   "two_shot_min_bytes; write the crossover table (load it with "
                                   "TPCOMM_DISPATCH_TABLE) and the raw measurements. docs/tuning.md.")
    add_tune_arguments(t)
    return p
