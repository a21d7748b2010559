"""The ``tpcomm`` command (``python -m tpcomm``): ``demo``, ``bench``, ``check``, ``soak``, ``tune``.

This module hands each parsed command (:mod:`tpcomm.arguments`) to its module: :mod:`tpcomm.demo`,
:mod:`tpcomm.bench`, :mod:`tpcomm.soak`, :mod:`tpcomm.tune`; ``check`` (below) only reads what the machine
offers. Ranks are started with :func:`tpcomm.launch.launch`, so none of the subcommands needs ``torchrun``.
The console script enters through ``tpcomm_cli.py`` (beside the package), which parses before torch is
imported and then calls :func:`run`.
"""

from __future__ import annotations

import os
import sys

from .arguments import build_parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tpcomm`` console script; returns the exit status."""
    from . import __version__

    return run(build_parser(__version__).parse_args(argv))


def run(args) -> int:
    """Run the command ``args`` (parsed by :func:`tpcomm.arguments.build_parser`); returns the exit status."""
    if args.command != "check":  # `check` reports a bad variable itself; the others would fail in every rank
        problem = _environment_problem()
        if problem:
            print(f"tpcomm {args.command}: {problem} (see `tpcomm check`)", file=sys.stderr)
            return 2
    if args.command == "demo":
        if args.model:
            if args.quick:
                print("tpcomm demo: --quick applies without --model only; a shorter model demo: --dtype float32 "
                      "--steps 2", file=sys.stderr)
                return 2
            from .models import demo as model_demo

            if args.speculative and args.model != "minimax_m2":
                print("tpcomm demo: --speculative applies with --model minimax_m2 only", file=sys.stderr)
                return 2
            steps = 8 if args.steps is None else args.steps
            if args.speculative:
                from .models import speculative_demo

                return speculative_demo.main(args.model, device=args.device, world_size=args.world,
                                             dtype=args.dtype, steps=steps, heads=args.heads,
                                             kv_heads=args.kv_heads, k=args.speculative)
            return model_demo.main(args.model, device=args.device, world_size=args.world, dtype=args.dtype,
                                   steps=steps, heads=args.heads, kv_heads=args.kv_heads)
        if any(v is not None for v in (args.steps, args.dtype, args.heads, args.kv_heads, args.speculative)):
            print("tpcomm demo: --steps, --dtype, --heads, --kv-heads and --speculative apply with --model only",
                  file=sys.stderr)
            return 2
        from . import demo

        return demo.main(device=args.device, world_size=args.world, quick=args.quick)
    if args.command == "bench":
        from .bench.args import run_bench

        return run_bench(args)
    if args.command == "check":
        return check(args.world)
    if args.command == "soak":
        from . import soak

        return soak.main(steps=args.steps, world_size=args.world, device=args.device, seed=args.seed,
                         timeout_s=args.timeout, max_delay=args.max_delay)
    if args.command == "tune":
        from .tune.command import run_tune

        return run_tune(args)
    raise AssertionError(args.command)  # argparse refuses other commands


def _environment_problem() -> str | None:
    """What is wrong with the ``TPCOMM_*`` variables (:func:`tpcomm.env.read_env`, the dispatch table
    file), or None."""
    from . import dispatch, env

    try:
        cfg = env.read_env()
        if cfg.table:
            dispatch.load_table(cfg.table)
    except ValueError as e:
        return str(e)
    except OSError as e:
        return f"TPCOMM_DISPATCH_TABLE={cfg.table!r}: {e}"
    return None


# -- check --------------------------------------------------------------------------------------------

def _shm_writable() -> tuple[bool, str]:
    """Whether the CPU workspace can be made: a memfd (preferred), else a file in /dev/shm."""
    if hasattr(os, "memfd_create"):
        return True, "memfd_create available (the CPU workspace is an anonymous shared file)"
    path = "/dev/shm"
    if not os.path.isdir(path):
        return False, "no memfd_create and /dev/shm does not exist"
    if not os.access(path, os.W_OK):
        return False, "no memfd_create and /dev/shm is not writable"
    st = os.statvfs(path)
    return True, f"no memfd_create; /dev/shm writable, {st.f_bavail * st.f_frsize / 2**30:.1f} GiB free"


def check(plan_world: int | None = None) -> int:
    """Print what this machine supports and why, and the plans of a few shapes at ``plan_world`` ranks
    (default: this machine's). Returns 0, or 1 when a TPCOMM_* variable is invalid."""
    import platform

    import torch
    import torch.distributed as dist
    import triton

    from . import dispatch, env
    from .launch import default_device

    status = 0
    out = []

    def line(k, v):
        out.append(f"  {k:<28} {v}")

    out.append("versions")
    line("tpcomm", _version())
    line("python", platform.python_version())
    line("torch", torch.__version__)
    line("triton", triton.__version__)

    out.append("devices")
    cuda = torch.cuda.is_available()
    n = torch.cuda.device_count() if cuda else 0
    line("CUDA available", f"yes (CUDA {torch.version.cuda})" if cuda else
         f"no (torch built {'without CUDA' if torch.version.cuda is None else 'with CUDA, but no GPU is visible'})")
    line("GPUs", n)
    for i in range(n):
        prop = torch.cuda.get_device_properties(i)
        line(f"  cuda:{i}", f"{prop.name}, {prop.total_memory / 2**30:.0f} GiB, {prop.multi_processor_count} SMs, "
                           f"sm_{prop.major}{prop.minor}")
    peer_ok = True
    if n >= 2:
        missing = [(i, j) for i in range(n) for j in range(n)
                   if i != j and not torch.cuda.can_device_access_peer(i, j)]
        peer_ok = not missing
        line("peer access", "every pair" if peer_ok else
             "missing for " + ", ".join(f"{i}->{j}" for i, j in missing))
    line("NCCL", "available" if dist.is_nccl_available() else "not available")
    line("gloo", "available" if dist.is_gloo_available() else "not available")
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
        symm = "importable (the CUDA workspace and bench's symm_mem columns use it)"
    except Exception as e:  # an old torch or a build without it
        symm = f"not importable ({type(e).__name__}: {e})"
    line("torch symmetric memory", symm)
    _, shm = _shm_writable()
    line("CPU workspace", shm)

    out.append("how ranks run")
    device = default_device()
    if device == "cuda":
        line("tpcomm demo", f"{n} GPU ranks with NCCL, compiled Triton kernels")
        line("interpreter", "not used (TRITON_INTERPRET is set to 1 only for CPU ranks)")
    else:
        why = "no GPU" if n == 0 else f"only {n} GPU"
        line("tpcomm demo", f"2 CPU ranks with gloo ({why}; at least 2 GPUs are needed for GPU ranks)")
        line("interpreter", "used: CPU ranks run the Triton kernels with TRITON_INTERPRET=1")
    line("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "(unset)") + " in this process"
         + (" (importing tpcomm sets it without CUDA)" if not cuda else ""))
    if env.interpreter_problem():
        line("CPU kernels", f"cannot run in this process: {env.interpreter_problem()}")

    out.append("TPCOMM_* settings")
    names = ("TPCOMM_ALGO", "TPCOMM_TIMEOUT_S", "TPCOMM_MAX_PROGRAMS", "TPCOMM_DISPATCH_TABLE", "TPCOMM_PDL",
             "TPCOMM_DIRECT_LAUNCH")
    for k in names:
        line(k, os.environ[k] if k in os.environ else "(unset)")
    others = sorted(k for k in os.environ if k.startswith("TPCOMM_") and k not in names)
    if others:
        line("unknown TPCOMM_*", ", ".join(others) + " (tpcomm does not read these)")
    try:
        cfg = env.read_env()
        mp = cfg.max_programs if cfg.max_programs is not None else \
            ("default, from the SM count" if device == "cuda" else "4 (CPU interpreter)")
        line("in effect", f"algo={cfg.algo}, timeout_s={cfg.timeout_s:g}, max_programs={mp}")
        from .workspace import pdl_supported

        able = device == "cuda" and pdl_supported(torch.device("cuda", 0))
        line("programmatic launch", ("on" if cfg.pdl and able else "off") + " ("
             + ("TPCOMM_PDL=0" if not cfg.pdl else "GPU ranks on sm_90+" if able
                else "needs GPU ranks on sm_90+ GPUs") + ")")
    except ValueError as e:
        cfg = None
        status = 1
        line("INVALID", str(e))
    table = None
    if cfg is not None and cfg.table:
        try:
            table = dispatch.load_table(cfg.table)
            line("dispatch table", f"{cfg.table} ({table.device or 'no device named'})")
        except (OSError, ValueError) as e:
            status = 1
            line("INVALID", f"TPCOMM_DISPATCH_TABLE={cfg.table!r}: {e} (a Communicator would raise)")

    from . import topology

    out.append("topology (tpcomm/topology.py)")
    world = n if device == "cuda" else 2
    topo = topology.probe()
    valid = cfg is not None and not (cfg.table and table is None)  # else a Communicator would raise
    out.extend("  " + ln for ln in topology.report_lines(topo, device, world, valid))
    kernels = topology.algorithm_availability(topo, device, world)[0][1]

    out.append("algorithms")
    line("choices (TPCOMM_ALGO)", ", ".join(env.ALGO_CHOICES))
    if cfg is None:
        line("plans", "none: the TPCOMM_* settings are INVALID (above)")
    elif cfg.table and table is None:
        line("plans below", "from the built-in table: TPCOMM_DISPATCH_TABLE is INVALID (above), and a "
                            "Communicator would raise")
    if cfg is not None:
        hidden = 4096
        if plan_world and plan_world != world:
            line("plans below", f"of a group of {plan_world} ranks (--world), not this machine's {world}")
        world = plan_world or world
        for tokens in (1, 16, 64, 256, 4096):
            for op in ("all_reduce", "fused_add_rmsnorm", "all_gather", "reduce_scatter"):
                nbytes = tokens * hidden * 2
                plan = dispatch.choose(op, world, nbytes, hidden if op not in ("all_reduce", "all_gather") else
                                       min(tokens * hidden, dispatch.ALL_REDUCE_ROW), torch.bfloat16,
                                       forced=cfg.algo, kernels_available=kernels, table=table)
                line(f"{op} {tokens}x{hidden}", f"{plan.algorithm}: {topology.cite(plan.reason)} "
                                                f"(world {world}, bf16)")
    print("\n".join(out))
    return status


def _version() -> str:
    from . import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
