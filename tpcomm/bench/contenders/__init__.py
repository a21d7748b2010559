"""Every contender of ``tpcomm bench``, in column order (tpcomm first; reference rows last).

| name | library | ops |
|---|---|---|
| tpcomm | tpcomm | fused, fused_fp8, all_reduce, all_gather, reduce_scatter |
| tpcomm_unfused | tpcomm: fused bf16 call + standalone quant kernel | fused_fp8 |
| nccl | NCCL (+ torch epilogue) | fused, fused_fp8, all_reduce, all_gather, reduce_scatter |
| symm_one_shot, symm_two_shot | torch symm_mem (+ torch epilogue) | fused, fused_fp8, all_reduce |
| symm_all_gather, symm_reduce_scatter | torch symm_mem | all_gather / reduce_scatter |
| fi_trtllm_oneshot, fi_trtllm_twoshot | FlashInfer (TensorRT-LLM fusion) | fused, fused_fp8, all_reduce |
| fi_vllm | FlashInfer (vLLM custom AR, + torch epilogue) | fused, fused_fp8, all_reduce |
| torch_epilogue | torch, no communication (reference) | fused, fused_fp8 |
| copy_ce, copy_sm | peer copy (reference for % of copy bandwidth) | copy |
"""

from __future__ import annotations

from .base import Bound, Contender, NotApplicable, Slots
from .copy import CopyEngine, CopySM
from .flashinfer_impl import TrtllmOneShot, TrtllmTwoShot, VllmCustomAllReduce
from .nccl import Nccl
from .symm import SymmAllGather, SymmOneShot, SymmReduceScatter, SymmTwoShot
from .torch_epilogue import TorchAddRMSNorm
from .tpcomm_impl import Tpcomm, TpcommUnfused

ALL = (Tpcomm, TpcommUnfused, Nccl, SymmOneShot, SymmTwoShot, SymmAllGather, SymmReduceScatter, TrtllmOneShot,
       TrtllmTwoShot, VllmCustomAllReduce, TorchAddRMSNorm, CopyEngine, CopySM)
NAMES = tuple(c.name for c in ALL)
LABELS = {c.name: c.label for c in ALL}


def make(names: tuple[str, ...] | None = None) -> list[Contender]:
    """New contenders, in column order; ``names`` keeps only those (``tpcomm`` and the peer copies are
    always kept: the table is about tpcomm, and % of copy bandwidth needs a copy).

    Raises:
        ValueError: an unknown name.
    """
    if names is not None:
        bad = [n for n in names if n not in NAMES]
        if bad:
            raise ValueError(f"contenders: unknown {bad}; expected some of {', '.join(NAMES)}")
    keep = None if names is None else set(names) | {"tpcomm", "copy_ce", "copy_sm"}
    return [c() for c in ALL if keep is None or c.name in keep]


__all__ = ["ALL", "NAMES", "LABELS", "Bound", "Contender", "NotApplicable", "Slots", "make"]
