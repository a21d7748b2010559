"""``tpcomm bench`` from its parsed arguments (:func:`tpcomm.arguments.add_bench_arguments` defines them)."""

from __future__ import annotations

import argparse


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
