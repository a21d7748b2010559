"""Dispatch: a pure function from the call's shape to a plan, identical on every rank.

Inputs are only ``(op, world_size, nbytes, hidden, dtype)`` and settings every rank shares (the
environment override and the grid cap agreed at set-up), never the rank or a timing, so every rank makes
the same choice and no rank ever waits for a kernel its peer did not launch.

Algorithms of the all-reduce and the fused all-reduce + residual + RMSNorm: ``lamport`` (16-bit inputs
up to a threshold), ``one_shot``, ``two_shot`` (from a threshold up) and ``fallback``
(``torch.distributed``). All-gather runs ``push``, reduce-scatter ``two_shot`` (its first half). The
thresholds come from a :class:`CrossoverTable`: ``DEFAULT_TABLE`` (measured on 2 and 4 H200s, sources below) or
one written by ``tpcomm tune`` on the current machine.
"""

from __future__ import annotations

import functools
import json
import numbers
from dataclasses import asdict, dataclass, field

import torch

#: dtypes the kernels handle; others take the fallback (integers) or are refused.
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: Largest message (bytes per rank) sent with the Lamport kernel, and the size of its buffers.
#: Source: 2 H200s, hidden 6144 bf16, CUDA graph (docs/design.md, "Crossover defaults").
LAMPORT_MAX_BYTES = 4 << 20

#: Algorithms ``TPCOMM_ALGO`` may force for the all-reduce and the fused op.
ALGORITHMS = ("lamport", "one_shot", "two_shot")

#: Ops a plan is made for.
OPS = ("all_reduce", "fused_add_rmsnorm", "all_gather", "reduce_scatter")
#: Ops :meth:`tpcomm.Communicator.plan` answers for: :data:`OPS`, and the two fused ops planned from them
#: (:func:`plan_call`): the MoE finalize takes the fused norm's plan, the QK norm its one kernel.
PLANNED_OPS = OPS + ("fused_qk_rmsnorm", "fused_moe_finalize_add_rmsnorm")

#: Widest tile of a row held at once. 8192 float32 accumulators over 8 warps are 32 registers a thread;
#: wider rows run in several tiles with a second pass (``kernels/epilogue.reduce_norm_row``; e.g.
#: H = 16384 takes two).
MAX_BLOCK_H = 8192

#: Two-shot on rows of one tile of 4096+ elements runs 8-warp programs, this many times the grid cap
#: (:func:`row_config`); the signal pad has flags for that many (``Workspace.pad_programs``). Loopback
#: ranks take 1 (``Workspace.loopback``).
TWO_SHOT_GRID_FACTOR = 2

#: Row width of a plain all-reduce, which treats a tensor of any shape as flat rows of this many
#: elements (the result is elementwise, so the width never changes a bit).
ALL_REDUCE_ROW = 4096
#: Row widths of a plain all-reduce that runs Lamport, narrowest first (:func:`all_reduce_width`).
LAMPORT_ALL_REDUCE_ROWS = (2048, 4096, 8192)


@dataclass(frozen=True)
class RowConfig:
    """How a row of ``hidden`` elements is tiled and launched. The tile depends on ``hidden`` alone (not
    on the rank, the algorithm or the number of rows), which keeps the norm's reduction tree, and so every
    output bit, the same for every call (batch invariance, docs/numerics.md item 1); the warps and the
    grid cap also depend on the algorithm (two-shot), which changes no bit.

    Attributes:
        block_h: tile width (a power of two, >= 16).
        num_tiles: tiles per row, ``ceil(hidden / block_h)``.
        num_warps: 4 for tiles up to 1024 elements, 8 up to 2048, 16 from 4096 (docs/design.md, "Warps
            per tile"). Two-shot runs rows of one tile of 4096+ elements with
            8 warps and twice the programs (:func:`row_config`). The warps never change a bit: the
            norm's sum is taken by pairs whatever the layout (``kernels/epilogue.tree_sum``), and the
            amax is a max.
        max_programs: the grid cap of this launch: the one agreed by all ranks at set-up (twice it for
            two-shot's rows of one tile of 4096+ elements).
    """

    block_h: int
    num_tiles: int
    num_warps: int
    max_programs: int

    def grid(self, n_rows: int) -> int:
        """Programs for ``n_rows`` rows: one per row up to the cap (at least one)."""
        return max(1, min(n_rows, self.max_programs))


