"""Compile every tpcomm kernel for sm_90 (H100/H200) on a machine without a GPU, down to a cubin with the
Triton wheel's own ptxas: catches front-end errors (types that differ between the branches of an `if`,
bad constexprs) that Triton's CPU interpreter does not check. Each line gives a variant's cubin size,
warps, barriers (``bar.sync`` in its PTX) and layout conversions (``ttg.convert_layout``, some of them
through shared memory), built with the alignment real launches specialise (``DIVISIBLE_16``). With
``--regs`` also prints each variant's registers per thread and spill bytes (``ptxas -v``), which bound
how many programs an SM holds at once.
Run with TRITON_INTERPRET=0:

    TRITON_INTERPRET=0 PYTHONPATH=. python benchmarks/compile_sm90.py [--quick] [--regs] [--ptx DIR]

``--ptx DIR`` also writes each variant's PTX to ``DIR/<n>-<kernel>.ptx`` (``tests/support/ptx_sync.py``
checks there that every wait decides as one block).
"""
import glob
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tpcomm import dispatch  # noqa: E402
from tpcomm.kernels import gather, lamport, one_shot, qk_norm, two_shot  # noqa: E402
from tpcomm.kernels.moe import NO_FINALIZE  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def sig_of(fn, types):
    return {name: types.get(name, "constexpr") for name in fn.arg_names}


#: The wheel's ptxas binaries (``ptxas``, ``ptxas-blackwell``): the first that reads the PTX's version is used.
PTXAS = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas*")))


