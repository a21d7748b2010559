"""The ``tpcomm tune`` command: the run on the GPUs, and what is done with the results (its options:
:func:`tpcomm.arguments.add_tune_arguments`).

:func:`main` checks the machine and starts the ranks (:func:`tpcomm.tune.rank.run_rank`);
:func:`finish` (no GPU: the tests call it with synthetic times) merges the ranks, derives the
crossovers, writes the table and the measurements, and prints the report.
"""

from __future__ import annotations

import argparse
import datetime
import time

from .config import OPS, default_out_path, estimate_seconds, make_config, measurements_path

#: Exit statuses: a table was written / a check, a rank or the workspace failed / this machine cannot
#: run it or an argument is invalid (as ``tpcomm bench``).
OK, FAILED, UNUSABLE = 0, 1, 2


def run_tune(args: argparse.Namespace) -> int:
    """Run ``tpcomm tune`` from parsed arguments; returns the exit status."""
    return main(world_size=args.world, hidden=args.hidden, dtype=args.dtype, ops=args.ops, quick=args.quick,
                out=args.out, estimate_only=args.estimate, graph_calls=args.graph_calls, replays=args.replays,
                margin_pct=args.margin_pct, margin_us=args.margin_us)


def command_line(cfg, out: str | None) -> str:
    """The canonical command that reproduces ``cfg`` (recorded in the table's ``source``)."""
    parts = ["tpcomm tune", f"--world {cfg.world_size}", f"--hidden {cfg.hidden}", f"--dtype {cfg.dtype}"]
    if tuple(cfg.ops) != OPS:
        parts.append(f"--ops {','.join(cfg.ops)}")
    if cfg.quick:
        parts.append("--quick")
    if (cfg.margin_rel, cfg.margin_us) != (0.02, 0.3):
        parts.append(f"--margin-pct {100 * cfg.margin_rel:g} --margin-us {cfg.margin_us:g}")
    if out:
        parts.append(f"--out {out}")
    return " ".join(parts)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(world_size: int | None = None, hidden: int = 6144, dtype: str = "bf16", ops=OPS, quick: bool = False,
         out: str | None = None, estimate_only: bool = False, graph_calls: int | None = None,
         replays: int | None = None, margin_pct: float = 2.0, margin_us: float = 0.3) -> int:
    """Measure the crossovers on this machine's GPUs and write a table (see :mod:`tpcomm.tune`).

    Returns:
        0 when the table was written; 1 when an algorithm failed its check, a rank failed or the
        kernels cannot run here (no table is written then); 2 when this machine has fewer than two GPUs
        or an argument is invalid.
    """
    n = gpu_count()
    if n < 2 and not estimate_only:
        print(f"tpcomm tune: needs at least 2 CUDA GPUs; this machine has {n} "
              f"({'no CUDA' if n == 0 else 'one GPU'}). It times the kernels inside CUDA graphs, and "
              "times under the CPU interpreter say nothing about a GPU, so there is no CPU mode. The "
              "built-in table (tpcomm/dispatch.py, DEFAULT_TABLE) is used meanwhile; "
              "`tpcomm tune --estimate` prints the expected run time.")
        return UNUSABLE
    W = world_size or (n if n >= 2 else 2)
    if not estimate_only and not 2 <= W <= n:
        print(f"tpcomm tune: --world must be between 2 and {n} (the visible GPUs), got {W}")
        return UNUSABLE
    kw = {k: v for k, v in (("graph_calls", graph_calls), ("replays", replays)) if v is not None}
    try:
        cfg = make_config(W, dtype=dtype, hidden=hidden, ops=tuple(ops), quick=quick,
                          margin_rel=margin_pct / 100.0, margin_us=margin_us, **kw)
    except ValueError as e:
        print(f"tpcomm tune: {e}")
        return UNUSABLE
    est = estimate_seconds(cfg)
    print(describe_sweep(cfg) + f" Estimated device time: {est / 60:.1f} min ({est:.0f} s).", flush=True)
    if estimate_only:
        return OK
    out = out or default_out_path(W)
    from ..launch import RankFailure, launch
    from .rank import run_rank

    t0 = time.perf_counter()
    try:
        per_rank = launch(run_rank, W, "cuda", args=(cfg,), timeout_s=max(900.0, 4 * est))
    except RankFailure as e:
        print(f"tpcomm tune: a rank failed after {time.perf_counter() - t0:.0f} s:\n{e}")
        return FAILED
    return finish(cfg, per_rank, out, command_line(cfg, out if out != default_out_path(W) else None),
                  wall_s=time.perf_counter() - t0, estimated_s=est)


