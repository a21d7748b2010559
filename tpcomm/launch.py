"""Start ``world_size`` ranks on this machine and run a function on each.

GPUs: one process per GPU with an NCCL group. CPU: one process per rank with a gloo group and
``TRITON_INTERPRET=1``, so tpcomm's Triton kernels run under the interpreter.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from . import env as _env  # noqa: F401  (its import refuses a tpcomm imported as an empty namespace package)

#: Variables set for every rank on GPU machines: NVLink multicast stays off (tpcomm does not use it, and
#: the GPU runs behind the published numbers had it off).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device() -> str:
    """``"cuda"`` when at least two GPUs are visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"


@contextmanager
def environment(extra: dict):
    """Set the variables in ``extra`` (values made strings) for the block, then restore the old ones."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update({k: str(v) for k, v in extra.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rank_environment(device: str) -> dict:
    """The environment a rank process runs with: this process's, plus :data:`GPU_ENV` and, for
    ``"cpu"``, ``TRITON_INTERPRET=1`` and ``OMP_NUM_THREADS=1``."""
    env = dict(os.environ)
    env.update(GPU_ENV)
    if device == "cpu":
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return env


#: Modules the fork server imports once, so that a rank process forked from it does not import them
#: again (:func:`rank_context`). None of them reads the variables of :func:`rank_environment` at import.
PRELOAD = ["torch", "torch.distributed"]


def rank_context():
    """The multiprocessing context that starts rank processes: a fork server that has imported torch
    (:data:`PRELOAD`) where the platform has one, else spawn. A rank then starts in a fraction of a
    second instead of the seconds that importing torch takes (docs/design.md, "Starting ranks"). The fork
    server's own environment is the one of its first use, so a rank takes its environment from the
    launching process (:func:`start_rank`); a forked rank holds no CUDA context, as the fork server
    never creates one."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("spawn")


#: What a rank process runs first (:func:`start_rank`): its environment, then its target, which is
#: unpickled only then, because unpickling it imports its module, and with it tpcomm and Triton, which
#: read ``TRITON_INTERPRET`` as they load.
_BOOTSTRAP = """
import os, pickle
os.environ.clear()
os.environ.update(env)
target, args = pickle.loads(payload)
target(*args, *channels)
"""


def start_rank(ctx, target: Callable[..., Any], args: tuple, env: dict, channels: tuple = ()):
    """Start a daemon process of ``ctx`` (:func:`rank_context`) that runs ``target(*args, *channels)``
    with the environment ``env`` (:func:`rank_environment`). ``target`` and ``args`` travel as pickle
    bytes (tensors by value), ``channels`` (multiprocessing queues) as the process's own arguments.
    Returns the started process."""
    namespace = {"env": env, "payload": pickle.dumps((target, tuple(args))), "channels": tuple(channels)}
    p = ctx.Process(target=exec, args=(_BOOTSTRAP, namespace), daemon=True)
    p.start()
    return p


def init_rank(rank: int, world_size: int, device: str, port: int) -> None:
    """Join the process group as ``rank`` (NCCL on ``cuda:rank``, or gloo) over TCP on localhost."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    else:
        torch.set_num_threads(1)
        backend = "gloo"
    kwargs = {"device_id": torch.device("cuda", rank)} if device == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, **kwargs)


def _worker(rank, world_size, device, port, fn, args, results):
    import torch.distributed as dist

    try:
        init_rank(rank, world_size, device, port)
        # pickled here, so tensors travel by value: torch's queue pickler would pass them as file
        # descriptors that the parent fetches from this process, which may have exited by then
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure, including KeyboardInterrupt in a rank
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class RankOutcome:
    """How one rank of a :func:`launch` ended.

    Attributes:
        rank: the rank.
        status: ``"returned"`` (``fn`` returned ``value``), ``"raised"`` (``error`` holds the
            traceback), ``"died"`` (the process ended without reporting: killed, crashed, ``os._exit``)
            or ``"killed"`` (still running at ``timeout_s``, then killed).
        value: what ``fn`` returned (``"returned"`` only), e.g. a ``PeerTimeoutError`` the rank caught.
        error: the traceback (``"raised"``), or how the process ended (``"died"``, ``"killed"``).
    """

    rank: int
    status: str
    value: Any = None
    error: str | None = None

    def describe(self, limit: int = 2000) -> str:
        """One block of :class:`RankFailure`'s message."""
        if self.status == "returned":
            text = repr(self.value)
            if len(text) > limit:
                text = text[:limit] + " ..."
            return f"rank {self.rank} returned: {text}"
        if self.status == "raised":
            return f"rank {self.rank} raised:\n{self.error}"
        return f"rank {self.rank} did not finish: {self.error}"


class RankFailure(RuntimeError):
    """A rank raised, crashed or did not finish in time.

    The message gives every rank's outcome, the ranks that completed included (what they returned, e.g.
    the ``PeerTimeoutError`` a survivor caught after its peer died); ``outcomes`` holds them as
    :class:`RankOutcome` objects, in rank order.
    """

    def __init__(self, message: str, outcomes: list[RankOutcome] | None = None):
        super().__init__(message)
        self.outcomes = list(outcomes or [])


