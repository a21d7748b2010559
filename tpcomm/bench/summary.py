"""From every rank's raw times to the JSON document (in the parent process, no GPU).

For each op, mode and shape, each contender's time is the median over replays of the slowest rank
(per replay, the maximum over ranks). Bandwidths, speed-ups and the share of copy bandwidth follow
:mod:`tpcomm.bench.metrics`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict

from . import contenders as contenders_mod
from .config import BenchConfig
from .metrics import algbw_gbps, busbw_gbps, copy_percent, speedup

METHOD = ("graph: CUDA graph of `calls` calls, one input set per call (refilled before each replay, "
          "untimed); replays start together on all ranks (NCCL all-reduce + GPU sleep). eager: the same "
          "calls issued from Python after a host synchronisation, host overhead included. µs per call = "
          "replay time / calls; slowest rank per replay, median over replays. Every contender was checked "
          "against the reference before it was timed, and graph outputs again after.")


def _merge(per_rank_items: list[dict], mode: str) -> dict:
    """One mode of one item over the ranks: ``{"times_us": slowest per replay}`` or ``na`` / ``error``."""
    vals = [it.get(mode) for it in per_rank_items]
    for key in ("error", "na"):  # agreed between the ranks: the errors name the rank that had one
        for v in vals:
            if v is not None and key in v:
                return {key: v[key]}
    if any(v is None for v in vals):
        return {"na": "not run"}
    times = [v["us"] for v in vals]
    n = min(len(t) for t in times)
    return {"times_us": [max(t[i] for t in times) for i in range(n)]}


def summarize(per_rank: list[dict], cfg: BenchConfig) -> dict:
    """The JSON document of a run: ``config``, ``environment``, ``method``, ``contenders``,
    ``unavailable`` and ``rows`` (one per op, mode, dtype, hidden size and token count)."""
    W = cfg.world_size
    labels = {c.name: {"label": c.label, "library": c.library, "reference": c.reference}
              for c in contenders_mod.ALL}
    rows: dict = {}
    for i, item in enumerate(per_rank[0]["items"]):
        same = [r["items"][i] for r in per_rank]
        for mode in cfg.modes:
            if mode not in item:
                continue
            key = (item["op"], mode, item["dtype"], item["hidden"], item["tokens"])
            row = rows.setdefault(key, {"op": item["op"], "mode": mode, "dtype": item["dtype"],
                                        "hidden": item["hidden"], "tokens": item["tokens"],
                                        "bytes": item["bytes"], "mib": item["bytes"] / 2**20,
                                        "calls": item["calls"], "results": {}})
            m = _merge(same, mode)
            if "times_us" in m:
                t = m["times_us"]
                med = statistics.median(t)
                m = {"median_us": med, "min_us": min(t), "max_us": max(t), "replays": len(t),
                     "algbw_GBps": algbw_gbps(item["bytes"], med),
                     "busbw_GBps": busbw_gbps(item["op"], item["bytes"], med, W), "times_us": t}
            if item.get("note"):
                m["note"] = item["note"]
            m["wall_s"] = max(it["wall_s"] for it in same)  # the whole turn, both modes, slowest rank
            if item.get("phases_s"):
                m["phases_s"] = item["phases_s"]
            row["results"][item["contender"]] = m
    copy_bw = {}
    for (op, mode, d, H, T), row in rows.items():
        if op == "copy":
            bws = [r["busbw_GBps"] for r in row["results"].values() if "busbw_GBps" in r]
            if bws:
                copy_bw[(d, H, T)] = max(bws)
    for (op, mode, d, H, T), row in rows.items():
        res = row["results"]
        ours = res.get("tpcomm", {}).get("median_us")
        row["copy_bw_GBps"] = copy_bw.get((d, H, T))
        row["speedup"] = {name: speedup(r.get("median_us"), ours) for name, r in res.items()
                          if name != "tpcomm" and not labels.get(name, {}).get("reference")}
        for r in res.values():
            if "busbw_GBps" in r and op != "copy":
                r["pct_of_copy"] = copy_percent(r["busbw_GBps"], row["copy_bw_GBps"])
    return {"config": asdict(cfg), "environment": dict(per_rank[0]["info"]), "method": METHOD,
            "contenders": labels, "unavailable": per_rank[0]["unavailable"], "rows": list(rows.values())}


def failures(doc: dict) -> list[str]:
    """Lines naming every contender that was not timed because it failed (``n/a`` rows excluded)."""
    out = []
    for row in doc["rows"]:
        for name, r in row["results"].items():
            if "error" in r:
                out.append(f"{row['op']} {row['mode']} {row['dtype']} H={row['hidden']} T={row['tokens']} "
                           f"{name}: {r['error']}")
    return out


def tpcomm_failed(doc: dict) -> bool:
    """Whether any tpcomm row failed its check, its capture or its calls."""
    return any("error" in row["results"].get("tpcomm", {}) for row in doc["rows"])
