"""Development timing on ONE GPU: tpcomm's kernels run with a group of one rank (no peer traffic, no
waits), to see what a kernel body costs apart from NVLink. Used when only a one-GPU machine is lent:
fused bf16 against fused FP8 per algorithm, the standalone quant, a launch floor. Every output is
checked bit for bit against ``tpcomm.reference`` before it is timed. Not a published number: the
published ones come from ``tpcomm bench`` on 2 GPUs.

A group of one rank normally falls back (nothing to communicate); this script patches the set-up and
the dispatch so the kernels run with ``WORLD = 1``.

    PYTHONPATH=. python dev/dev_single.py [--out DIR] [--variant NAME]

``--variant`` patches a kernel helper or the row configuration before anything compiles (see
``VARIANTS``), to time alternatives; a variant's outputs are checked like the rest (some variants are
not exact on purpose: they bound what a change could save).
"""
import argparse
import importlib
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(__file__))
from dev_fused import graph_time  # noqa: E402

from tpcomm.kernels.epilogue import SUM_REDUCE  # noqa: E402
from tpcomm.kernels.quant import fp8_encode, row_amax  # noqa: E402


@triton.jit
def _q_rcp(v, scale, recip, fast, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr):
    return fp8_encode(v * recip, FP8, NATIVE_FP8)  # not exact: the floor of what a division can cost


@triton.jit
def _start_load(state_ptr, num_programs, PDL: tl.constexpr):
    # the epoch by a plain load, no ticket: for the finish variants below, which count at the end
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    return tl.load(state_ptr, volatile=True), 0


@triton.jit
def _finish_none(state_ptr, epoch, ticket, num_programs):
    pass


@triton.jit
def _tree_sum_tl(x):
    return tl.sum(x, axis=0)


def _patch(module: str, name: str, value):
    """Set ``name`` of the module ``module`` (``tpcomm.<module>``) to ``value``, before anything compiles."""
    setattr(importlib.import_module(f"tpcomm.{module}"), name, value)


def _patch_finish(fn):
    """Every kernel reads the epoch with a plain load and ends with ``fn``."""
    from tpcomm.kernels import gather, lamport, one_shot, two_shot
    for m in (gather, lamport, one_shot, two_shot):
        m.finish_program = fn
        m.start_program = _start_load


def _patch_warps(n):
    from tpcomm import dispatch
    row_config = dispatch.row_config

    def with_warps(hidden, max_programs, two_shot=False, **kw):
        cfg = row_config(hidden, max_programs, two_shot, **kw)
        return dispatch.RowConfig(cfg.block_h, cfg.num_tiles, n, cfg.max_programs)
    dispatch.row_config = with_warps


def _patch_no_preload():
    from tpcomm.kernels import lamport, one_shot
    lamport.PRELOAD_EPILOGUE = one_shot.PRELOAD_EPILOGUE = tl.constexpr(False)


@triton.jit
def _finish_acq_rel(state_ptr, epoch, ticket, num_programs):
    done = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == num_programs - 1:
        tl.atomic_xchg(state_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state_ptr, epoch + 1, sem="release", scope="gpu")


@triton.jit
def _store_fp8_wide(q_ptr, cols, code, mask, SRC_BITS: tl.constexpr):
    tl.store(q_ptr + cols, code, mask=mask)  # before the contiguity hint: 16 bytes a thread, another layout


@triton.jit
def _finish_counted(state_ptr, epoch, ticket, num_programs):
    done = tl.atomic_add(state_ptr + 1, 1, sem="relaxed", scope="gpu")  # one program counted too
    if done == num_programs - 1:
        tl.atomic_xchg(state_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state_ptr, epoch + 1, sem="relaxed", scope="gpu")


