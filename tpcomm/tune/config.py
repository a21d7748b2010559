"""What ``tpcomm tune`` sweeps: the ops, the message sizes, the timing parameters, where the files go,
and how long it takes.

Sizes are bytes of one rank's message, the unit of :class:`tpcomm.dispatch.Crossover`:

* ``all_reduce``: a flat tensor of ``n`` bytes, ``n`` on a geometric grid from 8 KiB to 64 MiB (each
  power of two and 1.5 times it: about 27 % between neighbours). The shape does not matter: the
  communicator treats any tensor as flat rows (:data:`tpcomm.dispatch.ALL_REDUCE_ROW`).
* ``fused_add_rmsnorm``: ``(T, hidden)`` with a residual, ``n = T * hidden * element size``, ``T`` from
  1 to 16384 on the same kind of grid, plus the largest ``T`` whose message fits
  :data:`tpcomm.dispatch.LAMPORT_MAX_BYTES` (so the Lamport cap itself is measured).

Every grid size is a multiple of 4 bytes, so an fp32 sweep takes the same sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..dispatch import LAMPORT_MAX_BYTES

#: Ops ``tpcomm tune`` measures (names of :data:`tpcomm.dispatch.OPS`). All-gather and reduce-scatter
#: have one kernel each: nothing to choose.
OPS = ("all_reduce", "fused_add_rmsnorm")
DTYPE_NAMES = ("bf16", "fp16", "fp32")
ELEMENT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
#: The algorithms the dispatch chooses among, in the order the table lists them.
ALGORITHMS = ("lamport", "one_shot", "two_shot")

#: Smallest and largest all-reduce message of the sweep (the speed goals span 8 KiB..64 MiB).
AR_MIN_BYTES, AR_MAX_BYTES = 8 << 10, 64 << 20
#: Largest token count of the fused sweep (prefill of 16k tokens).
FUSED_MAX_TOKENS = 16384
#: ``--quick``: powers of four below 1 MiB, powers of two above (where the crossovers lie on an H200).
QUICK_AR_BYTES = (8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20,
                  32 << 20, 64 << 20)
QUICK_FUSED_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 16384)


def geometric(lo: int, hi: int) -> tuple[int, ...]:
    """Every ``2**k`` and ``3 * 2**(k-1)`` in ``[lo, hi]``, ascending (ratio 1.5 or 4/3 between
    neighbours).

    Raises:
        ValueError: ``lo < 1`` or ``hi < lo``.
    """
    if lo < 1 or hi < lo:
        raise ValueError(f"geometric: need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    out, p = set(), 1
    while p <= hi:
        out.update(v for v in (p, 3 * p // 2) if lo <= v <= hi)  # 3 * 1 // 2 == 1: no odd values
        p *= 2
    return tuple(sorted(out))


def all_reduce_sizes(quick: bool = False) -> tuple[int, ...]:
    """Bytes of the all-reduce sweep: :func:`geometric` from 8 KiB to 64 MiB (27 sizes), or
    :data:`QUICK_AR_BYTES` (11)."""
    return QUICK_AR_BYTES if quick else geometric(AR_MIN_BYTES, AR_MAX_BYTES)


def lamport_max_tokens(hidden: int, dtype: str) -> int:
    """The most rows of ``hidden`` elements whose message fits ``LAMPORT_MAX_BYTES`` (0 if none)."""
    return LAMPORT_MAX_BYTES // (hidden * ELEMENT_SIZE[dtype])


def fused_tokens(hidden: int, dtype: str, quick: bool = False) -> tuple[int, ...]:
    """Token counts of the fused sweep: 1, 2, 4, 8, then :func:`geometric` from 16 to 16384, or
    :data:`QUICK_FUSED_TOKENS`; both with :func:`lamport_max_tokens` added (for 16-bit dtypes)."""
    base = set(QUICK_FUSED_TOKENS) if quick else {1, 2, 4, 8} | set(geometric(16, FUSED_MAX_TOKENS))
    t_l = lamport_max_tokens(hidden, dtype)
    if ELEMENT_SIZE[dtype] == 2 and 1 <= t_l <= FUSED_MAX_TOKENS:
        base.add(t_l)
    return tuple(sorted(base))


@dataclass(frozen=True)
class TuneConfig:
    """One ``tpcomm tune`` sweep.

    Attributes:
        world_size: GPUs (ranks), >= 2.
        dtype: ``"bf16"`` (default), ``"fp16"`` or ``"fp32"`` (no Lamport: its threshold is then kept
            from the default table).
        hidden: elements per row of the fused op (default 6144); the all-reduce is flat.
        ops: from :data:`OPS`.
        ar_bytes: all-reduce message sizes (bytes per rank), ascending, each a multiple of the element
            size.
        fused_tokens: token counts of the fused op, ascending.
        graph_calls, replays, min_replays, warmup_replays, target_ms, set_bytes: timing parameters of
            :class:`tpcomm.bench.config.BenchConfig` (same meaning, same defaults but for ``--quick``).
        eps: RMSNorm epsilon.
        seed: base seed of every input.
        margin_rel, margin_us: the tie margin of :mod:`tpcomm.tune.crossover` (one algorithm beats
            another only when faster by more than ``max(margin_us, margin_rel * other)``).
        quick: the ``--quick`` preset was used (recorded in the JSON).
    """

    world_size: int
    dtype: str = "bf16"
    hidden: int = 6144
    ops: tuple[str, ...] = OPS
    ar_bytes: tuple[int, ...] = field(default_factory=all_reduce_sizes)
    fused_tokens: tuple[int, ...] = ()
    graph_calls: int = 20
    replays: int = 30
    min_replays: int = 8
    warmup_replays: int = 3
    target_ms: float = 60.0
    set_bytes: int = 1 << 30
    eps: float = 1e-6
    seed: int = 0
    margin_rel: float = 0.02
    margin_us: float = 0.3
    quick: bool = False

    def __post_init__(self):
        if self.world_size < 2:
            raise ValueError(f"TuneConfig: world_size must be >= 2, got {self.world_size}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"TuneConfig: dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.hidden < 1:
            raise ValueError(f"TuneConfig: hidden must be >= 1, got {self.hidden}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"TuneConfig: ops must be some of {', '.join(OPS)}, got {self.ops}")
        if not self.fused_tokens:
            object.__setattr__(self, "fused_tokens", fused_tokens(self.hidden, self.dtype, self.quick))
        es = ELEMENT_SIZE[self.dtype]
        for name, vals in (("ar_bytes", self.ar_bytes), ("fused_tokens", self.fused_tokens)):
            if not vals or any(not isinstance(v, int) or v < 1 for v in vals) or list(vals) != sorted(set(vals)):
                raise ValueError(f"TuneConfig: {name} must be distinct integers >= 1, ascending, got {vals}")
        bad = [n for n in self.ar_bytes if n % es]
        if bad:
            raise ValueError(f"TuneConfig: ar_bytes {bad} are not multiples of the {es}-byte {self.dtype} element")
        for name in ("graph_calls", "replays", "min_replays", "set_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"TuneConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_replays < 0 or not self.target_ms > 0:
            raise ValueError(f"TuneConfig: warmup_replays must be >= 0 and target_ms > 0, got "
                             f"{self.warmup_replays}, {self.target_ms}")
        if not (self.margin_rel >= 0 and self.margin_us >= 0):
            raise ValueError(f"TuneConfig: margins must be >= 0, got margin_rel={self.margin_rel}, "
                             f"margin_us={self.margin_us}")

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZE[self.dtype]

    def sizes(self, op: str) -> list[tuple[int, int | None]]:
        """``(bytes, tokens)`` of each message of ``op``, ascending (``tokens`` None for the all-reduce)."""
        if op == "all_reduce":
            return [(n, None) for n in self.ar_bytes]
        return [(t * self.hidden * self.element_size, t) for t in self.fused_tokens]

    def algorithms(self, nbytes: int) -> tuple[str, ...]:
        """Algorithms timed at ``nbytes``: Lamport only for 16-bit dtypes up to ``LAMPORT_MAX_BYTES``
        (the dispatch never sends more through it: :func:`tpcomm.dispatch.choose`)."""
        lamport = self.element_size == 2 and nbytes <= LAMPORT_MAX_BYTES
        return ALGORITHMS if lamport else ALGORITHMS[1:]

    def bench_config(self):
        """The :class:`tpcomm.bench.config.BenchConfig` whose timing fields the bench's harness reads
        (:func:`tpcomm.bench.timing.time_replays`, :func:`tpcomm.bench.config.calls_per_replay`)."""
        from ..bench.config import BenchConfig

        return BenchConfig(world_size=self.world_size, ops=("fused", "all_reduce"), hiddens=(self.hidden,),
                           dtypes=(self.dtype,), tokens=(1,), modes=("graph",), graph_calls=self.graph_calls,
                           replays=self.replays, min_replays=self.min_replays,
                           warmup_replays=self.warmup_replays, set_bytes=self.set_bytes,
                           target_ms=self.target_ms, eps=self.eps, seed=self.seed)


def make_config(world_size: int, dtype: str = "bf16", hidden: int = 6144, ops: tuple[str, ...] = OPS,
                quick: bool = False, **kw) -> TuneConfig:
    """The default sweep, or the ``--quick`` one: :data:`QUICK_AR_BYTES`, :data:`QUICK_FUSED_TOKENS`
    (+ the Lamport cap), at most 20 timed replays aiming at 30 ms of timing per measurement.

    Raises:
        ValueError: an argument is out of range (from :class:`TuneConfig`).
    """
    if quick:
        kw = {"replays": 20, "min_replays": 5, "target_ms": 30.0, **kw}
    return TuneConfig(world_size=world_size, dtype=dtype, hidden=hidden, ops=tuple(ops),
                      ar_bytes=all_reduce_sizes(quick), quick=quick, **kw)


def default_out_path(world_size: int) -> str:
    """``~/.cache/tpcomm/dispatch-w<W>.json`` (expanded)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "tpcomm", f"dispatch-w{world_size}.json")


