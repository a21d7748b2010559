"""The results file: every ``tpcomm bench`` run appended as flat rows, one JSON object a line, each with
its run's machine, commit and versions; the tables are rendered from it.

A row of the sweep holds ``bench="sweep"``, the run's columns (:data:`RUN_COLUMNS`), the shape (op, mode,
dtype, hidden, tokens, bytes) and one contender's result (``median_us``, ``busbw_GBps``,
``pct_of_copy``, ``note``, or ``na`` / ``error``). A row of ``--loopback`` holds ``bench="loopback"``,
the library (``tpcomm`` or ``trtllm``), the op, hidden, tokens and ``us``. :func:`render` gives one run's
tables as GitHub markdown, the latest run unless one is named, with the same columns as the run printed.

    tpcomm bench ... --results docs/data/results.jsonl      # run, then append the rows
    tpcomm bench --render docs/data/results.jsonl [--run RUN]   # print a run's tables (no GPU)
    python -m tpcomm.bench.results add FILE.json [--commit C] [--date D] [--results PATH]
                                                            # append an earlier run's JSON document
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

#: What every row says about its run.
RUN_COLUMNS = ("run", "date", "commit", "machine", "world", "torch", "triton", "nccl", "flashinfer")
#: The result fields a sweep row keeps of each contender's result.
_RESULT_FIELDS = ("median_us", "min_us", "max_us", "replays", "busbw_GBps", "pct_of_copy", "note", "na", "error")


def tpcomm_commit() -> str | None:
    """tpcomm's commit (short hash), when it runs from a git checkout; else None."""
    import subprocess

    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], text=True,
                              capture_output=True, timeout=10).stdout.strip() or None
    except Exception:  # no git, or not a checkout
        return None


