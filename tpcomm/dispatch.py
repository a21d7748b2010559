"""Dispatch: a pure function from the call's shape to a plan, identical on every rank.

Inputs are only ``(op, world_size, nbytes, hidden, dtype)`` and settings every rank shares (the
environment override and the grid cap agreed at set-up), never the rank or a timing, so every rank makes
the same choice and no rank ever waits for a kernel its peer did not launch.

Algorithms: ``lamport`` (16-bit inputs up to ``LAMPORT_MAX_BYTES``), ``one_shot`` (everything else,
chunked through the workspace) and ``fallback`` (``torch.distributed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: dtypes the kernels handle; others take the fallback (integers) or are refused.
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: Largest message (bytes per rank) sent with the Lamport kernel, and the size of its buffers.
#: Source: 2 H200s, hidden 6144 bf16, CUDA graph (docs/benchmarks.md, "Lamport against one-shot").
LAMPORT_MAX_BYTES = 4 << 20

#: Algorithms ``TPCOMM_ALGO`` may force.
ALGORITHMS = ("lamport", "one_shot")

#: Widest tile of a row held at once. 8192 float32 accumulators over 8 warps are 32 registers a thread;
#: wider rows run in several tiles with a second pass (DESIGN.md; e.g. H = 16384 takes two).
MAX_BLOCK_H = 8192

#: Row width of a plain all-reduce, which treats a tensor of any shape as flat rows of this many
#: elements (the result is elementwise, so the width never changes a bit).
ALL_REDUCE_ROW = 4096


@dataclass(frozen=True)
class RowConfig:
    """How a row of ``hidden`` elements is tiled. Depends on ``hidden`` alone (not on the rank, the
    algorithm or the number of rows), which keeps the norm's reduction tree, and so every output bit,
    the same for every call (batch invariance, DESIGN.md).

    Attributes:
        block_h: tile width (a power of two, >= 16).
        num_tiles: tiles per row, ``ceil(hidden / block_h)``.
        num_warps: 4 for tiles up to 1024 elements, 8 up to 2048, 16 from 4096. Source: 2 H200s, bf16,
            CUDA graph, fused Lamport at hidden 4096: 6.3 / 5.8 / 7.1 / 11.9 us at 1 / 16 / 64 / 256 tokens
            with 16 warps against 6.4 / 7.7 / 8.9 / 13.1 with 8 and 8.4 / 9.4 / 10.3 / 15.5 with 4; at
            hidden 6144 (tile 8192) 16 and 8 warps were within run-to-run noise
            (docs/data/dev_warps_h*_2xH200.log).
        max_programs: grid cap agreed by all ranks at set-up.
    """

    block_h: int
    num_tiles: int
    num_warps: int
    max_programs: int

    def grid(self, n_rows: int) -> int:
        """Programs for ``n_rows`` rows: one per row up to the cap (at least one)."""
        return max(1, min(n_rows, self.max_programs))


def row_config(hidden: int, max_programs: int) -> RowConfig:
    """The :class:`RowConfig` for rows of ``hidden`` elements."""
    if hidden < 1:
        raise ValueError(f"row_config: hidden must be >= 1, got {hidden}")
    block_h = min(max(16, 1 << (hidden - 1).bit_length()), MAX_BLOCK_H)
    num_tiles = -(-hidden // block_h)
    num_warps = 4 if block_h <= 1024 else 8 if block_h <= 2048 else 16
    return RowConfig(block_h, num_tiles, num_warps, max_programs)


@dataclass(frozen=True)
class Plan:
    """What a call runs.

    Attributes:
        algorithm: ``"lamport"``, ``"one_shot"`` or ``"fallback"`` (``torch.distributed``).
        reason: why, for ``tpcomm check`` and error messages.
    """

    algorithm: str
    reason: str


def choose(op: str, world_size: int, nbytes: int, hidden: int, dtype: torch.dtype,
           forced: str = "auto", kernels_available: bool = True) -> Plan:
    """Pick the algorithm for one call.

    Args:
        op: ``"all_reduce"`` or ``"fused_add_rmsnorm"``.
        world_size: ranks in the group.
        nbytes: bytes of one rank's input.
        hidden: elements per row (the flat width for a plain all-reduce).
        dtype: the input dtype.
        forced: ``TPCOMM_ALGO`` (``auto``, ``lamport``, ``one_shot``, ``fallback``). A forced
            ``lamport`` on a 32-bit input runs ``one_shot`` (the only kernel for it).
        kernels_available: False when the group cannot use the workspace (set-up decided it on every
            rank together).
    """
    if not kernels_available:
        return Plan("fallback", "no workspace for this group")
    if dtype not in KERNEL_DTYPES:
        return Plan("fallback", f"no kernel for dtype {dtype}")
    if world_size < 2:
        return Plan("fallback", "a group of one rank needs no communication")
    if forced == "fallback":
        return Plan("fallback", "TPCOMM_ALGO=fallback")
    lamport_ok = dtype in (torch.bfloat16, torch.float16)
    if forced == "one_shot":
        return Plan("one_shot", "TPCOMM_ALGO=one_shot")
    if forced == "lamport" and lamport_ok:
        return Plan("lamport", "TPCOMM_ALGO=lamport")
    if lamport_ok and nbytes <= LAMPORT_MAX_BYTES:
        return Plan("lamport", f"16-bit message of at most {LAMPORT_MAX_BYTES} bytes")
    return Plan("one_shot", "one-shot push")
