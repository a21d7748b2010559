"""What ``tpcomm tune`` prints and writes: a table of µs per algorithm and size per op, the thresholds
against the default table's, the files (the crossover table and the raw measurements) and how to use
them.

Table columns: the message (size per rank, and tokens for the fused op), µs per call of each algorithm
(median over replays of the slowest rank; ``*`` marks the fastest, ``-`` not timed: Lamport above
``LAMPORT_MAX_BYTES`` or for fp32), the algorithm the tuned table picks, and the default table's pick
where it differs (blank: the same).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from .. import dispatch
from .config import ALGORITHMS, TuneConfig
from .crossover import Derived, format_bytes, winner
from .summary import OpTimes, choices

#: The rule, as recorded in the measurements file and printed under the tables.
RULE = ("a beats b when t_a < t_b - max({us} us, {pct:g}% of t_b); lamport_max_bytes: the last size, "
        "walking up from the smallest, before another algorithm beats Lamport; two_shot_min_bytes: the "
        "smallest size where two-shot beats one-shot, within the range (walking down from the largest "
        "size) where one-shot never beats two-shot; 'never' when there is none.")


def rule_text(cfg: TuneConfig) -> str:
    return RULE.format(us=cfg.margin_us, pct=100 * cfg.margin_rel)


def op_table(times: OpTimes, cfg: TuneConfig, tuned: dispatch.CrossoverTable,
             base: dispatch.CrossoverTable = dispatch.DEFAULT_TABLE) -> str:
    """The GitHub-style table of one op (columns in the module docstring)."""
    from tabulate import tabulate

    tuned_pick, base_pick = choices(times, cfg, tuned), choices(times, cfg, base)
    fused = times.op != "all_reduce"
    headers = ["size/rank"] + (["tokens"] if fused else []) + [f"{a} µs" for a in ALGORITHMS] + \
              ["tuned pick", "default pick"]
    body = []
    for i, n in enumerate(times.sizes):
        at = {a: times.median_us[a][i] for a in ALGORITHMS}
        best = winner(at)
        cells = [format_bytes(n)] + ([str(times.tokens[i])] if fused else [])
        cells += ["-" if at[a] is None else f"{at[a]:.1f}" + ("*" if a == best else "") for a in ALGORITHMS]
        cells += [tuned_pick[i], "" if base_pick[i] == tuned_pick[i] else base_pick[i]]
        body.append(cells)
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def threshold_lines(op: str, cfg: TuneConfig, d: Derived, tuned: dispatch.CrossoverTable,
                    diffs: list[dict], base: dispatch.CrossoverTable = dispatch.DEFAULT_TABLE) -> list[str]:
    """The tuned thresholds of ``op`` against ``base``'s, where the picks differ (with both times), and
    the derivation's notes."""
    new, old = tuned.lookup(op, cfg.world_size), base.lookup(op, cfg.world_size)
    lines = [f"{op}: lamport_max_bytes {format_bytes(new.lamport_max_bytes)} (default "
             f"{format_bytes(old.lamport_max_bytes)})"
             + (" [kept from the defaults: no Lamport for fp32]" if d.lamport_max_bytes is None else "")
             + f", two_shot_min_bytes {format_bytes(new.two_shot_min_bytes)} (default "
               f"{format_bytes(old.two_shot_min_bytes)})"]
    if not diffs:
        lines.append("  the default table picks the same algorithm at every size measured")
    else:
        lines.append(f"  the default table picks differently at {len(diffs)} of the sizes measured:")
        for x in diffs:
            what = format_bytes(x["bytes"]) + (f" ({x['tokens']} tokens)" if x["tokens"] else "")
            b = "not timed" if x["base_us"] is None else f"{x['base_us']:.1f} µs"
            t = "not timed" if x["tuned_us"] is None else f"{x['tuned_us']:.1f} µs"
            gain = ""
            if x["base_us"] and x["tuned_us"]:
                pct = 100 * (x["base_us"] - x["tuned_us"]) / x["base_us"]
                gain = f": the tuned pick {'saves' if pct >= 0 else 'costs'} {abs(pct):.0f}%"
            lines.append(f"    {what}: default {x['base']} {b}, tuned {x['tuned']} {t}{gain}")
    lines += [f"  note: {n}" for n in d.notes]
    return lines


def usage_lines(table_path: str, raw_path: str, world_size: int) -> list[str]:
    """Where the files are and how to use the table."""
    return [f"wrote {table_path} (crossover table, world size {world_size})",
            f"  and {raw_path} (every replay's time, the rule, the machine)",
            "use it: on every rank, before the Communicator is created (rank 0's file is the one used):",
            f"  export TPCOMM_DISPATCH_TABLE={table_path}"]


def measurements_doc(cfg: TuneConfig, environment: dict, merged: list[dict], derived: dict[str, Derived],
                     table: dispatch.CrossoverTable, diffs: dict[str, list[dict]]) -> dict:
    """The raw measurements file: config, environment, the rule, every entry of
    :func:`tpcomm.tune.summary.merge_ranks`, the derived thresholds with their notes, the table and the
    differences from the default table."""
    return {"config": asdict(cfg), "environment": environment, "rule": rule_text(cfg),
            "method": "CUDA graph of `calls` calls (one input set each, refilled before each replay, "
                      "untimed); replays start together on every rank; µs per call = replay time / calls; "
                      "slowest rank per replay, median over replays; each algorithm forced with "
                      "Communicator.use_algorithm and checked bit for bit before timing and after.",
            "measurements": merged,
            "derived": {op: asdict(d) for op, d in derived.items()},
            "table": json.loads(table.to_json()),
            "default_table": json.loads(dispatch.DEFAULT_TABLE.to_json()),
            "differences_from_default": diffs}


def write_json(path: str, text: str) -> None:
    """Write ``text`` to ``path``, making its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
