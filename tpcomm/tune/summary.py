"""From every rank's raw times to the measurements, the crossovers and the table (in the parent, pure).

* :func:`merge_ranks`: for each op, size and algorithm, the slowest rank's time of each replay (the
  replays start together on every rank), then the median over replays.
* :func:`by_op`: one op's sizes and median µs per algorithm, the input of
  :func:`tpcomm.tune.crossover.derive`.
* :func:`build_table`: the :class:`tpcomm.dispatch.CrossoverTable` of the measured world size.
* :func:`choices` / :func:`differences`: what the dispatch picks at each measured size with a table, and
  where the tuned table and the default one pick differently (with the times of both picks).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from .. import dispatch
from .config import ALGORITHMS, TuneConfig
from .crossover import Derived

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def merge_ranks(per_rank: list[dict]) -> list[dict]:
    """One entry per op, size and algorithm, in sweep order: ``op``, ``bytes``, ``tokens``,
    ``algorithm``, ``calls`` and either ``median_us``, ``min_us``, ``max_us``, ``replays``, ``times_us``
    (the slowest rank of each replay), or ``na`` / ``error`` (the first rank's that has one).

    Raises:
        ValueError: the ranks' items do not line up (a different sweep on some rank).
    """
    if not per_rank:
        raise ValueError("merge_ranks: no ranks")
    n = len(per_rank[0]["items"])
    if any(len(r["items"]) != n for r in per_rank):
        raise ValueError(f"merge_ranks: ranks report {[len(r['items']) for r in per_rank]} items")
    keys = ("op", "bytes", "tokens", "algorithm")
    merged = []
    for i in range(n):
        same = [r["items"][i] for r in per_rank]
        head = {k: same[0][k] for k in keys}
        if any({k: it[k] for k in keys} != head for it in same):
            raise ValueError(f"merge_ranks: item {i} differs between ranks: "
                             f"{[{k: it[k] for k in keys} for it in same]}")
        entry = {**head, "calls": same[0].get("calls")}
        for kind in ("error", "na"):
            found = next((it[kind] for it in same if kind in it), None)
            if found is not None:
                entry[kind] = found
                break
        else:
            replays = min(len(it["us"]) for it in same)
            if replays == 0:
                entry["error"] = "no timed replays"
            else:
                times = [max(it["us"][j] for it in same) for j in range(replays)]
                entry.update(median_us=statistics.median(times), min_us=min(times), max_us=max(times),
                             replays=replays, times_us=times)
        merged.append(entry)
    return merged


@dataclass
class OpTimes:
    """One op's measurements: ascending ``sizes`` (bytes), ``tokens`` (None for the all-reduce), and
    ``median_us[algo][i]`` (None where not timed)."""

    op: str
    sizes: list
    tokens: list
    median_us: dict


def by_op(merged: list[dict], op: str) -> OpTimes:
    """The entries of ``op`` arranged by size and algorithm.

    Raises:
        ValueError: ``op`` has no entries.
    """
    rows = [e for e in merged if e["op"] == op]
    if not rows:
        raise ValueError(f"by_op: no measurements of {op!r}")
    sizes = sorted({e["bytes"] for e in rows})
    tokens = {e["bytes"]: e["tokens"] for e in rows}
    med = {a: [None] * len(sizes) for a in ALGORITHMS}
    index = {n: i for i, n in enumerate(sizes)}
    for e in rows:
        med[e["algorithm"]][index[e["bytes"]]] = e.get("median_us")
    return OpTimes(op, sizes, [tokens[n] for n in sizes], med)


def build_table(cfg: TuneConfig, derived: dict[str, Derived], source: str, device: str,
                base: dispatch.CrossoverTable = dispatch.DEFAULT_TABLE) -> dispatch.CrossoverTable:
    """The table of ``cfg.world_size``: one :class:`~tpcomm.dispatch.Crossover` per op in ``derived``.

    ``lamport_max_bytes`` of None (Lamport not measured: a 32-bit sweep) keeps ``base``'s value, and the
    source says so. Ops not in ``derived`` get no entry: the dispatch then uses the default table's
    (:meth:`~tpcomm.dispatch.CrossoverTable.lookup`).
    """
    entries = {}
    for op, d in derived.items():
        src = source
        lamport = d.lamport_max_bytes
        if lamport is None:
            lamport = base.lookup(op, cfg.world_size).lamport_max_bytes
            src += f"; lamport_max_bytes kept from the defaults (Lamport needs 16-bit inputs, {cfg.dtype} was timed)"
        entries[op] = {cfg.world_size: dispatch.Crossover(min(lamport, dispatch.LAMPORT_MAX_BYTES),
                                                          d.two_shot_min_bytes, src)}
    return dispatch.CrossoverTable(entries, device)


def choices(times: OpTimes, cfg: TuneConfig, table: dispatch.CrossoverTable) -> list[str]:
    """The algorithm :func:`tpcomm.dispatch.choose` picks at each measured size of ``times`` with
    ``table`` (``hidden`` does not enter the choice)."""
    dt = TORCH_DTYPES[cfg.dtype]
    return [dispatch.choose(times.op, cfg.world_size, n, cfg.hidden, dt, table=table).algorithm
            for n in times.sizes]


def differences(times: OpTimes, cfg: TuneConfig, tuned: dispatch.CrossoverTable,
                base: dispatch.CrossoverTable = dispatch.DEFAULT_TABLE) -> list[dict]:
    """Measured sizes where ``base`` and ``tuned`` pick different algorithms: ``bytes``, ``tokens``,
    ``base`` / ``tuned`` (algorithms) and ``base_us`` / ``tuned_us`` (their median times here; None if
    that algorithm was not timed at this size)."""
    out = []
    for i, (b, t) in enumerate(zip(choices(times, cfg, base), choices(times, cfg, tuned))):
        if b != t:
            out.append({"bytes": times.sizes[i], "tokens": times.tokens[i], "base": b, "tuned": t,
                        "base_us": times.median_us.get(b, [None] * len(times.sizes))[i],
                        "tuned_us": times.median_us.get(t, [None] * len(times.sizes))[i]})
    return out
