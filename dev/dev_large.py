"""Development timing of large (prefill-sized) calls on 2 GPUs, per launch setting: fused bf16 and fused FP8
at hidden 6144 and the flat all-reduce, in CUDA graphs (``dev_fused.graph_time``, fewer calls per graph
than at decode), next to ``torch.ops.symm_mem.two_shot_all_reduce_`` in the base run. A setting is
``base`` or ``+``-joined keys: ``mb<MiB>`` (the communicator's ``max_bytes``, i.e. the bytes one launch
carries), ``mp<N>`` (``TPCOMM_MAX_PROGRAMS``, the grid cap; two-shot on one-tile rows of 4096+
elements runs up to twice it since the 8-warp change), ``w<N>`` (``num_warps`` of every row config).
The settings in ``docs/benchmarks.md`` were timed before that change, when the cap was the grid of every
launch. Every output is checked bit for bit against ``tpcomm.reference`` first. Not a published number
(those come from ``tpcomm bench``): it picks defaults to keep.

    PYTHONPATH=. python dev/dev_large.py --settings base,mb64,mp528,w8 [--out DIR]
"""
import argparse
import os
import re
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from dev_fused import graph_time, run_variants  # noqa: E402
from dev_single import _patch_warps  # noqa: E402

H = 6144
FUSED_TOKENS = (1024, 4096, 16384)
#: Flat all-reduce sizes in MiB (rows of 4096 bf16).
AR_MIB = (16, 64, 192)
_KEY = re.compile(r"^(mb|mp|w)(\d+)$")


def parse(setting):
    """``{"mb": MiB, "mp": programs, "w": warps}`` of a setting (keys absent when not given)."""
    out = {}
    for part in setting.split("+"):
        if part == "base":
            continue
        m = _KEY.match(part)
        if not m:
            raise ValueError(f"setting {setting!r}: {part!r} is not base, mb<MiB>, mp<N> or w<N>")
        out[m.group(1)] = int(m.group(2))
    return out


def body(rank, world, setting):
    knobs = parse(setting)
    if "w" in knobs:
        _patch_warps(knobs["w"])
    import tpcomm
    from tpcomm import reference as R

    comm = tpcomm.Communicator(max_bytes=knobs["mb"] << 20 if "mb" in knobs else None)
    rows, ok = [], True
    for T in FUSED_TOKENS:
        g = torch.Generator(device="cuda").manual_seed(T)
        xs = [torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16) for _ in range(world)]
        r = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(H, device="cuda", generator=g).to(torch.bfloat16)
        x = xs[rank]
        o_ref, ro_ref = R.add_rmsnorm_reference(R.reduce_in_rank_order(xs), r, w, 1e-6)
        q_ref, sc_ref = R.per_token_quant_reference(o_ref)
        o, ro = comm.fused_add_rmsnorm(x, r, w, 1e-6)
        q, sc, _, _ = comm.fused_add_rmsnorm(x, r, w, 1e-6, quant="fp8_per_token")
        good = (torch.equal(o, o_ref) and torch.equal(ro, ro_ref)
                and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sc, sc_ref))
        ok &= good
        calls = 10 if T < 16384 else 4
        plan = comm.plan("fused_add_rmsnorm", x.numel() * 2, H, x.dtype).algorithm
        rows.append(dict(case="fused", T=T, exact=good, plan=plan,
                         fused_us=graph_time(lambda: comm.fused_add_rmsnorm(x, r, w, 1e-6), calls, 15),
                         fp8_us=graph_time(lambda: comm.fused_add_rmsnorm(x, r, w, 1e-6, quant="fp8_per_token"),
                                           calls, 15)))
        del xs
    for mib in AR_MIB:
        n = mib << 19  # bf16 elements
        g = torch.Generator(device="cuda").manual_seed(mib)
        xs = [torch.randn(n // 4096, 4096, device="cuda", generator=g).to(torch.bfloat16) for _ in range(world)]
        x = xs[rank]
        y = comm.all_reduce(x)
        good = torch.equal(y, R.reduce_in_rank_order(xs))
        ok &= good
        row = dict(case="all_reduce", MiB=mib, exact=good,
                   us=graph_time(lambda: comm.all_reduce(x), 10 if mib < 192 else 4, 15))
        if not knobs:
            import torch.distributed._symmetric_memory as symm_mem
            buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
            symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
            buf.copy_(x)
            row["symm_two_shot_us"] = graph_time(
                lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", dist.group.WORLD.group_name),
                10 if mib < 192 else 4, 15)
        rows.append(row)
        del xs
    comm.check()
    comm.close()
    return ok, rows


def set_programs(setting):
    """``TPCOMM_MAX_PROGRAMS`` for the ranks of ``setting`` (unset without ``mp``)."""
    knobs = parse(setting)
    if "mp" in knobs:
        os.environ["TPCOMM_MAX_PROGRAMS"] = str(knobs["mp"])
    else:
        os.environ.pop("TPCOMM_MAX_PROGRAMS", None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="base")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    settings = args.settings.split(",")
    for s in settings:
        try:
            parse(s)
        except ValueError as e:
            ap.error(f"--settings: {e}")
    run_variants(body, settings, args.out, "dev_large.json", key="setting", before=set_programs, timeout_s=300)


if __name__ == "__main__":
    main()
