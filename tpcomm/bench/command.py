"""The ``tpcomm bench`` command: build the sweep, start the ranks, print the tables, write JSON and PNGs."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from .config import DEFAULT_OPS, BenchConfig, quick as quick_config
from .estimate import estimate_seconds


def default_ops() -> tuple[str, ...]:
    """:data:`DEFAULT_OPS`, with ``fused_fp8`` after ``fused`` when this tpcomm's ``fused_add_rmsnorm``
    takes ``quant=`` (the fused FP8 output)."""
    import inspect

    from ..communicator import Communicator

    if "quant" in inspect.signature(Communicator.fused_add_rmsnorm).parameters:
        i = DEFAULT_OPS.index("fused") + 1
        return DEFAULT_OPS[:i] + ("fused_fp8",) + DEFAULT_OPS[i:]
    return DEFAULT_OPS


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(world_size: int | tuple[int, ...] | None = None, ops: tuple[str, ...] | None = None, hiddens=None,
         dtypes=None, tokens=None, modes=None, contenders: tuple[str, ...] | None = None, quick: bool = False,
         json_path: str | None = None, graph_calls: int = 20, replays: int = 20, eps: float = 1e-6,
         results_path: str | None = None,
         estimate_only: bool = False) -> int:
    """Run the sweep for each world size; print the tables; write JSON (``json_path``, default
    ``out/bench[-quick]-w<W>.json``; with several world sizes ``-w<W>`` is added to a given path) and one
    PNG per op and mode beside it; with ``results_path``, also append the run's rows to that results
    file (:mod:`tpcomm.bench.results`).

    Arguments left None take :class:`~tpcomm.bench.config.BenchConfig`'s defaults (the full sweep), or
    the ``--quick`` shapes when ``quick``; ``world_size`` (an int or several) defaults to every visible
    GPU. ``estimate_only``: print the expected run time and exit (no GPU needed; ``world_size`` defaults
    to 2 there).

    Returns:
        0 when every tpcomm row passed its check and was timed; 1 when one failed or a rank crashed;
        2 when this machine cannot run it (fewer than two GPUs) or an argument is invalid.
    """
    n = gpu_count()
    if n < 2 and not estimate_only:
        print(f"tpcomm bench: needs at least 2 CUDA GPUs; this machine has {n} "
              f"({'no CUDA' if not torch.cuda.is_available() else 'one GPU'}). It times CUDA graphs, "
              "so it has no CPU mode: run `tpcomm demo` to check tpcomm on CPU ranks, or "
              "`tpcomm bench --estimate` for the expected run time.")
        return 2
    worlds = (world_size,) if isinstance(world_size, int) else tuple(world_size or (n if n >= 2 else 2,))
    bad = [W for W in worlds if W < 2 or (W > n and not estimate_only)]
    if bad:
        limit = "at least 2" if estimate_only else f"between 2 and {n} (the visible GPUs)"
        print(f"tpcomm bench: --world must be {limit}, got {bad[0]}")
        return 2
    kw = {k: tuple(v) for k, v in (("hiddens", hiddens), ("dtypes", dtypes), ("tokens", tokens),
                                  ("modes", modes)) if v is not None}
    cfgs = []
    try:
        for W in worlds:
            cfg = BenchConfig(world_size=W, ops=tuple(ops) if ops else default_ops(),
                              contenders=tuple(contenders) if contenders else None, graph_calls=graph_calls,
                              replays=replays, eps=eps)
            if quick:
                cfg = quick_config(cfg)
            cfgs.append(replace(cfg, **kw))
        ests = [estimate_seconds(cfg) for cfg in cfgs]
    except ValueError as e:
        print(f"tpcomm bench: {e}")
        return 2
    cfg, est = cfgs[0], sum(ests)
    shapes = (f"ops {','.join(cfg.ops)}; hidden {','.join(map(str, cfg.hiddens))}; "
              f"{','.join(cfg.dtypes)}; tokens {','.join(map(str, cfg.tokens))}; {' and '.join(cfg.modes)} "
              f"mode; {','.join(map(str, worlds))} GPUs")
    print(f"tpcomm bench: {shapes}; up to {cfg.graph_calls} calls per replay, median of up to "
          f"{cfg.replays} replays, slowest rank. Estimated device time: {est / 60:.1f} min ({est:.0f} s).",
          flush=True)
    if estimate_only:
        return 0
    status = 0
    for cfg, est in zip(cfgs, ests):
        W = cfg.world_size
        path = json_path or os.path.join("out", f"bench{'-quick' if quick else ''}-w{W}.json")
        if json_path and len(worlds) > 1:
            stem, ext = os.path.splitext(json_path)
            path = f"{stem}-w{W}{ext or '.json'}"
        status = max(status, _run(cfg, path, est, results_path))
    return status


def _run(cfg: BenchConfig, json_path: str, est: float, results_path: str | None = None) -> int:
    from ..launch import RankFailure, launch
    from .plot import plot_files
    from .rank import run_rank
    from .report import format_report, write_json
    from .summary import failures, summarize, tpcomm_failed

    t0 = time.perf_counter()
    try:
        per_rank = launch(run_rank, cfg.world_size, "cuda", args=(cfg,), timeout_s=max(900.0, 4 * est))
    except RankFailure as e:
        print(f"tpcomm bench: a rank failed after {time.perf_counter() - t0:.0f} s:\n{e}")
        return 1
    doc = summarize(per_rank, cfg)
    env = doc["environment"]
    env["wall_s"] = round(time.perf_counter() - t0, 1)
    env["estimated_s"] = round(est, 1)
    print(f"\n{env['gpu']} x {cfg.world_size}, torch {env['torch']}, triton {env['triton']}, NCCL {env['nccl']}, "
          f"FlashInfer {env['flashinfer']}; tpcomm {env.get('tpcomm_commit') or '(no git)'}, "
          f"PDL {'on' if env.get('pdl') else 'off'}; {env['wall_s']:.0f} s (estimated {est:.0f} s)")
    print(format_report(doc))
    write_json(doc, json_path)
    if results_path:
        from . import results

        results.append(results.sweep_rows(doc), results_path)
        print(f"appended the run to {results_path}")
    stem = os.path.splitext(json_path)[0]
    pngs, why = plot_files(doc, stem)
    print(f"\nwrote {json_path}" + (f" and {len(pngs)} plots ({stem}-<op>-<mode>.png)" if why is None
                                   else f" (no plots: {why})"))
    fails = failures(doc)
    if fails:
        print("\nnot timed because they failed:\n" + "\n".join(f"  {f}" for f in fails))
    if tpcomm_failed(doc):
        print("tpcomm bench: tpcomm failed a check (above): exit 1")
        return 1
    return 0