def describe_sweep(cfg) -> str:
    """One paragraph: what will be measured, and how."""
    from ..dispatch import LAMPORT_MAX_BYTES
    from .crossover import format_bytes

    parts = []
    for op in cfg.ops:
        sizes = cfg.sizes(op)
        if op == "all_reduce":
            parts.append(f"all_reduce at {len(sizes)} sizes ({format_bytes(sizes[0][0])}.."
                         f"{format_bytes(sizes[-1][0])})")
        else:
            parts.append(f"fused_add_rmsnorm at {len(sizes)} token counts ({sizes[0][1]}..{sizes[-1][1]}) "
                         f"x {cfg.hidden}")
    return (f"tpcomm tune: {'; '.join(parts)}; {cfg.dtype}; {cfg.world_size} GPUs; each algorithm forced "
            f"(lamport up to {format_bytes(LAMPORT_MAX_BYTES)} for 16-bit, one_shot, two_shot), checked, then "
            f"timed in a CUDA graph of up to {cfg.graph_calls} calls, median of up to {cfg.replays} replays, "
            "slowest rank.")


def finish(cfg, per_rank: list[dict], out: str, command: str, wall_s: float = 0.0,
           estimated_s: float = 0.0, now: datetime.datetime | None = None) -> int:
    """From the ranks' results: print the tables and thresholds, write the table to ``out`` and the
    measurements beside it (:func:`tpcomm.tune.config.measurements_path`). Returns the exit status of
    :func:`main` (no table is written when the kernels were not used or any measurement failed; the
    measurements are written when there are any)."""
    from .. import dispatch
    from .crossover import Margin, derive
    from .report import measurements_doc, op_table, rule_text, threshold_lines, usage_lines, write_json
    from .summary import build_table, by_op, differences, merge_ranks

    info = dict(per_rank[0]["info"])
    if per_rank[0].get("fallback"):
        print(f"tpcomm tune: tpcomm's kernels are not used on this machine ({per_rank[0]['fallback']}): "
              "every call goes through torch.distributed, so there is nothing to tune.")
        return FAILED
    now = now or datetime.datetime.now(datetime.timezone.utc)
    date = now.strftime("%Y-%m-%d %H:%M UTC")
    info.update(date=date, command=command, wall_s=round(wall_s, 1), estimated_s=round(estimated_s, 1))
    merged = merge_ranks(per_rank)
    raw_path = measurements_path(out)
    failed = [e for e in merged if "error" in e]
    if failed:
        write_json(raw_path, json_dump({"config": _asdict(cfg), "environment": info, "measurements": merged}))
        print("tpcomm tune: these measurements failed, so no table was written (a bug to report; the "
              f"measurements are in {raw_path}):")
        for e in failed:
            print(f"  {e['op']} {e['bytes']} bytes {e['algorithm']}: {e['error']}")
        return FAILED
    margin = Margin(cfg.margin_rel, cfg.margin_us)
    times = {op: by_op(merged, op) for op in cfg.ops}
    derived = {op: derive(t.sizes, t.median_us, margin) for op, t in times.items()}
    source = (f"tpcomm tune, {date}, {info['host']} ({cfg.world_size}x {info['gpu']}), {cfg.dtype}, "
              f"hidden {cfg.hidden}: {command}")
    table = build_table(cfg, derived, source, f"{cfg.world_size}x {info['gpu']} ({info['host']})")
    dispatch.CrossoverTable.from_json(table.to_json())  # what the Communicator will parse
    diffs = {op: differences(t, cfg, table) for op, t in times.items()}
    print(f"\n{info['gpu']} x {cfg.world_size} on {info['host']}, torch {info['torch']}, triton {info['triton']}; "
          f"{wall_s:.0f} s (estimated {estimated_s:.0f} s). µs per call, median of the slowest rank; "
          "* fastest; default pick shown where it differs.")
    for op, t in times.items():
        shape = f", hidden {cfg.hidden}" if op != "all_reduce" else ""
        print(f"\n### {op}, world {cfg.world_size}, {cfg.dtype}{shape}\n\n" + op_table(t, cfg, table))
    print(f"\nrule: {rule_text(cfg)}")
    for op in cfg.ops:
        print("\n".join(threshold_lines(op, cfg, derived[op], table, diffs[op])))
    write_json(out, table.to_json())
    write_json(raw_path, json_dump(measurements_doc(cfg, info, merged, derived, table, diffs)))
    print("\n" + "\n".join(usage_lines(out, raw_path, cfg.world_size)))
    return OK


def _asdict(cfg) -> dict:
    from dataclasses import asdict

    return asdict(cfg)


def json_dump(doc: dict) -> str:
    import json

    return json.dumps(doc, indent=1)
