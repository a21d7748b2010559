"""The plots of the performance page (docs/performance.md), drawn from the JSON behind its tables
(docs/data/) into docs/img/:

    python benchmarks/plots.py                 # every figure into docs/img/
    python benchmarks/plots.py --out DIR       # elsewhere (the tests draw into a temporary folder)

Each figure is latency against tokens on log axes, tpcomm (black) beside each alternative, one panel per op
and hidden size; its title gives the GPUs, the date, the commit and versions as the data records them, and
the command that measured it. A run whose JSON does not record its date or GPU takes them from the
performance page's heading of that run (``RUNS`` below).

  * ``perf-2xH200-graph.png``: the 2-GPU sweep, every contender (``results.jsonl``, run 2026-11-30);
  * ``perf-loopback-2ranks.png``, ``perf-loopback-4ranks.png``: decode sizes beside TRT-LLM as loopback ranks
    of one GPU (``decode-loopback-*.json``; the 4-rank TRT-LLM times are the same day's run in
    ``results.jsonl``);
  * ``perf-quant-forms.png``: each quantised form of the fused call beside the bf16 call and the composite
    (``quant-forms-*.jsonl``);
  * ``perf-host-time.png``: the host time of an eager call, as a multiple of torch's ``add_``
    (``host-time-loopback.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "docs", "data")

#: The command and, where the JSON lacks them, the date and GPU of each run (from docs/performance.md).
RUNS = {
    "sweep": dict(command="python3 -m tpcomm bench --ops fused,fused_fp8,all_reduce,reduce_scatter "
                          "--hidden 6144,7168 --dtype bf16 --modes graph"),
    "loopback-2": dict(date="2026-12-03", command="python3 -m tpcomm bench --loopback --hidden 4096,6144,8192 "
                                                  "--tokens 1,16,64,256,1024,4096"),
    "loopback-4": dict(date="2026-12-04", command="python3 -m tpcomm bench --loopback --world 4 --hidden "
                                                  "4096,6144 --tokens 1,16,64 (and TPCOMM_ALGO=lamport)"),
    "quant": dict(date="2026-12-02", gpu="NVIDIA H200", command="PYTHONPATH=. python benchmarks/quant_loopback.py "
                                                                "[--hidden 7168]"),
    "host": dict(date="2026-12-02", gpu="NVIDIA H200", command="PYTHONPATH=. python benchmarks/host_loopback.py "
                                                               "--calls 200 --rounds 5"),
}
#: Contender labels of ``tpcomm bench`` (``tpcomm.bench.contenders``), by JSON name.
LABELS = {"tpcomm": "tpcomm", "tpcomm_unfused": "tpcomm fused + quant kernel", "nccl": "NCCL + torch epilogue",
          "symm_one_shot": "symm_mem one-shot", "symm_two_shot": "symm_mem two-shot",
          "symm_reduce_scatter": "symm_mem reduce-scatter", "fi_trtllm_oneshot": "TRT-LLM one-shot (FlashInfer)",
          "fi_trtllm_twoshot": "TRT-LLM two-shot (FlashInfer)", "fi_vllm": "vLLM custom AR (FlashInfer)",
          "torch_epilogue": "torch epilogue alone (no comm)", "trtllm": "TRT-LLM one-shot (FlashInfer)"}
#: One color per contender in every figure (tpcomm: black, :data:`TPCOMM`).
COLORS = {"nccl": "tab:blue", "symm_one_shot": "tab:orange", "symm_two_shot": "tab:green",
          "symm_reduce_scatter": "tab:orange", "fi_trtllm_oneshot": "tab:red", "trtllm": "tab:red",
          "fi_trtllm_twoshot": "tab:pink", "fi_vllm": "tab:purple", "torch_epilogue": "tab:brown",
          "tpcomm_unfused": "tab:gray"}
OP_TITLES = {"fused": "all-reduce + residual + RMSNorm", "fused_fp8": "the same, FP8 per token out",
             "all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter"}
TPCOMM = dict(color="black", linewidth=2.2, zorder=5)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, rows: int, cols: int, width: float = 3.9, legend_rows: int = 3):
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig, axes = plt.subplots(rows, cols, figsize=(width * cols + 0.6, 2.9 * rows + 1.2 + 0.25 * legend_rows),
                             squeeze=False)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="both", labelsize=7)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("tokens")
    for ax in axes[:, 0]:
        ax.set_ylabel("µs per call")
    return fig, axes


def _finish(plt, fig, title: str, path: str, ncol: int = 4) -> str:
    handles = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            handles.setdefault(line.get_label(), line)
    fig.suptitle(title, fontsize=9)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(ncol, len(handles)), fontsize=8)
    rows = -(-len(handles) // ncol)
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, (0.25 * rows + 0.15) / height, 1, 1 - 0.55 / height))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _line(ax, points: dict, label: str, **style) -> None:
    """``points``: tokens -> µs; the x ticks are the token counts."""
    from matplotlib.ticker import NullLocator

    if points:
        tokens = sorted(points)
        ax.plot(tokens, [points[t] for t in tokens], label=label, **{"marker": "o", "markersize": 3, **style})
        ticks = sorted({int(x) for ln in ax.get_lines() for x in ln.get_xdata()})
        ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
        ax.xaxis.set_minor_locator(NullLocator())


def _results() -> list[dict]:
    with open(os.path.join(DATA, "results.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def sweep(out: str) -> str:
    """``perf-2xH200-graph.png``: the 2-GPU sweep, an op a row, a hidden size a column."""
    plt = _pyplot()
    rows = [r for r in _results() if r.get("bench") == "sweep" and r["op"] != "copy" and "median_us" in r]
    ops = [op for op in OP_TITLES if any(r["op"] == op for r in rows)]
    hiddens = sorted({r["hidden"] for r in rows})
    fig, axes = _panels(plt, len(ops), len(hiddens))
    for i, op in enumerate(ops):
        for j, H in enumerate(hiddens):
            ax = axes[i][j]
            sel = [r for r in rows if r["op"] == op and r["hidden"] == H]
            for name in dict.fromkeys(r["contender"] for r in sel):
                style = TPCOMM if name == "tpcomm" else dict(color=COLORS.get(name))
                if name == "torch_epilogue":
                    style["linestyle"] = ":"
                _line(ax, {r["tokens"]: r["median_us"] for r in sel if r["contender"] == name},
                      LABELS.get(name, name), **style)
            ax.set_title(f"{OP_TITLES[op]}, H={H} bf16", fontsize=9)
    r0 = rows[0]
    title = (f"{r0['machine']}, CUDA graphs, median of replays, slowest rank\n{r0['date']}, commit {r0['commit']}, "
             f"torch {r0['torch']}, Triton {r0['triton']}, NCCL {r0['nccl']}, FlashInfer {r0['flashinfer']}\n"
             + RUNS["sweep"]["command"])
    return _finish(plt, fig, title, os.path.join(out, "perf-2xH200-graph.png"))


def _loopback(out: str, name: str, ranks: int, series: list[tuple[str, list[dict], dict]], run: dict) -> str:
    """A loopback figure: an op a row, a hidden size a column, a line per ``(label, rows, style)``."""
    plt = _pyplot()
    ops = ["all_reduce", "fused", "fused_fp8"]
    hiddens = sorted({r["hidden"] for _, rows, _ in series for r in rows})
    fig, axes = _panels(plt, len(ops), len(hiddens))
    for i, op in enumerate(ops):
        for j, H in enumerate(hiddens):
            for label, rows, style in series:
                _line(axes[i][j], {r["tokens"]: r["us"] for r in rows if r["op"] == op and r["hidden"] == H},
                      label, **style)
            axes[i][j].set_title(f"{OP_TITLES[op]}, H={H} bf16", fontsize=9)
    return _finish(plt, fig, f"{ranks} loopback ranks on one {run['gpu']}, CUDA graphs of 50 calls a rank, median of "
                             f"20 replays\n{run['date']}, {run['versions']}\n{run['command']}",
                   os.path.join(out, name))


def loopback_2(out: str) -> str:
    """``perf-loopback-2ranks.png``: decode sizes, 2 loopback ranks, tpcomm and TRT-LLM."""
    with open(os.path.join(DATA, "decode-loopback-2ranks.json")) as f:
        doc = json.load(f)
    run = dict(RUNS["loopback-2"], gpu=doc["device"],
               versions=f"commit {doc['commit']}, torch {doc['torch']}, Triton {doc['triton']}, "
                        f"FlashInfer {doc['flashinfer']}")
    series = [("tpcomm", [r for r in doc["rows"] if r["library"] == "tpcomm"], TPCOMM),
              (LABELS["trtllm"], [r for r in doc["rows"] if r["library"] == "trtllm"], dict(color=COLORS["trtllm"]))]
    return _loopback(out, "perf-loopback-2ranks.png", doc["world"], series, run)


def loopback_4(out: str) -> str:
    """``perf-loopback-4ranks.png``: decode sizes, 4 loopback ranks: tpcomm on Lamport (``TPCOMM_ALGO=lamport``,
    what the default dispatch table runs at these sizes on 4 ranks), tpcomm with the fused forms on one-shot
    at 16 and 64 tokens, and TRT-LLM (the same day's run of results.jsonl)."""
    with open(os.path.join(DATA, "decode-loopback-4ranks.json")) as f:
        doc = json.load(f)
    with open(os.path.join(DATA, "decode-loopback-4ranks-lamport.json")) as f:
        lamport = json.load(f)
    trt = [r for r in _results() if r.get("bench") == "loopback" and r["library"] == "trtllm" and r["world"] == 4]
    run = dict(RUNS["loopback-4"], gpu=doc["device"],
               versions=f"tpcomm commit {doc['commit']}, TRT-LLM the same day (commit {trt[0]['commit']}, "
                        f"results.jsonl)\ntorch {doc['torch']}, Triton {doc['triton']}, "
                        f"FlashInfer {trt[0]['flashinfer']}")
    series = [("tpcomm, Lamport (the default dispatch at 4 ranks)", lamport["rows"], TPCOMM),
              ("tpcomm, the fused forms on one-shot at 16 and 64 tokens", doc["rows"],
               dict(color="dimgray", linestyle="--")),
              (LABELS["trtllm"], trt, dict(color=COLORS["trtllm"]))]
    return _loopback(out, "perf-loopback-4ranks.png", doc["world"], series, run)


def quant_forms(out: str) -> str:
    """``perf-quant-forms.png``: each form's fused call (solid) and its composite, the bf16 call followed by
    the standalone quantiser (dashed), beside the fused bf16 call (black); a hidden size a column."""
    plt = _pyplot()
    files = sorted(f for f in os.listdir(DATA) if f.startswith("quant-forms-") and f.endswith(".jsonl"))
    rows = []
    for name in files:
        with open(os.path.join(DATA, name)) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    hiddens = sorted({r["hidden"] for r in rows})
    fig, axes = _panels(plt, 1, len(hiddens), width=5.4, legend_rows=5)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, H in enumerate(hiddens):
        ax, sel = axes[0][j], [r for r in rows if r["hidden"] == H]
        _line(ax, {r["tokens"]: r["bf16_us"] for r in sel}, "fused, bf16 out", **TPCOMM)
        for k, form in enumerate(dict.fromkeys(r["form"] for r in sel)):
            c = colors[k % len(colors)]
            _line(ax, {r["tokens"]: r["us"] for r in sel if r["form"] == form}, f"fused, {form}", color=c)
            _line(ax, {r["tokens"]: r["bf16_and_op_us"] for r in sel if r["form"] == form},
                  f"bf16 call + standalone {form}", color=c, linestyle="--", marker="")
        ax.set_title(f"quantised forms, H={H} bf16", fontsize=9)
    run = RUNS["quant"]
    return _finish(plt, fig, f"2 loopback ranks on one {run['gpu']}, CUDA graphs of 50 calls a rank, median of 20 "
                             f"replays\n{run['date']}, torch 2.11, Triton 3.6\n{run['command']}",
                   os.path.join(out, "perf-quant-forms.png"), ncol=3)


def host_time(out: str) -> str:
    """``perf-host-time.png``: host time of an eager call as a multiple of ``add_``, at 1 and 64 tokens."""
    plt = _pyplot()
    with open(os.path.join(DATA, "host-time-loopback.json")) as f:
        doc = json.load(f)
    rows = [r for r in doc["rows"] if r.get("launcher") == "compiled" and "ratio_to_add" in r]
    calls = list(dict.fromkeys(r["op"] for r in rows))
    tokens = sorted({r["tokens"] for r in rows})
    fig, ax = plt.subplots(figsize=(11, 4.6))
    width = 0.8 / len(tokens)
    for k, T in enumerate(tokens):
        ratios = {r["op"]: r["ratio_to_add"] for r in rows if r["tokens"] == T}
        ax.bar([i + k * width for i in range(len(calls))], [ratios.get(c, 0) for c in calls], width,
               label=f"{T} token{'s' if T > 1 else ''}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(tokens) - 1) / 2 for i in range(len(calls))], calls, rotation=35, ha="right",
                  fontsize=8)
    ax.set_ylabel("host time / torch add_")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    run = RUNS["host"]
    ax.set_title(f"Host time of an eager call (out= : outputs passed), hidden {doc['hidden']} bf16, loopback ranks "
                 f"on one {run['gpu']}\nmedian of {doc['rounds']} rounds of {doc['calls']} calls; {run['date']}, "
                 f"torch {doc['torch']}\n{run['command']}", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out, "perf-host-time.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


FIGURES = (sweep, loopback_2, loopback_4, quant_forms, host_time)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Draw the performance page's plots from docs/data/.")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "img"), help="folder of the PNGs (docs/img)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for figure in FIGURES:
        print(figure(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