@triton.jit
def _finish_at_end(state_ptr, epoch, ticket, num_programs):
    # the counter bumped at the end, the last program advancing the epoch (one program: a plain store)
    if num_programs == 1:
        tl.store(state_ptr, epoch + 1)
    else:
        done = tl.atomic_add(state_ptr + 1, 1, sem="relaxed", scope="gpu")
        if done == num_programs - 1:
            tl.atomic_xchg(state_ptr + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(state_ptr, epoch + 1, sem="relaxed", scope="gpu")


@triton.jit
def _scale_one(amax, FP8: tl.constexpr):
    # not exact: scale 1 (the amax, left unused, is compiled out), no division for the scale
    return tl.full(amax.shape, 1.0, tl.float32)


@triton.jit
def _fp8_encode_clamped(x, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr):
    c = tl.minimum(tl.maximum(x, -448.0), 448.0)  # the explicit clamp before satfinite, as before
    code = c.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # e4m3fn, native only
    return tl.where(x != x, 0x7F, code).to(tl.uint8)


@triton.jit
def _quantize_selects(v, scale, recip, fast, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr):
    # as before: the sign of a zero quotient kept by a select, every byte through fp8_encode's NaN select
    if fast:
        q0 = v * recip
        q = tl.fma(tl.fma(-q0, scale, v), recip, q0)
        q = tl.where(q0 == 0.0, q0, q)
    else:
        q = tl.math.div_rn(v, scale)
    return fp8_encode(q, FP8, NATIVE_FP8)


@triton.jit
def _e4m3_bytes_to(x):
    return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # Triton's own conversion: pairs unpacked, repacked


@triton.jit
def _amax_from_out(p_max, inv, first, o, mask, DTYPE: tl.constexpr):
    return row_amax(o, mask)  # as before: reduced over out after the norm (p_max, unused, is compiled out)


@triton.jit
def _tree_sum_levels(x):
    for _ in tl.static_range(14):  # every level summed where it lies, as before the gather
        if x.shape[0] > 1:
            x = tl.sum(tl.reshape(x, (x.shape[0] // 2, 2)), axis=1)
    return tl.sum(x, axis=0)


#: ``--variant`` name -> what it patches before anything compiles (timing only; some are not exact).
VARIANTS = {
    "no_preload": _patch_no_preload,
    "acq_rel_finish": lambda: _patch_finish(_finish_acq_rel),
    "rcp": lambda: _patch("kernels.epilogue", "quantize", _q_rcp),
    "no_finish": lambda: _patch_finish(_finish_none),  # one rank only: peers would see stale epochs
    # layout-dependent order (not exact): bounds what the pairwise sum costs
    "tl_sum": lambda: _patch("kernels.epilogue", "tree_sum", _tree_sum_tl),
    "warps8": lambda: _patch_warps(8),
    "warps4": lambda: _patch_warps(4),
    "warps32": lambda: _patch_warps(32),  # 8192-wide tiles: 64 registers a thread at most, no spill (sm_90 build)
    "ar_rows_2048": lambda: _patch("dispatch", "ALL_REDUCE_ROW", 2048),
    "ar_rows_1024": lambda: _patch("dispatch", "ALL_REDUCE_ROW", 1024),
    "store_fp8_wide": lambda: _patch("kernels.epilogue", "store_fp8", _store_fp8_wide),
    # Lamport reads its tiles again after the poll, as before
    "lamport_reload": lambda: _patch("kernels.lamport", "SUM_GIVEN", SUM_REDUCE),
    "finish_counted": lambda: _patch_finish(_finish_counted),
    "finish_at_end": lambda: _patch_finish(_finish_at_end),
    "scale_one": lambda: _patch("kernels.epilogue", "fp8_scale", _scale_one),
    "clamp": lambda: _patch("kernels.quant", "fp8_encode", _fp8_encode_clamped),
    "tree_levels": lambda: _patch("kernels.epilogue", "tree_sum", _tree_sum_levels),
    "fp8_selects": lambda: _patch("kernels.epilogue", "quantize", _quantize_selects),
    "amax_from_out": lambda: _patch("kernels.epilogue", "tile_out_amax", _amax_from_out),
    "fp8_unpacked": lambda: _patch("kernels.quant", "e4m3_bytes", _e4m3_bytes_to),
}


@triton.jit
def _empty_kernel(p):
    pass


def patch_for_one_rank():
    """Let a Communicator on a group of one rank build its workspace and run the kernels."""
    from tpcomm import communicator as C, dispatch
    from tpcomm.workspace import Workspace

    choose = dispatch.choose

    def choose_any_world(op, world_size, *a, **k):
        return choose(op, max(world_size, 2), *a, **k)

    def set_up(self):
        self.workspace = Workspace(self.group, self.device, self.max_bytes, self._local_programs(),
                                   self.timeout_s,
                                   lamport_slot_bytes=min(self.max_bytes, dispatch.LAMPORT_MAX_BYTES),
                                   pdl=self.env.pdl)
        return None

    dispatch.choose = choose_any_world
    C.Communicator._set_up = set_up


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--variant", default="", choices=["", *VARIANTS])
    ap.add_argument("--hidden", default="6144,7168")
    ap.add_argument("--tokens", default="1,16,64,256,1024,4096")
    args = ap.parse_args()
    if args.variant:
        VARIANTS[args.variant]()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    patch_for_one_rank()
    import tpcomm
    from tpcomm import reference as R

    comm = tpcomm.Communicator()
    assert comm.uses_kernels
    log = []

    def emit(**row):
        log.append(row)
        print(json.dumps(row), flush=True)

    dummy = torch.zeros(1, device="cuda")
    emit(case="empty_kernel", us=graph_time(lambda: _empty_kernel[(1,)](dummy)))
    ok = True
    for H in [int(h) for h in args.hidden.split(",")]:
        for T in [int(t) for t in args.tokens.split(",")]:
            g = torch.Generator(device="cuda").manual_seed(H + T)
            x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
            r = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
            w = torch.randn(H, device="cuda", generator=g).to(torch.bfloat16)
            o_ref, ro_ref = R.add_rmsnorm_reference(x, r, w, 1e-6)
            q_ref, s_ref = R.per_token_quant_reference(o_ref)
            emit(case="torch_copy", H=H, T=T, us=graph_time(lambda: x.clone()))
            emit(case="standalone_quant", H=H, T=T,
                 us=graph_time(lambda: tpcomm.per_token_quant_fp8(o_ref)))
            for algo in ("lamport", "one_shot", "two_shot"):
                if algo == "lamport" and T * H * 2 > (4 << 20):
                    continue
                with comm.use_algorithm(algo):
                    o, ro = comm.fused_add_rmsnorm(x, r, w, 1e-6)
                    q, s, ro2, _ = comm.fused_add_rmsnorm(x, r, w, 1e-6, quant="fp8_per_token")
                    good = (torch.equal(o, o_ref) and torch.equal(ro, ro_ref) and torch.equal(ro2, ro_ref)
                            and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
                            and torch.equal(s, s_ref))
                    ok &= good
                    bf = graph_time(lambda: comm.fused_add_rmsnorm(x, r, w, 1e-6))
                    f8 = graph_time(lambda: comm.fused_add_rmsnorm(x, r, w, 1e-6, quant="fp8_per_token"))
                    ar = graph_time(lambda: comm.all_reduce(x))
                emit(case="fused", algo=algo, H=H, T=T, exact=good, bf16_us=bf, fp8_us=f8, all_reduce_us=ar,
                     fp8_over_bf16=f8 / bf - 1)
    comm.close()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"dev_single{'_' + args.variant if args.variant else ''}.json"), "w") as f:
        json.dump(log, f, indent=1)
    dist.destroy_process_group()
    print("ALL EXACT" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
