"""Every ``TPCOMM_*`` environment variable tpcomm reads, in one place (listed in docs/api.md, "Environment variables").

Values are read when a :class:`~tpcomm.Communicator` is created, never at import time, so a test can
change them between communicators.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


def _refuse_a_namespace_parent() -> None:
    """Raise ImportError when the ``tpcomm`` that holds this module is an empty namespace package: a folder
    named ``tpcomm`` without ``__init__.py`` (the repository's clone, cloned under that name) that comes
    first on ``sys.path`` (the script's folder, or the current directory), while the package itself is
    reached through an editable install's finder, which Python asks only after the path. The package's
    ``__init__`` then never runs, and ``tpcomm.Communicator`` would be an AttributeError. Every tpcomm
    module imports this one, so importing any of them (``tpcomm.launch``, ``tpcomm.ops``, ...) says so."""
    parent = sys.modules.get(__name__.rpartition(".")[0])
    if parent is not None and getattr(parent, "__file__", None) is None and hasattr(parent, "__path__"):
        folders = ", ".join(str(p) for p in parent.__path__)
        raise ImportError(
            f"tpcomm: Python imported the folder {folders} as an empty namespace package named tpcomm (a folder "
            "named tpcomm without __init__.py, such as the repository's clone, comes first on sys.path: the "
            "script's folder or the current directory), so the package in "
            f"{os.path.dirname(os.path.abspath(__file__))} was never initialised. Run the script from another "
            "folder, rename that folder (clone into tpcomm-src), or set PYTHONSAFEPATH=1.")


_refuse_a_namespace_parent()

#: Algorithms a user may force with ``TPCOMM_ALGO``.
ALGO_CHOICES = ("auto", "lamport", "one_shot", "two_shot", "fallback")


#: Largest ``TPCOMM_MAX_PROGRAMS``: 16 programs per SM of a 132-SM H200 is 2112; far beyond it the signal
#: pad alone (``64 * max_programs * world_size`` bytes per rank) would take gigabytes.
MAX_PROGRAMS_LIMIT = 4096


@dataclass(frozen=True)
class EnvConfig:
    """Settings taken from the environment.

    Attributes:
        algo: ``TPCOMM_ALGO``: ``auto`` (default: the dispatch table decides), ``lamport``,
            ``one_shot``, ``two_shot`` or ``fallback`` (always ``torch.distributed``).
        table: ``TPCOMM_DISPATCH_TABLE``: path of a crossover table written by ``tpcomm tune`` (rank 0's
            file is used by every rank); unset: the built-in defaults.
        timeout_s: ``TPCOMM_TIMEOUT_S``: seconds a kernel waits for a peer before it gives up and the
            communicator raises :class:`~tpcomm.errors.PeerTimeoutError` (default 30).
        max_programs: ``TPCOMM_MAX_PROGRAMS``: upper bound on a kernel's grid (default: twice the
            number of SMs on CUDA, 4 under the CPU interpreter); two-shot's 8-warp programs (rows of one
            tile of 4096+ elements) run up to twice it (``dispatch.row_config``).
        pdl: ``TPCOMM_PDL``: ``1`` (default) launches the kernels with programmatic dependent launch on
            GPUs that have it (sm_90+), ``0`` never.
        direct_launch: ``TPCOMM_DIRECT_LAUNCH``: ``1`` (default) lets a repeated call on CUDA launch
            through the compiled kernel's own launcher (:mod:`tpcomm.kernels.launch`), ``0`` always
            through ``kernel[grid]``.
    """

    algo: str = "auto"
    table: str | None = None
    timeout_s: float = 30.0
    max_programs: int | None = None
    pdl: bool = True
    direct_launch: bool = True


def read_env() -> EnvConfig:
    """Read and validate the ``TPCOMM_*`` variables.

    Raises:
        ValueError: a variable holds a value outside its documented range.
    """
    raw_algo = os.environ.get("TPCOMM_ALGO")
    algo = (raw_algo or "auto").strip().lower()  # set but empty: unset
    if algo not in ALGO_CHOICES:
        raise ValueError(f"TPCOMM_ALGO={raw_algo!r}: expected one of {', '.join(ALGO_CHOICES)}")
    raw = os.environ.get("TPCOMM_TIMEOUT_S") or "30"
    try:
        timeout_s = float(raw)
    except ValueError:
        timeout_s = float("nan")
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"TPCOMM_TIMEOUT_S={raw!r}: expected a positive, finite number of seconds")
    mp = os.environ.get("TPCOMM_MAX_PROGRAMS")
    try:
        max_programs = int(mp) if mp else None
    except ValueError:
        raise ValueError(f"TPCOMM_MAX_PROGRAMS={mp!r}: expected an integer in [1, {MAX_PROGRAMS_LIMIT}]") from None
    if max_programs is not None and not 1 <= max_programs <= MAX_PROGRAMS_LIMIT:
        raise ValueError(f"TPCOMM_MAX_PROGRAMS={max_programs}: expected an integer in [1, {MAX_PROGRAMS_LIMIT}]")
    table = os.environ.get("TPCOMM_DISPATCH_TABLE") or None
    pdl = (os.environ.get("TPCOMM_PDL") or "1").strip()
    if pdl not in ("0", "1"):
        raise ValueError(f"TPCOMM_PDL={pdl!r}: expected 0 or 1")
    direct = (os.environ.get("TPCOMM_DIRECT_LAUNCH") or "1").strip()
    if direct not in ("0", "1"):
        raise ValueError(f"TPCOMM_DIRECT_LAUNCH={direct!r}: expected 0 or 1")
    return EnvConfig(algo=algo, table=table, timeout_s=timeout_s, max_programs=max_programs, pdl=pdl == "1",
                     direct_launch=direct == "1")


#: Set by ``tpcomm/__init__`` when, on a machine without CUDA, it set ``TRITON_INTERPRET=1`` after Triton had
#: already been imported: Triton's own library (``tl.max``, ...) was then built for the GPU, so no kernel can
#: run under the interpreter in this process (:func:`interpreter_problem`).
TRITON_IMPORTED_FIRST = False
#: Set by ``tpcomm/__init__`` before it defines the kernels: whether they are defined for the interpreter
#: (``TRITON_INTERPRET=1`` then), and whether torch sees CUDA. Triton fixes a kernel's mode when it is
#: defined, so a later change of the variable does not reach them (:func:`interpreter_problem`).
KERNELS_INTERPRETED: bool | None = None
CUDA_AVAILABLE: bool | None = None


def interpreter_problem() -> str | None:
    """Why tpcomm's kernels cannot run on the CPU (under the interpreter) in this process, or None: Triton
    imported before tpcomm; ``TRITON_INTERPRET`` changed since tpcomm was imported (e.g. ``0`` in the
    process that started ranks with ``tpcomm.launch``, whose ranks import the script, and tpcomm, before
    their own ``TRITON_INTERPRET=1`` applies); or, on a machine without CUDA, set to something other than
    ``1``. A communicator on CPU ranks falls back with this reason; the local CPU kernels raise it."""
    if TRITON_IMPORTED_FIRST:
        return ("Triton was imported before tpcomm could set TRITON_INTERPRET=1 (e.g. by `import triton` or "
                "torch.compile), so its kernels cannot run on the CPU in this process: import tpcomm first, "
                "or set TRITON_INTERPRET=1 before Python starts")
    now = os.environ.get("TRITON_INTERPRET")
    if KERNELS_INTERPRETED is not None and KERNELS_INTERPRETED != interpreter_enabled():
        return (f"TRITON_INTERPRET is {now!r} but was {'1' if KERNELS_INTERPRETED else 'not 1'} when tpcomm "
                "was imported, and Triton fixed its kernels' mode then: set TRITON_INTERPRET once, before Python "
                "starts (on a machine without CUDA, leave it unset: importing tpcomm sets it to 1)")
    if KERNELS_INTERPRETED is False and CUDA_AVAILABLE is False:
        return (f"TRITON_INTERPRET={now!r} on a machine without CUDA: Triton's kernels need a GPU or its CPU "
                "interpreter; unset TRITON_INTERPRET (importing tpcomm then sets it to 1) or set it to 1")
    return None


def interpreter_enabled() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