def measurements_path(table_path: str) -> str:
    """Where the raw measurements go: beside the table, ``<stem>-measurements.json``."""
    stem, _ = os.path.splitext(table_path)
    return stem + "-measurements.json"


# -- how long it takes --------------------------------------------------------------------------------
# A model of the run, written before any run (no GPU was available to fit it), with the bench's
# measured constants where they apply (tpcomm/bench/estimate.py, fitted on 2 H200s). It errs long.

#: Seconds before the first measurement: spawning the ranks, imports, NCCL, the workspace.
STARTUP_S = 30.0
#: Seconds of Triton compilation per kernel variant (bench: 1.5 s); each op and algorithm compiles about
#: two variants over a sweep (Triton specialises integer arguments equal to 1 or divisible by 16).
COMPILE_S = 1.5
VARIANTS_PER_KERNEL = 2
#: Fixed seconds per measurement: the plan, the check (every rank's inputs and the reference), the
#: capture and the re-check after timing, the agreement steps (bench's graph-mode figure plus margin).
FIXED_S = 0.08
#: Host and line-up cost of one replay, ms (bench: the all-reduce, the GPU sleep, the event wait).
REPLAY_OVERHEAD_MS = 0.25
#: A call: latency floor plus the message at a bus rate (µs, GB/s; bench's model, slower than tpcomm).
CALL_FLOOR_US = 15.0
CALL_GBPS = 250.0
#: Refilling the input sets before each replay: device-to-device copies, GB/s.
REFILL_GBPS = 1500.0


def estimate_seconds(cfg: TuneConfig) -> float:
    """Seconds of device time the sweep of ``cfg`` is expected to take (see the constants above)."""
    from ..bench.config import calls_per_replay, replay_count

    bcfg = cfg.bench_config()
    kernels = sum(len(ALGORITHMS) if cfg.element_size == 2 else len(ALGORITHMS) - 1 for _ in cfg.ops)
    total = STARTUP_S + COMPILE_S * VARIANTS_PER_KERNEL * kernels
    for op in cfg.ops:
        for n, _ in cfg.sizes(op):
            K = calls_per_replay(n, bcfg)
            replay_ms = K * (CALL_FLOOR_US + n / (CALL_GBPS * 1e3)) / 1e3
            refill_ms = K * n / (REFILL_GBPS * 1e6)
            reps = replay_count(replay_ms, bcfg) + max(1, cfg.warmup_replays)
            each = FIXED_S + reps * (replay_ms + refill_ms + REPLAY_OVERHEAD_MS) / 1e3
            total += each * len(cfg.algorithms(n))
    return total