def resources(ptx):
    """``"<registers> regs, <bytes> spill"`` of a kernel's PTX, from ``ptxas -v`` for sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        for ptxas in PTXAS:
            proc = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                break
        else:
            raise RuntimeError(f"no ptxas of {PTXAS} compiles this PTX")
        out = proc.stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return f"{regs.group(1) if regs else '?'} regs, {spill.group(1) if spill else '?'} B spill"


#: Arguments a launch passes 16-byte aligned (pointers) or as multiples of 16 (sizes and strides of the
#: shapes the kernels run at, e.g. hidden 6144): Triton specialises those as divisible by 16, which lets
#: it vectorise the accesses; without the attribute every access compiles as a scalar one.
DIVISIBLE_16 = {"x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr", "q_ptr", "s_ptr", "buf_table_ptr",
                "flag_table_ptr", "state_ptr", "err_ptr", "H", "numel", "row_stride", "slot_stride",
                "parity_stride", "tag_off", "half_stride", "width", "out_rank_stride"}


def build(fn, types, constexprs, num_warps=16, pdl=True):
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in DIVISIBLE_16}
    # the MoE finalize prologue's parameters: off (None constexprs) unless the variant gives them
    off = {k: v for k, v in NO_FINALIZE.items() if k in fn.arg_names and k not in types and k not in constexprs}
    src = ASTSource(fn=fn, signature=sig_of(fn, types), constexprs={**off, **constexprs}, attrs=attrs)
    k = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "enable_fp_fusion": False,
                                                    "launch_pdl": pdl})
    size = (f"{len(k.asm['cubin'])} B cubin, {num_warps} warps, {k.asm['ptx'].count('bar.sync')} barriers, "
            f"{k.asm['ttgir'].count('ttg.convert_layout')} layout conversions")
    if "--ptx" in sys.argv:
        folder = sys.argv[sys.argv.index("--ptx") + 1]
        with open(os.path.join(folder, f"{_BUILDING[0]:03d}-{fn.__name__.strip('_')}.ptx"), "w") as f:
            f.write(k.asm["ptx"])
    return f"{size}, {resources(k.asm['ptx'])}" if "--regs" in sys.argv else size


def epi_types(dt):
    return {"x_ptr": f"*{dt}", "res_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}",
            "res_out_ptr": f"*{dt}", "q_ptr": "*u8", "s_ptr": "*fp32", "s_row_stride": "i32",
            "s_group_stride": "i32", "in_scale_ptr": "*fp32", "buf_table_ptr": "*i64", "flag_table_ptr": "*i64",
            "state_ptr": "*i64",
            "err_ptr": "*i32", "abort_off": "i32", "n_rows": "i32", "H": "i32",
            "numel": "i32", "row_stride": "i32",
            "slot_stride": "i32", "parity_stride": "i32", "max_programs": "i32", "pad_programs": "i32", "eps": "fp32",
            "timeout": "i64", "rank": "i32", "signature": "i32", "j0": "i32", "n_local": "i32",
            "half_stride": "i32", "tag_off": "i32", "width": "i32", "out_rank_stride": "i32"}


def variants() -> list[tuple]:
    """Every variant to build: ``(label fields, build arguments)``, in the order they are printed."""
    quick = "--quick" in sys.argv  # one dtype, two tile sizes: every kernel and branch, fewer variants
    results = []
    for dt in (("bf16",) if quick else ("bf16", "fp32")):
        for block, tiles in (((8192, 1), (1024, 2)) if quick else ((8192, 1), (8192, 2), (1024, 1))):
            for quant in ((0, 1, 2) if quick else (0, 1, 2, 3)):  # 3: per group, UE8M0 scales
                for norm, res in ((True, True), (True, False), (False, False)):
                    if quant and not norm:
                        continue
                    ce = {"WORLD": 2, "BLOCK_H": block, "NUM_TILES": tiles, "NORM": norm, "HAS_RESIDUAL": res,
                          "GEMMA": False, "QUANT": quant, "STORE_OUT": not (quant and res), "FP8": tl.float8e4nv,
                          "NATIVE_FP8": True, "GROUP": 128 if quant >= 2 else 1, "PDL": True}
                    t = epi_types(dt)
                    warps = dispatch.row_config(block, 1).num_warps  # as the launchers pick them
                    results.append(("one_shot", dt, block, tiles, quant, norm,
                                    job(one_shot._one_shot_kernel, t, ce, warps)))
                    if dt == "bf16":
                        vectors = tiles == 1  # as lamport_call picks them (H a multiple of 8)
                        results.append(("lamport", dt, block, tiles, quant, norm,
                                        job(lamport._lamport_kernel, t,
                                              dict(ce, VECTORS=vectors,
                                                   REARM_IN_SPIN=vectors and block // 8 >= 32 * warps,
                                                   PREFETCH=vectors and norm and res,
                                                   SPIN_PACK=2 if vectors and block // 8 >= 64 * warps else 1),
                                                   warps)))
                    for scatter in (False, True):
                        if scatter and (norm or quant):
                            continue
                        results.append(("two_shot", dt, block, tiles, quant, norm,
                                        job(two_shot._two_shot_kernel, t, dict(ce, SCATTER_ONLY=scatter),
                                              dispatch.row_config(block, 1, two_shot=True).num_warps)))
        results.append(("all_gather", dt, 4096, 1, 0, False,
                        job(gather._all_gather_kernel, epi_types(dt), {"WORLD": 2, "BLOCK": 4096, "NUM_TILES": 1,
                                                                         "PDL": True})))
    # the forms with an input scale or FP4 bytes (4 static FP8, 5 MXFP4, 6 NVFP4; GROUP 0: swizzled
    # scales), fused with a residual, rows of one tile
    for quant, group in ((4, 1), (5, 1), (5, 0), (6, 1), (6, 0)):
        ce = {"WORLD": 2, "BLOCK_H": 8192, "NUM_TILES": 1, "NORM": True, "HAS_RESIDUAL": True, "GEMMA": False,
              "QUANT": quant, "STORE_OUT": False, "FP8": tl.float8e4nv, "NATIVE_FP8": True, "GROUP": group,
              "PDL": True}
        t, warps = epi_types("bf16"), dispatch.row_config(8192, 1).num_warps
        results.append(("one_shot", "bf16", 8192, 1, quant, True, job(one_shot._one_shot_kernel, t, ce, warps)))
        results.append(("lamport", "bf16", 8192, 1, quant, True,
                        job(lamport._lamport_kernel, t, dict(ce, VECTORS=True, REARM_IN_SPIN=8192 // 8 >= 32 * warps,
                                                               PREFETCH=True,
                                                               SPIN_PACK=2 if 8192 // 8 >= 64 * warps else 1),
                        warps)))
        results.append(("two_shot", "bf16", 8192, 1, quant, True,
                        job(two_shot._two_shot_kernel, t, dict(ce, SCATTER_ONLY=False),
                              dispatch.row_config(8192, 1, two_shot=True).num_warps)))
    # the MoE finalize prologue (kernels/moe.py): token order and permuted with a shared output, rows of one
    # tile in whole vectors (Lamport's spin) and of two tiles (Lamport's staged own row)
    moe_types = dict(epi_types("bf16"), e_ptr="*bf16", idx_ptr="*i32", tw_ptr="*fp32", sh_ptr="*bf16", K="i32",
                     n_expert_rows="i32", scaling="fp32")
    for block, tiles, indexed in ((8192, 1, False), (4096, 1, True), (1024, 2, True)):
        ce = {"WORLD": 2, "BLOCK_H": block, "NUM_TILES": tiles, "NORM": True, "HAS_RESIDUAL": True, "GEMMA": False,
              "QUANT": 1, "STORE_OUT": True, "FP8": tl.float8e4nv, "NATIVE_FP8": True, "GROUP": 1, "PDL": True,
              "FINALIZE": True, "INDEXED": indexed, "HAS_SHARED": indexed}
        warps, vectors = dispatch.row_config(block, 1).num_warps, tiles == 1
        results.append(("one_shot moe", "bf16", block, tiles, 1, True,
                        job(one_shot._one_shot_kernel, moe_types, ce, warps)))
        results.append(("lamport moe", "bf16", block, tiles, 1, True,
                        job(lamport._lamport_kernel, moe_types,
                            dict(ce, VECTORS=vectors, REARM_IN_SPIN=vectors and block // 8 >= 32 * warps,
                                 PREFETCH=vectors, SPIN_PACK=2 if vectors and block // 8 >= 64 * warps else 1),
                            warps)))
    # without programmatic dependent launch (TPCOMM_PDL=0, GPUs before sm_90): the same kernels, PDL off
    results.append(("one_shot no PDL", "bf16", 1024, 1, 0, True,
                    job(one_shot._one_shot_kernel, epi_types("bf16"),
                          {"WORLD": 2, "BLOCK_H": 1024, "NUM_TILES": 1, "NORM": True, "HAS_RESIDUAL": True,
                           "GEMMA": False, "QUANT": 0, "STORE_OUT": True, "FP8": tl.float8e4nv,
                           "NATIVE_FP8": True, "GROUP": 1, "PDL": False}, 4, pdl=False)))
    # the full-width QK norm (kernels/qk_norm.py): MiniMax-M2's widths at TP 2 (q 3072, k 512 columns) and
    # at TP 8 with rows of several tiles (q 768 columns in tiles of 256)
    qk_types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "wq_ptr": "*bf16", "wk_ptr": "*bf16", "qo_ptr": "*bf16",
                "ko_ptr": "*bf16", "buf_table_ptr": "*i64", "state_ptr": "*i64", "err_ptr": "*i32", "n_rows": "i32",
                "HQ": "i32", "HK": "i32", "q_stride": "i32", "k_stride": "i32", "qo_stride": "i32",
                "ko_stride": "i32", "slot_stride": "i32", "parity_stride": "i32", "eps": "fp32", "timeout": "i64",
                "rank": "i32", "signature": "i32", "tag_off": "i32", "max_programs": "i32", "abort_off": "i32",
                "kv_replicas": "i32"}
    for world, bq, tq, bk, warps in ((2, 4096, 1, 512, 8), (8, 256, 3, 64, 4)):
        results.append(("qk_norm", "bf16", bq, tq, "-", True,
                        job(qk_norm._qk_norm_kernel, qk_types,
                            {"WORLD": world, "ROWS": 1, "BLOCK_Q": bq, "TILES_Q": tq, "BLOCK_K": bk, "TILES_K": 1,
                             "IN_PLACE": world == 2, "PDL": True}, warps)))
    # every other dtype is gathered as bytes
    results.append(("all_gather", "u8", 4096, 1, 0, False,
                    job(gather._all_gather_kernel, dict(epi_types("u8"), x_ptr="*u8", out_ptr="*u8"),
                          {"WORLD": 2, "BLOCK": 4096, "NUM_TILES": 1, "PDL": True})))
    return results

def job(*args, **kwargs):
    """A build to run later (:func:`main`): ``build``'s arguments."""
    return (args, kwargs)


#: The variants of this run (:func:`main`), read by index in the forked workers.
_SPECS: list = []


#: The index of the variant this worker builds (the name of its ``--ptx`` file).
_BUILDING = [0]


def _build(i: int):
    label, (args, kwargs) = _SPECS[i][:-1], _SPECS[i][-1]
    _BUILDING[0] = i
    return label + (build(*args, **kwargs),)


def main():
    """Build every variant, as many at once as this machine has cores (forked workers: each build is
    independent and takes seconds), and print one line each in order."""
    import multiprocessing

    _SPECS[:] = variants()
    workers = min(len(_SPECS), os.cpu_count() or 1)
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.map(_build, range(len(_SPECS)), chunksize=1)
    else:
        results = [_build(i) for i in range(len(_SPECS))]
    for r in results:
        print(*r)
    print(f"compiled {len(results)} kernel variants for sm_90")


if __name__ == "__main__":
    sys.exit(main())