@functools.lru_cache(maxsize=4096)
def row_config(hidden: int, max_programs: int, two_shot: bool = False,
               factor: int = TWO_SHOT_GRID_FACTOR) -> RowConfig:
    """The :class:`RowConfig` for rows of ``hidden`` elements; ``max_programs`` is the grid cap agreed at
    set-up (``Workspace.max_programs``).

    With ``two_shot``, rows of one tile of 4096 elements or more (hidden 2049-8192, and the flat
    all-reduce's rows) run 8 warps instead of 16, and up to ``factor`` times ``max_programs`` programs
    (twice by default: as many warps in flight; ``Workspace.pad_programs`` has their flags; loopback
    ranks take 1). Rows of two tiles or more keep 16 warps (with 8, ptxas spills). Lamport and one-shot
    keep 16 warps. Measurements: docs/design.md, "Two-shot: 8 warps and twice the programs".
    """
    if hidden < 1:
        raise ValueError(f"row_config: hidden must be >= 1, got {hidden}")
    block_h = min(max(16, 1 << (hidden - 1).bit_length()), MAX_BLOCK_H)
    num_tiles = -(-hidden // block_h)
    num_warps = 4 if block_h <= 1024 else 8 if block_h <= 2048 else 16
    if two_shot and num_warps == 16 and num_tiles == 1:
        return RowConfig(block_h, num_tiles, 8, factor * max_programs)
    return RowConfig(block_h, num_tiles, num_warps, max_programs)


@dataclass(frozen=True)
class Crossover:
    """Thresholds, in bytes of one rank's message, of one op at one world size.

    Attributes:
        lamport_max_bytes: 16-bit messages up to this size run Lamport (capped by the Lamport buffers,
            ``LAMPORT_MAX_BYTES``); 0 disables Lamport.
        two_shot_min_bytes: messages of at least this size run two-shot; smaller ones one-shot.
        source: where the numbers come from (a measurement in ``docs/`` or ``tpcomm tune``'s run).
    """

    lamport_max_bytes: int
    two_shot_min_bytes: int
    source: str = ""


@dataclass
class CrossoverTable:
    """Crossovers per op and world size; world sizes without an entry use the nearest smaller one (or the
    smallest entry when all are larger).

    ``tpcomm tune`` writes one (``to_json``) and a :class:`~tpcomm.Communicator` loads it
    (``from_json``; rank 0's file is used by every rank).
    """

    entries: dict = field(default_factory=dict)  # {op: {world_size: Crossover}}
    device: str = ""

    def lookup(self, op: str, world_size: int) -> Crossover:
        """The :class:`Crossover` of ``op`` at ``world_size`` (or the nearest smaller world size)."""
        return self._by_world(op)[self.entry_world(op, world_size)]

    def entry_world(self, op: str, world_size: int) -> int:
        """The world size of the entry :meth:`lookup` uses for ``op`` at ``world_size``."""
        by_world = self._by_world(op)
        below = [w for w in by_world if w <= world_size]
        return max(below) if below else min(by_world)

    def _by_world(self, op: str) -> dict:
        return self.entries.get(op) or DEFAULT_TABLE.entries[op]

    def to_json(self) -> str:
        return json.dumps({"device": self.device,
                           "entries": {op: {str(w): asdict(c) for w, c in ws.items()}
                                       for op, ws in self.entries.items()}}, indent=1)

    @staticmethod
    def from_json(text: str) -> "CrossoverTable":
        """Parse a table written by :meth:`to_json`.

        Raises:
            ValueError: the text is not such a table (unknown op, missing or negative thresholds).
        """
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict) or not isinstance(raw.get("entries"), dict) or not all(
                    isinstance(ws, dict) and all(isinstance(c, dict) for c in ws.values())
                    for ws in raw["entries"].values()):
                raise ValueError("expected {'entries': {op: {world_size: {thresholds}}}}")
            entries = {}
            for op, ws in raw["entries"].items():
                if op not in OPS:
                    raise ValueError(f"unknown op {op!r}")
                entries[op] = {}
                for w, c in ws.items():
                    lam, two = c["lamport_max_bytes"], c["two_shot_min_bytes"]
                    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lam, two)):
                        raise ValueError(f"bad entry {op}/{w}: thresholds must be integers (bytes), got {c}")
                    cross = Crossover(lam, two, str(c.get("source", "")))
                    if cross.lamport_max_bytes < 0 or cross.two_shot_min_bytes < 0 or int(w) < 2:
                        raise ValueError(f"bad entry {op}/{w}: {c}")
                    entries[op][int(w)] = cross
            return CrossoverTable(entries, str(raw.get("device", "")))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a tpcomm crossover table: {e}") from None


