"""Quantised activations: the standalone quantisation ops and the quantised outputs of the fused ops.

* :mod:`tpcomm.quant.standalone`: FP8 per token, per group (float32 or UE8M0 scales) and static per
  tensor, MXFP4 and NVFP4, in Triton (``tpcomm.per_token_quant_fp8`` and its siblings);
* :mod:`tpcomm.quant.forms`: one object per ``quant=`` form of the fused ops, in one table
  (``QUANT_FORMS``): output shapes and dtypes, checks, allocation, the epilogue's constexpr, the
  standalone op and the fallback's fill;
* :mod:`tpcomm.quant.reference`: the same quantisations in plain torch (the oracle; re-exported by
  :mod:`tpcomm.reference`).

Every name is importable from ``tpcomm.quant`` itself.
"""

from .forms import (
    FP4_BLOCKS,
    FP8_DTYPES,
    GROUP_MODES,
    QUANT_FORMS,
    QUANT_MODES,
    Fp8Outputs,
    QuantForm,
    check_fp8_outputs,
    check_unquantized_call,
    fp8_outputs,
)
from .standalone import (
    DEFAULT_GROUP_SIZE,
    FP8_MAX,
    MAX_GROUP_SIZE,
    QUANT_INPUT_DTYPES,
    check_static_scale,
    mxfp4_quant,
    native_fp8,
    nvfp4_quant,
    pack_ue8m0_scales,
    per_group_quant_fp8,
    per_token_quant_fp8,
    static_quant_fp8,
)

__all__ = ["DEFAULT_GROUP_SIZE", "FP4_BLOCKS", "FP8_DTYPES", "FP8_MAX", "GROUP_MODES", "MAX_GROUP_SIZE",
           "QUANT_FORMS", "QUANT_INPUT_DTYPES", "QUANT_MODES", "Fp8Outputs", "QuantForm", "check_fp8_outputs",
           "check_static_scale", "check_unquantized_call", "fp8_outputs", "mxfp4_quant", "native_fp8",
           "nvfp4_quant", "pack_ue8m0_scales", "per_group_quant_fp8", "per_token_quant_fp8", "static_quant_fp8"]
