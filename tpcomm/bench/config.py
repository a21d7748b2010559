"""What ``tpcomm bench`` measures: the ops, the shapes, the timing parameters, and the sweep presets.

Shapes. ``T`` is a row count and ``H`` the hidden size. For ``all_reduce``, ``fused`` and ``fused_fp8``
each rank holds a ``(T, H)`` input. For ``all_gather`` and ``reduce_scatter`` ``T`` counts the rows of the
*whole* tensor (nccl-tests' "size"): all-gather takes ``(T / W, H)`` on each rank and returns ``(T, H)``;
reduce-scatter takes ``(T, H)`` and returns each rank's ``(T / W, H)`` share. So every op's row "T x H"
names the same bytes ``n = T * H * element_size`` (:func:`message_bytes`), and ``T`` must be a multiple
of the world size for those two ops (other rows are reported as not run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: Ops in table order, with what a row times. ``fused_fp8`` runs only when asked for (``--ops``) or when
#: this tpcomm's ``fused_add_rmsnorm`` takes ``quant=`` (the fused FP8 output).
OPS = {
    "fused": "all-reduce + residual add + RMSNorm (bf16/fp16 out)",
    "fused_fp8": "all-reduce + residual add + RMSNorm + per-token FP8 quant (e4m3fn out)",
    "all_reduce": "all-reduce",
    "all_gather": "all-gather along rows",
    "reduce_scatter": "reduce-scatter along rows",
}
DEFAULT_OPS = ("fused", "all_reduce", "all_gather", "reduce_scatter")
#: ``graph``: calls inside CUDA graphs (decode); ``eager``: plain calls, host overhead included (prefill
#: often runs outside graphs).
MODES = ("graph", "eager")
DTYPE_NAMES = ("bf16", "fp16", "fp32")

#: Hidden sizes of real models: gpt-oss (2880), Llama-3-8B (4096), Mixtral-8x22B / Qwen (6144),
#: DeepSeek-V3 (7168), Llama-3-70B (8192).
FULL_HIDDENS = (2880, 4096, 6144, 7168, 8192)
#: Decode (1..256) to prefill (1024..16384) token counts.
FULL_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
FULL_DTYPES = ("bf16", "fp16")
#: ``--quick``: one hidden size, one dtype, a decode, a mid and a prefill size (about a minute on 2 H200s).
QUICK_HIDDENS = (6144,)
QUICK_TOKENS = (16, 256, 4096)
QUICK_DTYPES = ("bf16",)


@dataclass(frozen=True)
class BenchConfig:
    """One sweep of ``tpcomm bench``.

    Attributes:
        world_size: GPUs (ranks), >= 2.
        ops: ops to time, from :data:`OPS`.
        hiddens: hidden sizes ``H`` (elements per row), each >= 1.
        dtypes: ``"bf16"``, ``"fp16"`` and/or ``"fp32"``.
        tokens: row counts ``T`` (see the module docstring for all-gather / reduce-scatter).
        modes: ``"graph"`` and/or ``"eager"``.
        contenders: only these contender names (None: every one, see ``tpcomm.bench.contenders``).
        graph_calls: most calls captured in one CUDA graph (and issued per eager repetition); fewer for
            large messages, see :func:`calls_per_replay`.
        replays: most timed replays per contender and shape (20: a median over 400 calls at decode
            sizes); fewer when a replay is long, see :func:`replay_count`.
        min_replays: fewest timed replays.
        warmup_replays: replays dropped before timing (2: the first replay after capture was the only
            slow one in the 2-H200 runs).
        set_bytes: bytes of input sets one graph may cycle through (default 1 GiB, see
            :func:`calls_per_replay`: keeps large messages out of L2 (60 MB on an H200) without filling
            the GPU).
        target_ms: timed replays per contender stop near this many ms of GPU time (default 30 ms; at
            least ``min_replays``): what keeps the full sweep near 6 minutes on 2 H200s.
        eps: RMSNorm epsilon.
        seed: base seed of every input.
    """

    world_size: int
    ops: tuple[str, ...] = DEFAULT_OPS
    hiddens: tuple[int, ...] = FULL_HIDDENS
    dtypes: tuple[str, ...] = FULL_DTYPES
    tokens: tuple[int, ...] = FULL_TOKENS
    modes: tuple[str, ...] = MODES
    contenders: tuple[str, ...] | None = None
    graph_calls: int = 20
    replays: int = 20
    min_replays: int = 6
    warmup_replays: int = 2
    set_bytes: int = 1 << 30
    target_ms: float = 30.0
    eps: float = 1e-6
    seed: int = 0

    def __post_init__(self):
        if self.world_size < 2:
            raise ValueError(f"BenchConfig: world_size must be >= 2, got {self.world_size}")
        for name, vals, allowed in (("ops", self.ops, OPS), ("dtypes", self.dtypes, DTYPE_NAMES),
                                    ("modes", self.modes, MODES)):
            if not vals:
                raise ValueError(f"BenchConfig: {name} is empty")
            bad = [v for v in vals if v not in allowed]
            if bad:
                raise ValueError(f"BenchConfig: {name} has {bad}; expected some of {', '.join(allowed)}")
        for name, vals in (("hiddens", self.hiddens), ("tokens", self.tokens)):
            if not vals or any(not isinstance(v, int) or v < 1 for v in vals):
                raise ValueError(f"BenchConfig: {name} must be integers >= 1, got {vals}")
        for name in ("graph_calls", "replays", "min_replays", "set_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_replays < 0:
            raise ValueError(f"BenchConfig: warmup_replays must be >= 0, got {self.warmup_replays}")
        if not self.eps >= 0:
            raise ValueError(f"BenchConfig: eps must be >= 0, got {self.eps}")


def quick(cfg: BenchConfig) -> BenchConfig:
    """``cfg`` with the ``--quick`` shapes (ops, modes and timing parameters kept)."""
    return replace(cfg, hiddens=QUICK_HIDDENS, tokens=QUICK_TOKENS, dtypes=QUICK_DTYPES)


ELEMENT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def message_bytes(T: int, H: int, dtype: str) -> int:
    """Bytes ``n = T * H * element_size`` that name a row (one rank's input of an all-reduce; the whole
    gathered / unreduced tensor of an all-gather / reduce-scatter)."""
    return T * H * ELEMENT_SIZE[dtype]


def runs_shape(op: str, T: int, world_size: int) -> str | None:
    """Why ``op`` has no row at ``T`` rows (None when it has one): all-gather and reduce-scatter split
    the rows evenly over the ranks."""
    if op in ("all_gather", "reduce_scatter") and T % world_size:
        return f"T={T} is not a multiple of the world size {world_size}"
    return None


def calls_per_replay(nbytes: int, cfg: BenchConfig) -> int:
    """Calls (and input sets) per graph: ``graph_calls``, or fewer for large messages so that the input
    sets fit in ``set_bytes`` (at least 2, so consecutive calls never read the same set)."""
    return max(1, min(cfg.graph_calls, max(2, cfg.set_bytes // max(1, nbytes))))


def set_capacity(k: int, max_bytes: int, cfg: BenchConfig) -> int:
    """Bytes input set ``k`` must hold for every message of up to ``max_bytes`` of the sweep: sets 0 and
    1 take the largest message; set ``k >= 2`` is used only by messages of at most
    ``set_bytes // (k + 1)`` bytes (:func:`calls_per_replay`). Rounded up to 16 bytes, so a byte buffer
    of this size can be viewed as any dtype."""
    need = max_bytes if k < 2 else min(max_bytes, cfg.set_bytes // (k + 1))
    return max(16, -(-need // 16) * 16)


def replay_count(replay_ms: float, cfg: BenchConfig) -> int:
    """Timed replays for a replay of ``replay_ms`` (the slowest rank's warm-up replay): enough for
    about ``target_ms`` of timing, between ``min_replays`` and ``replays``."""
    if replay_ms <= 0:
        return cfg.replays
    return int(max(min(cfg.min_replays, cfg.replays), min(cfg.replays, round(cfg.target_ms / replay_ms))))
