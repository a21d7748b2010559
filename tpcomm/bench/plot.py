"""PNG plots: for each op and mode, latency against message size, one line per contender, log axes; one
panel per dtype (rows) and hidden size (columns)."""

from __future__ import annotations

import os

_STYLE = {"tpcomm": dict(color="black", linewidth=2.2, zorder=5)}


def plot_files(doc: dict, stem: str) -> tuple[list[str], str | None]:
    """Write ``<stem>-<op>-<mode>.png`` for each op (peer copy excluded) and mode of ``doc``.

    Returns:
        ``(paths written, None)`` or ``([], why no plot was written)`` (matplotlib missing).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install matplotlib, or the 'bench' extra)"
    groups: dict = {}
    for row in doc["rows"]:
        if row["op"] != "copy":
            groups.setdefault((row["op"], row["mode"]), []).append(row)
    paths = []
    env, W = doc["environment"], doc["config"]["world_size"]
    for (op, mode), rows in groups.items():
        dtypes = sorted({r["dtype"] for r in rows}, key=["bf16", "fp16", "fp32"].index)
        hiddens = sorted({r["hidden"] for r in rows})
        width, height = max(8.0, 3.6 * len(hiddens) + 1), 3.2 * len(dtypes) + 1.6
        fig, axes = plt.subplots(len(dtypes), len(hiddens), figsize=(width, height), squeeze=False,
                                 sharex=True, sharey=True)
        handles = {}
        for i, d in enumerate(dtypes):
            for j, H in enumerate(hiddens):
                ax = axes[i][j]
                sel = sorted((r for r in rows if r["dtype"] == d and r["hidden"] == H), key=lambda r: r["bytes"])
                names = [n for n in doc["contenders"] if any(n in r["results"] for r in sel)]
                for n in names:
                    pts = [(r["mib"], r["results"][n]["median_us"]) for r in sel
                           if "median_us" in r["results"].get(n, {})]
                    if not pts:
                        continue
                    style = _STYLE.get(n, {})
                    if doc["contenders"][n]["reference"]:
                        style = dict(linestyle=":", **style)
                    (line,) = ax.plot(*zip(*pts), marker="o", markersize=3, label=doc["contenders"][n]["label"],
                                      **style)
                    handles.setdefault(n, line)
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.grid(True, which="both", alpha=0.3)
                ax.set_title(f"H={H} {d}", fontsize=9)
                if i == len(dtypes) - 1:
                    ax.set_xlabel("message (MiB)")
                if j == 0:
                    ax.set_ylabel("µs per call")
        if not handles:  # nothing timed in this mode (a CPU run's graph mode)
            plt.close(fig)
            continue
        fig.suptitle(f"{op}, {mode} mode\n{W} x {env.get('gpu', '?')}; median of replays, slowest rank",
                     fontsize=10)
        ncol = 3 if width < 12 else 4
        fig.legend(list(handles.values()), [h.get_label() for h in handles.values()], loc="lower center",
                   ncol=ncol, fontsize=8)
        legend_in = 0.25 * (-(-len(handles) // ncol)) + 0.1  # inches of legend rows below the panels
        fig.tight_layout(rect=(0, legend_in / height, 1, 1 - 0.5 / height))
        path = f"{stem}-{op}-{mode}.png"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths, None
