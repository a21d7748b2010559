"""The ``tpcomm bench`` arguments (added to the ``bench`` subparser by :mod:`tpcomm.cli`)."""

from __future__ import annotations

import argparse

from ..argtypes import choice_list, int_list, non_negative_float, positive_int, world_list
from .config import DTYPE_NAMES, MODES, OPS


def add_bench_arguments(b: argparse.ArgumentParser) -> None:
    """The options of ``tpcomm bench``; defaults (None) are the full sweep of
    :class:`tpcomm.bench.config.BenchConfig`."""
    from .contenders import NAMES

    b.add_argument("--world", type=world_list, default=None,
                   help="GPUs, or comma-separated world sizes to run one after another, e.g. 2,4,8 "
                        "(default: all visible)")
    b.add_argument("--ops", type=choice_list(tuple(OPS)), default=None,
                   help=f"comma-separated, from {','.join(OPS)} (default: all but fused_fp8, which is added "
                        "when tpcomm's fused_add_rmsnorm takes quant=)")
    b.add_argument("--hidden", type=int_list, default=None,
                   help="comma-separated hidden sizes (default 2880,4096,6144,7168,8192)")
    b.add_argument("--dtype", type=choice_list(DTYPE_NAMES), default=None,
                   help="comma-separated, from bf16,fp16,fp32 (default bf16,fp16)")
    b.add_argument("--tokens", type=int_list, default=None,
                   help="comma-separated token counts (default 1,16,64,256,1024,4096,16384)")
    b.add_argument("--modes", type=choice_list(MODES), default=None,
                   help="graph (CUDA graphs), eager (host overhead included), or both (default)")
    b.add_argument("--eager", action="store_true", help="eager mode only (same as --modes eager)")
    b.add_argument("--contenders", type=choice_list(NAMES), default=None,
                   help=f"only these alternatives (tpcomm and the peer copies always run): {','.join(NAMES)}")
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


def run_bench(args: argparse.Namespace) -> int:
    """Run ``tpcomm bench`` from parsed arguments; returns the exit status (2: options that do not go
    together, named)."""
    for given, needed, name in ((args.run is not None, args.render, "--run applies with --render only"),
                                (args.programs is not None, args.loopback, "--programs applies with --loopback only"),
                                (args.estimate, not args.loopback,
                                 "--estimate times the sweep; --loopback has no estimate (a few minutes a "
                                 "world size on one GPU)")):
        if given and not needed:
            print(f"tpcomm bench: {name}")
            return 2
    if args.render:
        from .results import load, render

        try:
            print(render(load(args.render), args.run))
        except (OSError, ValueError) as e:
            print(f"tpcomm bench --render: {e}")
            return 2
        return 0
    if args.loopback:
        from .loopback import main as loopback_main

        worlds = args.world or (2,)
        if len(worlds) != 1:
            print("tpcomm bench --loopback: --world takes one size")
            return 2
        return loopback_main(worlds[0], tuple(args.hidden or (4096, 6144, 8192)),
                             tuple(args.tokens or (1, 16, 64, 256, 1024, 4096)), args.json,
                             replays=args.replays, eps=args.eps, max_programs=args.programs,
                             results_path=args.results)
    from .command import main

    modes = ("eager",) if args.eager else args.modes
    return main(world_size=args.world, ops=args.ops, hiddens=args.hidden, dtypes=args.dtype,
                tokens=args.tokens, modes=modes, contenders=args.contenders, quick=args.quick,
                json_path=args.json, graph_calls=args.graph_calls, replays=args.replays, eps=args.eps,
                estimate_only=args.estimate, results_path=args.results)
