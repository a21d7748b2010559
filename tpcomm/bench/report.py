"""Tables for the terminal and the docs (GitHub markdown), and the JSON file.

One table per op and mode, one line per dtype, hidden size and token count:

    H | dtype | T | MiB | tpcomm µs (algorithm) | <each other contender>: µs (speed-up) | tpcomm busbw GB/s | % of copy

A contender's cell ``42.0 (2.10x)`` reads: 42.0 µs per call, and tpcomm is 2.10 times faster than it
(below 1: tpcomm is slower). Reference rows (no communication) show µs only. ``n/a``: the contender does
not take the shape or is not installed (why: below the table); ``FAIL``: it failed its check and was not
timed. The peer-copy table gives the copy bandwidth behind ``% of copy`` (:mod:`tpcomm.bench.metrics`).
"""

from __future__ import annotations

import json
import os

from .config import MODES, OPS

_ORDER = ("copy",) + tuple(OPS)


def _cell(r: dict | None, sp: float | None, reference: bool) -> str:
    if r is None:
        return "n/a"
    if "error" in r:
        return "FAIL"
    if "median_us" not in r:
        return "n/a"
    us = f"{r['median_us']:.1f}"
    if reference or sp is None:
        return us
    return f"{us} ({sp:.2f}x)"


def _names(doc: dict, rows: list[dict]) -> list[str]:
    seen = {name for row in rows for name in row["results"]}
    return [n for n in doc["contenders"] if n in seen]


def tables(doc: dict) -> list[tuple[str, str, list[str]]]:
    """``(title, GitHub table, notes)`` for each op and mode of the document, in sweep order."""
    from tabulate import tabulate

    out = []
    groups: dict = {}
    for row in doc["rows"]:
        groups.setdefault((row["op"], row["mode"]), []).append(row)
    for (op, mode), rows in sorted(groups.items(), key=lambda kv: (_ORDER.index(kv[0][0]), MODES.index(kv[0][1]))):
        names = _names(doc, rows)
        labels = {n: doc["contenders"][n]["label"] for n in names}
        notes: dict = {}
        if op == "copy":
            headers = ["H", "dtype", "T", "MiB"] + [f"{labels[n]} µs" for n in names] + \
                      [f"{labels[n]} GB/s" for n in names]
            body = []
            for row in rows:
                res = row["results"]
                body.append([row["hidden"], row["dtype"], row["tokens"], f"{row['mib']:.3g}"]
                            + [_cell(res.get(n), None, True) for n in names]
                            + [f"{res[n]['busbw_GBps']:.3g}" if "busbw_GBps" in res.get(n, {}) else "n/a"
                               for n in names])
                _collect_notes(notes, row, names, labels)
            title = "peer copy (reference for % of copy bandwidth), graph mode"
        else:
            others = [n for n in names if n != "tpcomm"]
            headers = ["H", "dtype", "T", "MiB", "tpcomm µs"] + [labels[n] for n in others] + \
                      ["tpcomm busbw GB/s", "% of copy"]
            body = []
            for row in rows:
                res = row["results"]
                t = res.get("tpcomm", {})
                algo = t.get("note")
                ours = _cell(t, None, True) + (f" ({algo})" if algo and "median_us" in t else "")
                cells = [row["hidden"], row["dtype"], row["tokens"], f"{row['mib']:.3g}", ours]
                cells += [_cell(res.get(n), row["speedup"].get(n), doc["contenders"][n]["reference"])
                          for n in others]
                cells += [f"{t['busbw_GBps']:.3g}" if "busbw_GBps" in t else "n/a",
                          f"{t['pct_of_copy']:.0f}%" if t.get("pct_of_copy") is not None else "n/a"]
                body.append(cells)
                _collect_notes(notes, row, names, labels)
            title = f"{op}: {OPS[op]}, {mode} mode, µs per call (tpcomm's speed-up over each)"
        table = tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)
        out.append((title, table, [f"{k}: {v}" for k, v in notes.items()]))
    return out


def _collect_notes(notes: dict, row: dict, names: list[str], labels: dict) -> None:
    """Why cells are ``n/a`` or ``FAIL``, once per contender and reason."""
    for n in names:
        r = row["results"].get(n, {})
        why = r.get("na") or r.get("error")
        if why:
            kind = "FAIL" if "error" in r else "n/a"
            key = f"{labels[n]} {kind}"
            if key not in notes:
                notes[key] = f"{why} (first at {row['dtype']} H={row['hidden']} T={row['tokens']})"


def format_report(doc: dict) -> str:
    """Every table with its title and notes, plus the contenders that could not be set up."""
    parts = []
    for title, table, notes in tables(doc):
        parts.append(f"\n### {title}\n\n{table}")
        if notes:
            parts.append("\n".join(f"- {n}" for n in notes))
    if doc.get("unavailable"):
        parts.append("\nNot available in this run:\n" + "\n".join(
            f"- {doc['contenders'].get(n, {}).get('label', n)}: {why}" for n, why in doc["unavailable"].items()))
    return "\n".join(parts)


def write_json(doc: dict, path: str) -> None:
    """Write ``doc`` to ``path`` (folders made as needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