#: Largest crossover-table file read (``tpcomm tune`` writes a few KiB).
MAX_TABLE_BYTES = 1 << 20


def load_table(path: str) -> CrossoverTable:
    """Read a table written by ``tpcomm tune``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is larger than ``MAX_TABLE_BYTES`` (a path like ``/dev/zero`` never ends) or not a
            crossover table.
    """
    with open(path) as f:
        text = f.read(MAX_TABLE_BYTES + 1)
    if len(text) > MAX_TABLE_BYTES:
        raise ValueError(f"larger than {MAX_TABLE_BYTES} bytes: not a crossover table")
    return CrossoverTable.from_json(text)


#: Defaults, measured on 2 H200s (NV18) and on 4, bf16, CUDA graphs, by ``tpcomm tune --quick`` (the
#: fused op's Lamport threshold at 4 ranks with 4 loopback ranks on one H200): each threshold is set where
#: two algorithms tie or the next one wins (docs/design.md, "Crossover defaults", gives each
#: measurement). Three ranks use the 2-rank entries, five to eight the 4-rank ones.
_TUNED = "2xH200 tpcomm tune, docs/data/run-2xH200-final/tune.log"
_TUNED_W2 = "2xH200 tpcomm tune, docs/data/run-2xH200-5/tune_w2.log"
_TUNED_W4 = "4xH200 tpcomm tune, docs/data/run-4xH200-5/first-call/tune_w4.log"
_FUSED_W4 = "4 loopback ranks on 1 H200 (Lamport) and 4xH200 tpcomm tune (two-shot), docs/design.md"
DEFAULT_TABLE = CrossoverTable({
    "fused_add_rmsnorm": {2: Crossover(4 << 20, 4 << 20, _TUNED_W2), 4: Crossover(1 << 20, 3 << 20, _FUSED_W4)},
    "all_reduce": {2: Crossover(4 << 20, 16 << 20, _TUNED), 4: Crossover(1 << 20, 2 << 20, _TUNED_W4)},
    "all_gather": {2: Crossover(0, 0, "one algorithm (push)")},
    "reduce_scatter": {2: Crossover(0, 0, "one algorithm (two-shot's scatter)")},
}, device="2x and 4x NVIDIA H200 (defaults)")


@dataclass(frozen=True)
class Plan:
    """What a call runs.

    Attributes:
        algorithm: ``"lamport"``, ``"one_shot"``, ``"two_shot"``, ``"push"`` (all-gather) or
            ``"fallback"`` (``torch.distributed``).
        reason: why, for ``tpcomm check`` and error messages.
        width: elements per row of the launches (:func:`plan_call`): the row width of the fused op and
            of reduce-scatter, :func:`all_reduce_width` of the message for the all-reduce (the
            algorithm's) and the all-gather; 0 for a plan that launches no row kernel (the fallback,
            ``push`` of an integer sum or of narrow reduce-scatter rows) and from :func:`choose`.
    """

    algorithm: str
    reason: str
    width: int = 0

    def skips_out(self, quantised_only: bool) -> bool:
        """Whether a fused call that asks for quantised outputs only (``quantised_only``: a quant form
        without ``emit_unquantized``, with a residual) leaves ``out`` unwritten under this plan: one-shot
        and Lamport stage nothing in ``out``, so their kernels take ``residual_out`` as their out pointer
        (for its dtype); two-shot stages its shares there."""
        return quantised_only and self.algorithm in OUT_FREE_ALGORITHMS

    @property
    def prologue(self) -> bool:
        """Whether the row kernels of this plan make this rank's rows in their prologue, for the fused
        MoE finalize (:mod:`tpcomm.kernels.moe`): one-shot and Lamport read each row of ``x`` once;
        two-shot takes the finalize's output, made first by the standalone kernel."""
        return self.algorithm in PROLOGUE_ALGORITHMS


#: Algorithms whose fused kernels stage nothing in ``out`` (:meth:`Plan.skips_out`).
OUT_FREE_ALGORITHMS = ("one_shot", "lamport")
#: Algorithms whose row kernels take the MoE finalize as their prologue (:attr:`Plan.prologue`).
PROLOGUE_ALGORITHMS = ("one_shot", "lamport")


