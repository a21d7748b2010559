"""tpcomm: tensor-parallel communication for LLM inference (custom all-reduce fused with residual add
+ RMSNorm, in Triton), on the GPUs of one node or, under Triton's interpreter, on CPU ranks.

On a machine without CUDA, importing tpcomm sets ``TRITON_INTERPRET=1`` (unless already set) before any
kernel is defined, so the same kernels run on the CPU. Triton must not be imported before that, and the
variable must keep the value the kernels were defined with (``env.interpreter_problem``): otherwise
communicators on CPU ranks fall back to ``torch.distributed`` and the local CPU kernels (the standalone
quantisers, ``moe_finalize``) raise, each saying why (importing tpcomm after Triton also warns).
"""

import os as _os
import sys as _sys

import torch as _torch

from . import env as _env

_env.CUDA_AVAILABLE = _torch.cuda.is_available()
if not _env.CUDA_AVAILABLE and "TRITON_INTERPRET" not in _os.environ:
    _os.environ["TRITON_INTERPRET"] = "1"
    # Too late for Triton's own @jit library if Triton is already imported: say so at the first kernel call
    _env.TRITON_IMPORTED_FIRST = "triton" in _sys.modules
    if _env.TRITON_IMPORTED_FIRST:
        import warnings as _warnings

        # the results stay exact (every call falls back to torch.distributed), but only repr(comm) would say so
        _warnings.warn(f"tpcomm: {_env.interpreter_problem()}; until then every Communicator falls back to "
                       "torch.distributed and the standalone quantisers raise", RuntimeWarning, stacklevel=2)
_env.KERNELS_INTERPRETED = _env.interpreter_enabled()  # the mode the kernels imported below are defined in

from .collectives.moe_finalize import moe_finalize, moe_finalize_reference  # noqa: E402
from .communicator import Communicator  # noqa: E402
from .errors import PeerAbortedError, PeerMismatchError, PeerTimeoutError, SetupTimeoutError, TpcommError  # noqa: E402
from .quant import (  # noqa: E402
    mxfp4_quant,
    nvfp4_quant,
    pack_ue8m0_scales,
    per_group_quant_fp8,
    per_token_quant_fp8,
    static_quant_fp8,
)
from .reference import (  # noqa: E402
    add_rmsnorm_reference,
    all_reduce_reference,
    fused_add_rmsnorm_reference,
    fused_qk_rmsnorm_reference,
    per_group_quant_reference,
    per_token_quant_reference,
    reduce_in_rank_order,
)

__all__ = ["Communicator", "PeerAbortedError", "PeerMismatchError", "PeerTimeoutError", "SetupTimeoutError",
           "TpcommError", "add_rmsnorm_reference", "all_reduce_reference", "fused_add_rmsnorm_reference",
           "reduce_in_rank_order"]
__all__ += ["moe_finalize", "moe_finalize_reference", "fused_qk_rmsnorm_reference"]
__all__ += ["mxfp4_quant", "nvfp4_quant", "pack_ue8m0_scales", "per_group_quant_fp8", "per_token_quant_fp8",
            "static_quant_fp8", "per_group_quant_reference", "per_token_quant_reference"]
from .graphs import GraphCaptureError  # noqa: E402  (tpcomm.ops, the custom ops, is imported on demand)

__all__ += ["GraphCaptureError"]
from .inductor import compile, fusion_pass  # noqa: E402  (torch.compile with the fusion pass; Inductor on demand)

__all__ += ["compile", "fusion_pass"]
from .version import __version__  # noqa: E402, F401  (tpcomm.__version__)