def launch(fn: Callable[..., Any], world_size: int, device: str | None = None, args: tuple = (),
           timeout_s: float = 600.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes, one per rank.

    Each process joins a fresh process group first (NCCL on GPU ``rank``, or gloo on the CPU with the
    Triton interpreter). ``fn`` must be importable by name (defined at module level) and return a
    picklable value.

    Args:
        fn: the rank's work.
        world_size: number of ranks (>= 1; at most the number of GPUs for ``cuda``).
        device: ``"cuda"``, ``"cpu"`` or None (:func:`default_device`).
        args: extra positional arguments for ``fn``.
        timeout_s: seconds to wait for all ranks before killing them.
    Returns:
        ``fn``'s return values, in rank order.
    Raises:
        TypeError: ``world_size`` is not an int, or ``args`` is not a tuple (or list); ``fn`` or ``args``
            cannot be pickled (a lambda or a nested function), checked before any rank starts.
        ValueError: ``world_size``, ``device`` or ``timeout_s`` is invalid; ``fn`` is defined in a
            ``__main__`` without a file (``python -c``, a REPL, a notebook), where no rank can import it.
        RankFailure: a rank raised or crashed, or the ranks ran past ``timeout_s``; its message and its
            ``outcomes`` give every rank's outcome, what the other ranks returned included.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"launch: world_size must be an int, got {type(world_size).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"launch: args must be a tuple of fn's extra arguments, got {type(args).__name__} "
                        "(pass args=(value,) for one)")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"launch: timeout_s must be a positive, finite number of seconds, got {timeout_s!r}")
    _check_picklable(fn, tuple(args))
    device = device or default_device()
    if device not in ("cuda", "cpu"):
        raise ValueError(f"launch: device must be 'cuda' or 'cpu', got {device!r}")
    if world_size < 1:
        raise ValueError(f"launch: world_size must be >= 1, got {world_size}")
    if device == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(f"launch: world_size {world_size} exceeds the {torch.cuda.device_count()} visible GPUs")
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    env = rank_environment(device)
    procs = [start_rank(ctx, _worker, (r, world_size, device, port, fn, args), env, (results,))
             for r in range(world_size)]
    out: dict[int, tuple[bool, Any]] = {}
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
                out[rank] = (ok, value)
                if not ok:  # give the others a moment to report, then stop
                    deadline = min(deadline, time.monotonic() + 30)
            except (queue.Empty, ConnectionResetError, EOFError):
                # a reset pipe was seen once under heavy load on 2 cores; the ranks' state decides
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        ends = {}  # rank -> how its process ended, for the error message
        for r, p in enumerate(procs):
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
                ends[r] = f"still running after {timeout_s:g} s: killed"
            else:
                ends[r] = f"exit code {p.exitcode}"
    outcomes = [_outcome(r, out.get(r), ends[r]) for r in range(world_size)]
    failed = [o for o in outcomes if o.status != "returned"]
    if failed:
        died = [o.rank for o in failed if o.status == "died"]
        killed = [o.rank for o in failed if o.status == "killed"]
        head = f"launch: {len(failed)} of {world_size} ranks failed"
        if died:
            head += (f"; ranks {died} ended without reporting (a crash, os._exit, or an error before fn ran: "
                     "its traceback, if any, is on this process's stderr)")
        if killed:
            head += f"; ranks {killed} ran past {timeout_s:g} s and were killed"
        raise RankFailure(head + "; every rank's outcome:\n" + "\n".join(o.describe() for o in outcomes), outcomes)
    return [o.value for o in outcomes]


def _check_picklable(fn: Callable[..., Any], args: tuple) -> None:
    """Refuse, before any rank starts, an ``fn`` that no rank could load: each rank unpickles it, which
    imports it by name from its module (a rank whose unpickling fails dies before it can report)."""
    import sys

    name = getattr(fn, "__qualname__", repr(fn))
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(f"launch: fn {name} is defined in a __main__ without a file (python -c, a REPL or a "
                         "notebook): each rank imports fn by name and cannot find it there; define it at module "
                         "level in a .py file and import it (or run a script)")
    try:
        pickle.dumps((fn, args))
    except Exception as e:  # PicklingError, AttributeError (a local object), TypeError (an unpicklable arg)
        raise TypeError(f"launch: fn ({name}) and args must pickle, as each rank imports fn by name: define fn "
                        f"at module level of an importable file, and pass picklable args ({type(e).__name__}: "
                        f"{e})") from e


def _outcome(rank: int, reported: tuple[bool, Any] | None, end: str) -> RankOutcome:
    """The :class:`RankOutcome` of a rank from what it reported (None: nothing) and how its process ended."""
    if reported is None:
        return RankOutcome(rank, "killed" if end.startswith("still running") else "died", error=end)
    ok, value = reported
    if not ok:
        return RankOutcome(rank, "raised", error=value)
    try:
        return RankOutcome(rank, "returned", value=pickle.loads(value))
    except Exception as e:  # a value pickle can write but not read back (an __init__ taking other arguments)
        return RankOutcome(rank, "raised", error=f"its return value could not be unpickled: {e!r}")