def check_plan_args(op, nbytes, hidden, dtype) -> None:
    """The arguments of a plan request (:meth:`tpcomm.Communicator.plan`'s Raises section).

    Raises:
        ValueError: ``op`` is not one of ``PLANNED_OPS``, or ``nbytes`` or ``hidden`` is negative.
        TypeError: ``nbytes`` or ``hidden`` is not an int, or ``dtype`` not a ``torch.dtype``.
    """
    if op not in PLANNED_OPS:
        raise ValueError(f"plan: op must be one of {PLANNED_OPS}, got {op!r}")
    for name, value in (("nbytes", nbytes), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"plan: {name} must be an int, got {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"plan: {name} must be >= 0, got {value}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"plan: dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")


def choose(op: str, world_size: int, nbytes: int, hidden: int, dtype: torch.dtype,
           forced: str = "auto", kernels_available: bool = True,
           table: CrossoverTable | None = None) -> Plan:
    """Pick the algorithm for one call.

    Args:
        op: one of ``OPS``.
        world_size: ranks in the group.
        nbytes: bytes of one rank's input.
        hidden: elements per row (the flat width for a plain all-reduce).
        dtype: the input dtype.
        forced: ``TPCOMM_ALGO`` (``auto``, ``lamport``, ``one_shot``, ``two_shot``, ``fallback``). A
            forced ``lamport`` on a 32-bit input runs ``one_shot`` (the only one-step kernel for it).
            All-gather and reduce-scatter have one kernel each and honour only ``fallback``; the
            all-gather copies any dtype, the reductions need one of ``KERNEL_DTYPES``.
        kernels_available: False when the group cannot use the workspace (set-up decided it on every
            rank together).
        table: the crossovers (default ``DEFAULT_TABLE``).
    """
    if op not in OPS:
        raise ValueError(f"choose: op must be one of {OPS}, got {op!r}")
    if not kernels_available:
        return Plan("fallback", "no workspace for this group")
    if world_size < 2:
        return Plan("fallback", "a group of one rank needs no communication")
    if forced == "fallback":
        return Plan("fallback", "forced (TPCOMM_ALGO or use_algorithm): fallback")
    if op == "all_gather":
        return Plan("push", "the only all-gather kernel (a copy: any dtype, moved as bytes)")
    if dtype not in KERNEL_DTYPES:
        return Plan("fallback", f"no reduction kernel for dtype {dtype}")
    if op == "reduce_scatter":
        return Plan("two_shot", "the only reduce-scatter kernel (two-shot's first half)")
    lamport_ok = dtype in (torch.bfloat16, torch.float16)
    if forced in ("one_shot", "two_shot"):
        return Plan(forced, f"forced (TPCOMM_ALGO or use_algorithm): {forced}")
    if forced == "lamport":
        return Plan("lamport", "forced (TPCOMM_ALGO or use_algorithm): lamport") if lamport_ok else \
            Plan("one_shot", "lamport forced (TPCOMM_ALGO or use_algorithm), but Lamport needs 16 bits")
    table = table or DEFAULT_TABLE
    cross = table.lookup(op, world_size)
    source = cross.source or "a crossover table that names no source"
    entry = table.entry_world(op, world_size)
    if entry != world_size:
        source += f"; the table's {entry}-rank entry, none measured at {world_size}"
    lamport_max = min(cross.lamport_max_bytes, LAMPORT_MAX_BYTES)
    size = f"{_size(nbytes)} a rank"
    if lamport_ok and nbytes <= lamport_max:
        return Plan("lamport", f"16-bit message of {size}, at most Lamport's {_size(lamport_max)} ({source})")
    if nbytes >= cross.two_shot_min_bytes:
        return Plan("two_shot", f"message of {size}, at least two-shot's {_size(cross.two_shot_min_bytes)} "
                                f"({source})")
    if not lamport_ok:
        why = "Lamport takes 16-bit data only"
    elif lamport_max == 0:
        why = "Lamport off in this table"
    else:
        why = f"above Lamport's {_size(lamport_max)}"
    return Plan("one_shot", f"message of {size}, under two-shot's {_size(cross.two_shot_min_bytes)}; {why} "
                            f"({source})")


