"""Findings from a ``tpcomm bench --json`` file, as Markdown: every shape where tpcomm is not the fastest
(the winner and by how much), the FP8 epilogue's cost over bf16, and the speed targets (fused
against NCCL + torch epilogue, plain all-reduce against NCCL and symm_mem, % of the peer copy bandwidth).

    python benchmarks/bench_findings.py BENCH.json[.gz] > findings.md
"""
import argparse
import gzip
import json
from collections import defaultdict


def median(row, name):
    r = row["results"].get(name)
    return r["median_us"] if r and r.get("median_us") else None


def rivals(doc):
    """Contenders from other libraries (not tpcomm's own, not the no-communication references)."""
    return [n for n, c in doc["contenders"].items()
            if c["library"] not in ("tpcomm", "reference") and not c["reference"]]


def not_fastest(doc):
    out = defaultdict(list)
    names = rivals(doc)
    for row in doc["rows"]:
        ours = median(row, "tpcomm")
        if ours is None:
            continue
        best = min(((median(row, n), n) for n in names if median(row, n)), default=None)
        if best and best[0] < ours:
            out[(row["op"], row["mode"])].append((row, best[1], ours / best[0]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json", help="a tpcomm bench --json file (gzipped if it ends in .gz)")
    a = ap.parse_args()
    with (gzip.open if a.json.endswith(".gz") else open)(a.json, "rt") as f:
        doc = json.load(f)
    labels = {n: c["label"] for n, c in doc["contenders"].items()}
    rows = doc["rows"]
    total = defaultdict(int)
    for row in rows:
        if median(row, "tpcomm") is not None:
            total[(row["op"], row["mode"])] += 1
    losses = not_fastest(doc)
    print("## Where tpcomm is not the fastest\n")
    print("| op | mode | shapes lost / timed | worst (shape, winner, tpcomm / winner) |")
    print("|---|---|---|---|")
    for key in sorted(total):
        lost = losses.get(key, [])
        worst = max(lost, key=lambda t: t[2], default=None)
        w = (f"{worst[0]['dtype']} H={worst[0]['hidden']} T={worst[0]['tokens']}: {labels[worst[1]]}, "
             f"{worst[2]:.2f}x" if worst else "-")
        print(f"| {key[0]} | {key[1]} | {len(lost)} / {total[key]} | {w} |")
    for key in sorted(losses):
        print(f"\n### {key[0]}, {key[1]} mode\n")
        print("| dtype | H | T | tpcomm µs | winner | winner µs | tpcomm / winner |")
        print("|---|---|---|---|---|---|---|")
        for row, name, ratio in losses[key]:
            print(f"| {row['dtype']} | {row['hidden']} | {row['tokens']} | {median(row, 'tpcomm'):.1f} | "
                  f"{labels[name]} | {median(row, name):.1f} | {ratio:.2f}x |")
    print("\n## FP8 epilogue (graph mode): fused FP8 over fused bf16/fp16 out, and over fused + quant kernel\n")
    print("| dtype | H | T | fused µs | fused FP8 µs | FP8 overhead | fused + quant kernel µs | FP8 speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    fused = {(r["dtype"], r["hidden"], r["tokens"]): r for r in rows if r["op"] == "fused" and r["mode"] == "graph"}
    for r in rows:
        if r["op"] != "fused_fp8" or r["mode"] != "graph":
            continue
        f = fused.get((r["dtype"], r["hidden"], r["tokens"]))
        a8, b, u = median(r, "tpcomm"), median(f, "tpcomm") if f else None, median(r, "tpcomm_unfused")
        if a8 and b:
            unfused = f"{u:.1f} | {u / a8:.2f}x" if u else "- | -"
            print(f"| {r['dtype']} | {r['hidden']} | {r['tokens']} | {b:.1f} | {a8:.1f} | {a8 / b - 1:+.0%} | "
                  f"{unfused} |")
    print("\n## Decode targets (graph mode, bf16, H 6144)\n")
    print("| T | fused µs | NCCL + torch epilogue µs | speed-up | all-reduce µs | best rival AR µs (who) | "
          "AR % of copy |")
    print("|---|---|---|---|---|---|---|")
    ar = {(r["dtype"], r["hidden"], r["tokens"]): r for r in rows if r["op"] == "all_reduce" and r["mode"] == "graph"}
    def num(v):
        return f"{v:.1f}" if v else "-"

    for (dt, h, t), f in sorted(fused.items()):
        x = ar.get((dt, h, t))
        if dt != "bf16" or h != 6144 or x is None or median(f, "tpcomm") is None:
            continue
        best = min(((median(x, n), n) for n in rivals(doc) if median(x, n)), default=(None, None))
        ours, nccl = median(x, "tpcomm"), median(f, "nccl")
        copy = x.get("copy_bw_GBps")
        pct = f"{x['results']['tpcomm'].get('busbw_GBps', 0) / copy:.0%}" if copy and ours else "-"
        ratio = f"{nccl / median(f, 'tpcomm'):.2f}x" if nccl else "-"
        winner = f"{best[0]:.1f} ({labels[best[1]]})" if best[0] else "-"
        print(f"| {t} | {median(f, 'tpcomm'):.1f} | {num(nccl)} | {ratio} | {num(ours)} | {winner} | {pct} |")


if __name__ == "__main__":
    main()