def _now() -> str:
    """The current time, UTC, ISO (a run's default date)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _run_id(date: str, commit: str | None, machine: str) -> str:
    return f"{date} {commit or 'nogit'} {machine}"


def sweep_rows(doc: dict, date: str | None = None, commit: str | None = None) -> list[dict]:
    """The rows of a sweep's JSON document (:func:`tpcomm.bench.summary.summarize`). ``date`` (ISO,
    default now, UTC) and ``commit`` (default the document's) name the run."""
    env, cfg = doc.get("environment", {}), doc.get("config", {})
    world = cfg.get("world_size")
    machine = f"{env.get('gpu', '?')} x {world}"
    date = date or _now()
    commit = commit or env.get("tpcomm_commit")
    run = {"run": _run_id(date, commit, machine), "date": date, "commit": commit, "machine": machine,
           "world": world, "torch": env.get("torch"), "triton": env.get("triton"), "nccl": env.get("nccl"),
           "flashinfer": env.get("flashinfer")}
    rows = []
    for row in doc.get("rows", []):
        shape = {"bench": "sweep", "op": row["op"], "mode": row["mode"], "dtype": row["dtype"],
                 "hidden": row["hidden"], "tokens": row["tokens"], "bytes": row["bytes"]}
        for name, r in row["results"].items():
            rows.append({**run, **shape, "contender": name, **{k: r[k] for k in _RESULT_FIELDS if k in r}})
    return rows


def loopback_rows(doc: dict, date: str | None = None, commit: str | None = None) -> list[dict]:
    """The rows of a ``tpcomm bench --loopback`` JSON document."""
    machine = f"{doc.get('device', '?')} x 1 ({doc.get('world')} loopback ranks)"
    date = date or _now()
    commit = commit or doc.get("commit")
    run = {"run": _run_id(date, commit, machine), "date": date, "commit": commit, "machine": machine,
           "world": doc.get("world"), "torch": doc.get("torch"), "triton": doc.get("triton"), "nccl": None,
           "flashinfer": doc.get("flashinfer")}
    return [{**run, "bench": "loopback", "library": r["library"], "op": r["op"], "hidden": r["hidden"],
             "tokens": r["tokens"], "us": r.get("us"), "checked": r.get("checked")} for r in doc.get("rows", [])]


def rows_of(doc: dict, date: str | None = None, commit: str | None = None) -> list[dict]:
    """The rows of either kind of JSON document (a sweep's has ``environment``)."""
    return sweep_rows(doc, date, commit) if "environment" in doc else loopback_rows(doc, date, commit)


def append(rows: list[dict], path: str) -> None:
    """Append ``rows`` to the results file ``path`` (made, with its folders, as needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")


def load(path: str) -> list[dict]:
    """Every row of the results file ``path``.

    Raises:
        ValueError: a line is not a JSON object (its line number is named).
    """
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or "run" not in row:
                raise ValueError(f"{path}:{n}: not a results row (a JSON object with a 'run')")
            rows.append(row)
    return rows


def runs(rows: list[dict]) -> list[str]:
    """The runs of ``rows``, oldest first (by date, then as they were appended)."""
    seen: dict = {}
    for r in rows:
        seen.setdefault(r["run"], r.get("date") or "")
    return sorted(seen, key=lambda k: seen[k])


def render(rows: list[dict], run: str | None = None) -> str:
    """One run's tables as GitHub markdown, headed by its machine, commit, date and versions: the latest
    run of ``rows`` unless ``run`` names one (a full run id or a prefix of one: a date or a commit).

    Raises:
        ValueError: no rows, or ``run`` matches no run or several.
    """
    names = runs(rows)
    if not names:
        raise ValueError("the results file holds no runs")
    if run is None:
        chosen = names[-1]
    else:
        hits = [n for n in names if n == run or n.startswith(run) or f" {run} " in f" {n} "]
        if len(hits) != 1:
            raise ValueError(f"run {run!r} matches {len(hits)} runs; the runs are:\n" + "\n".join(names))
        chosen = hits[0]
    mine = [r for r in rows if r["run"] == chosen]
    head = mine[0]
    v = {k: head.get(k) or "?" for k in ("torch", "triton", "nccl", "flashinfer")}
    title = (f"{head['machine']}, commit {head.get('commit') or '(no git)'}, {head.get('date')}; torch "
             f"{v['torch']}, Triton {v['triton']}, NCCL {v['nccl']}, FlashInfer {v['flashinfer']}")
    if head.get("bench") == "loopback":
        return f"## {title}\n\n{_loopback_table(mine)}"
    from .report import format_report

    return f"## {title}\n{format_report(_sweep_doc(mine))}"


def _sweep_doc(rows: list[dict]) -> dict:
    """The parts of a sweep's JSON document that :func:`tpcomm.bench.report.format_report` reads."""
    from .contenders import ALL
    from .metrics import speedup

    contenders = {c.name: {"label": c.label, "library": c.library, "reference": c.reference} for c in ALL}
    shapes: dict = {}
    for r in rows:
        key = (r["op"], r["mode"], r["dtype"], r["hidden"], r["tokens"])
        row = shapes.setdefault(key, {"op": r["op"], "mode": r["mode"], "dtype": r["dtype"], "hidden": r["hidden"],
                                      "tokens": r["tokens"], "bytes": r["bytes"], "mib": r["bytes"] / 2**20,
                                      "results": {}})
        row["results"][r["contender"]] = {k: r[k] for k in _RESULT_FIELDS if k in r}
        contenders.setdefault(r["contender"], {"label": r["contender"], "library": "?", "reference": False})
    for row in shapes.values():
        ours = row["results"].get("tpcomm", {}).get("median_us")
        row["speedup"] = {n: speedup(res.get("median_us"), ours) for n, res in row["results"].items()
                          if n != "tpcomm" and not contenders[n]["reference"]}
    return {"contenders": contenders, "rows": list(shapes.values()), "unavailable": {}}


def _loopback_table(rows: list[dict]) -> str:
    from tabulate import tabulate

    us = {(r["library"], r["op"], r["hidden"], r["tokens"]): r.get("us") for r in rows}
    order = sorted({(r["hidden"], r["op"], r["tokens"]) for r in rows})
    body = []
    for H, op, T in order:
        a, b = us.get(("tpcomm", op, H, T)), us.get(("trtllm", op, H, T))
        body.append([H, op, T, "-" if a is None else f"{a:.2f}", "-" if b is None else f"{b:.2f}",
                     "-" if a is None or b is None else f"{a / b:.2f}"])
    return tabulate(body, headers=["hidden", "op", "tokens", "tpcomm µs", "TRT-LLM µs", "tpcomm / TRT-LLM"],
                    tablefmt="github", disable_numparse=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m tpcomm.bench.results add FILE... | render``: append earlier runs' JSON documents, or
    print a run's tables."""
    ap = argparse.ArgumentParser(prog="python -m tpcomm.bench.results")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="append the rows of JSON documents written by tpcomm bench --json")
    a.add_argument("files", nargs="+")
    a.add_argument("--commit", default=None, help="the commit the runs measured (default: the document's)")
    a.add_argument("--date", default=None, help="the date of the runs, ISO (default: now)")
    a.add_argument("--results", default=os.path.join("out", "results.jsonl"))
    r = sub.add_parser("render", help="print a run's tables")
    r.add_argument("results")
    r.add_argument("--run", default=None, help="a run id, or its date or commit (default: the latest run)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "add":
            for path in args.files:
                with open(path) as f:
                    rows = rows_of(json.load(f), args.date, args.commit)
                append(rows, args.results)
                print(f"{path}: {len(rows)} rows appended to {args.results}")
        else:
            print(render(load(args.results), args.run))
    except (OSError, ValueError, KeyError) as e:
        print(f"python -m tpcomm.bench.results: {type(e).__name__}: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