def _size(nbytes: int) -> str:
    """``nbytes`` for a reason: in MiB or KiB where it is a whole number of them, else in bytes."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} bytes"


#: Two-shot and all-gather index the whole tensor (two-shot's shares span it): larger ones use one-shot
#: chunks (all-reduce) or the fallback (all-gather, reduce-scatter).
MAX_INDEXED_ELEMS = (1 << 31) - 1
#: Rows narrower than this many elements make reduce-scatter's kernel mostly idle lanes: an all-gather
#: through the kernel and the rank-order sum on this rank are used instead.
MIN_SCATTER_ROW = 16


def is_integer(dtype: torch.dtype) -> bool:
    """Integer dtypes (their sums are exact int64 sums of gathered inputs)."""
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def all_reduce_width(n: int, element_size: int, workspace=None, algorithm: str = "") -> int:
    """Row width of a plain all-reduce (or all-gather) of ``n`` elements: ``ALL_REDUCE_ROW``, or less so
    that one row fits a slot of a small ``workspace`` (then the call runs in chunks instead of falling
    back). The result is elementwise, so the width never changes a bit.

    An all-reduce whose plan is ``algorithm="lamport"`` takes the narrowest of ``LAMPORT_ALL_REDUCE_ROWS``
    that gives every row a program of its own (the ``workspace``'s ``max_programs``): at one token a
    row spread over several small programs, each thread on one 16-byte vector; when none does, the
    one of the two widest that puts the fewest rows on a program, the narrower on a tie (docs/design.md,
    "Lamport all-reduce rows")."""
    width = max(1, min(n, ALL_REDUCE_ROW))
    if algorithm == "lamport" and workspace is not None:
        def rows_per_program(w: int) -> int:
            return -(-(-(-n // w)) // workspace.max_programs)  # ceil(ceil(n / w) / max_programs)

        fits = [w for w in LAMPORT_ALL_REDUCE_ROWS if rows_per_program(w) == 1]
        width = min(n, fits[0] if fits else min(LAMPORT_ALL_REDUCE_ROWS[1:], key=rows_per_program))
    if workspace is not None:
        width = min(width, max(16, workspace.half_slot_elems(element_size) // 16 * 16))
    return width


def plan_call(op: str, world_size: int, nbytes: int, hidden: int, dtype: torch.dtype, forced: str = "auto",
              table: CrossoverTable | None = None, workspace=None) -> Plan:
    """The plan of one call of a communicator: :func:`choose`, then the limits of its ``workspace``
    (None: the group has none, so every call falls back).

    Beyond :func:`choose`:

    * integer ``all_reduce`` / ``reduce_scatter`` with a workspace: ``push`` (every rank's input through
      the all-gather kernel, summed here in int64);
    * ``reduce_scatter`` of rows narrower than ``MIN_SCATTER_ROW``: ``push`` too (gathered, then the
      rank-order sum here), or the fallback when the gathered tensor would reach 2**31 elements;
    * two-shot that cannot carry the message (a row larger than half a slot, or 2**31 elements or more):
      one-shot for the all-reduce and the fused op, the fallback for reduce-scatter;
    * an all-gather whose output reaches 2**31 elements (bytes, for dtypes moved as bytes), or a row
      larger than a slot: the fallback.

    The two fused ops planned from these: ``fused_moe_finalize_add_rmsnorm`` takes the plan of
    ``fused_add_rmsnorm`` of its ``(T, H)`` output (the finalize in the kernel's prologue under one-shot
    and Lamport, the standalone finalize kernel first under two-shot: :attr:`Plan.prologue`);
    ``fused_qk_rmsnorm`` has one kernel, a Lamport exchange of each token's float32 sums of squares
    (:func:`qk_norm_plan`).

    Args:
        op, world_size, nbytes, dtype, forced, table: as :func:`choose`; ``op`` one of ``PLANNED_OPS``.
        hidden: the row width of ``fused_add_rmsnorm``, ``fused_moe_finalize_add_rmsnorm`` and
            ``reduce_scatter``; for ``all_reduce`` and ``all_gather`` it is ignored (the width is
            :func:`all_reduce_width` of the message); for ``fused_qk_rmsnorm``, ``Hq + Hk``.
        workspace: the communicator's :class:`~tpcomm.workspace.Workspace` (its slot sizes), or None.
    Returns:
        The :class:`Plan`, with the row width its launches take (``Plan.width``).
    """
    if op == "fused_qk_rmsnorm":
        return qk_norm_plan(world_size, nbytes, hidden, dtype, forced, workspace)
    if op == "fused_moe_finalize_add_rmsnorm":
        plan = plan_call("fused_add_rmsnorm", world_size, nbytes, hidden, dtype, forced, table, workspace)
        how = ("the finalize in the fused kernel's prologue" if plan.prologue else
               "the standalone finalize, then the fused norm's fallback" if plan.algorithm == "fallback" else
               "the standalone finalize kernel, then the fused norm's kernel")
        return Plan(plan.algorithm, f"{how}; {plan.reason}", plan.width)
    ws = workspace
    if op in ("all_reduce", "reduce_scatter") and is_integer(dtype) and ws is not None and forced != "fallback":
        return Plan("push", "integer sum: every rank's input through the all-gather kernel, added here in int64 "
                            "(exact)")
    es = dtype.itemsize
    if op in ("all_reduce", "all_gather"):
        hidden = all_reduce_width(max(1, nbytes // es), es, ws)
    plan = choose(op, world_size, nbytes, hidden, dtype, forced, kernels_available=ws is not None, table=table)
    if plan.algorithm == "fallback":
        return plan
    numel = nbytes // es
    if op == "all_gather":
        moved = numel if dtype in KERNEL_DTYPES else nbytes
        if world_size * moved > MAX_INDEXED_ELEMS:
            return Plan("fallback", "output of 2**31 elements (bytes, for dtypes moved as bytes) or more")
    if op == "reduce_scatter" and hidden < MIN_SCATTER_ROW:
        if numel * world_size <= MAX_INDEXED_ELEMS:
            return Plan("push", f"rows of {hidden} elements (under {MIN_SCATTER_ROW}): every rank's input "
                                "through the all-gather kernel, summed here in rank order")
        return Plan("fallback", f"rows of {hidden} elements")
    if plan.algorithm == "two_shot" and (ws.share_rows_per_launch(hidden, es) < 1 or numel > MAX_INDEXED_ELEMS):
        if op == "reduce_scatter":
            why = (f"a row of {hidden} elements exceeds half of max_bytes"
                   if ws.share_rows_per_launch(hidden, es) < 1 else "2**31 elements or more")
            return Plan("fallback", why)
        plan = Plan("one_shot", "two-shot cannot carry this message; " + plan.reason)
    if ws.rows_per_launch(hidden, es) < 1:
        return Plan("fallback", f"a row of {hidden} elements exceeds max_bytes")
    if op == "all_reduce":  # the algorithm's rows (Lamport's are narrower at few tokens)
        hidden = all_reduce_width(max(1, numel), es, ws, plan.algorithm)
    return Plan(plan.algorithm, plan.reason, hidden)


def qk_norm_plan(world_size: int, nbytes: int, hidden: int, dtype: torch.dtype, forced: str = "auto",
                 workspace=None) -> Plan:
    """The plan of ``fused_qk_rmsnorm``: its one kernel (``"lamport"``: each rank's float32 sums of squares
    of a token, 8 bytes, through the Lamport buffers), in launches of ``lamport_slot_bytes / 8`` tokens; or
    the fallback (an all-reduce of the ``(T, 2)`` partial sums) where the group has no workspace, has one
    rank or ``fallback`` is forced. ``nbytes`` is one rank's ``q`` and ``k`` together and ``hidden`` their
    widths' sum ``Hq + Hk``, so ``T = nbytes / (hidden * dtype size)``; a forced ``one_shot`` or
    ``two_shot`` runs the kernel too."""
    if workspace is None:
        return Plan("fallback", "no workspace for this group")
    if world_size < 2:
        return Plan("fallback", "a group of one rank needs no communication")
    if forced == "fallback":
        return Plan("fallback", "forced (TPCOMM_ALGO or use_algorithm): fallback")
    tokens = nbytes // (hidden * dtype.itemsize) if hidden else 0
    per_launch = workspace.lamport_slot_bytes // 8
    launches = -(-tokens // per_launch)
    why = ("the op's one kernel: each token's float32 sums of squares (8 bytes) through the Lamport buffers, "
           f"{per_launch} tokens a launch ({tokens} tokens: {launches} launch{'es' if launches != 1 else ''})")
    if forced not in ("auto", "lamport"):
        why = f"{forced} forced, but {why}"
    return Plan("lamport", why, hidden)
