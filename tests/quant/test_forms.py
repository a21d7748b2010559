"""The table of quant forms (``tpcomm/quant/forms.py``): each form's outputs have the documented shapes,
dtypes and strides, its kernel view carries its epilogue's constexpr, and its fallback fill (plain
torch) writes the bytes and scales of its standalone op (Triton; under the interpreter on CPU).
"""

import pytest
import torch

import tpcomm  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA)
from tpcomm.kernels import epilogue
from tpcomm.quant import FP4_BLOCKS, GROUP_MODES, QUANT_FORMS, QUANT_MODES, fp8_outputs

_DEV = "cuda" if torch.cuda.is_available() else "cpu"
T, H = 5, 128
#: The forms' epilogue constexprs, as the kernels number them.
EPILOGUES = {"fp8_per_token": epilogue.QUANT_PER_TOKEN, "fp8_per_group": epilogue.QUANT_PER_GROUP,
             "fp8_per_group_ue8m0": epilogue.QUANT_PER_GROUP_UE8M0, "fp8_static": epilogue.QUANT_STATIC,
             "mxfp4": epilogue.QUANT_MXFP4, "nvfp4": epilogue.QUANT_NVFP4}
#: Per form: (q's shape and dtype, the scales' shape, dtype and strides) of a (T, H) bf16 call with the
#: defaults (group size 128, row-major scales); static FP8 returns its input scale.
LAYOUTS = {"fp8_per_token": (((T, H), torch.float8_e4m3fn), ((T, 1), torch.float32, (1, 1))),
           "fp8_per_group": (((T, H), torch.float8_e4m3fn), ((T, 1), torch.float32, (1, 1))),
           "fp8_per_group_ue8m0": (((T, H), torch.float8_e4m3fn), ((T, 1), torch.float32, (1, 1))),
           "fp8_static": (((T, H), torch.float8_e4m3fn), ((1,), torch.float32, (1,))),
           "mxfp4": (((T, H // 2), torch.uint8), ((T, H // 32), torch.uint8, (H // 32, 1))),
           "nvfp4": (((T, H // 2), torch.uint8), ((T, H // 16), torch.float8_e4m3fn, (H // 16, 1)))}


def test_the_table_names_every_form_once():
    assert QUANT_MODES == tuple(EPILOGUES)
    assert GROUP_MODES == ("fp8_per_group", "fp8_per_group_ue8m0")
    assert FP4_BLOCKS == {"mxfp4": (32, torch.uint8), "nvfp4": (16, torch.float8_e4m3fn)}
    assert all(QUANT_FORMS[name].name == name for name in QUANT_MODES)


def _scale(quant):
    return torch.full((1,), 0.25, dtype=torch.float32, device=_DEV) if quant in ("fp8_static", "nvfp4") else None


@pytest.mark.parametrize("quant", QUANT_MODES)
def test_outputs_and_kernel_view(quant):
    x = torch.randn(T, H, device=_DEV).to(torch.bfloat16)
    outs = fp8_outputs("op", x, quant, torch.float8_e4m3fn, 128, False, scale=_scale(quant))
    (q_shape, q_dtype), (s_shape, s_dtype, s_strides) = LAYOUTS[quant]
    assert (tuple(outs.q_fp8.shape), outs.q_fp8.dtype) == (q_shape, q_dtype)
    assert (tuple(outs.scales_view.shape), outs.scales_view.dtype, outs.scales_view.stride()) == \
        (s_shape, s_dtype, s_strides)
    assert outs.launch_args(x.device, False).mode == EPILOGUES[quant].value


def _standalone(quant, x, scale):
    """The form's standalone op on ``x``: ``(q, scales)`` (static FP8: its input scale)."""
    op = QUANT_FORMS[quant].standalone
    if quant == "fp8_per_token":
        return op(x)
    if quant in GROUP_MODES:
        return op(x, 128, ue8m0=quant.endswith("ue8m0"))
    if quant == "fp8_static":
        return op(x, scale), scale
    return op(x, scale) if quant == "nvfp4" else op(x)


@pytest.mark.parametrize("quant", QUANT_MODES)
def test_the_fallback_fill_writes_the_standalone_ops_bytes(quant):
    x = (torch.randn(T, H, device=_DEV) * 3).to(torch.bfloat16)
    x[1, :40] = 0  # a zero group and block: scale 1 (FP8), the zero scale (FP4)
    scale = _scale(quant)
    outs = fp8_outputs("op", x, quant, torch.float8_e4m3fn, 128, False, scale=scale)
    outs.fill_from(x)
    q, scales = _standalone(quant, x, scale)
    for what, got, want in (("q", outs.q_fp8, q), ("scales", outs.scales_view, scales)):
        got, want = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
        differ = (got != want).nonzero().tolist()
        assert not differ, f"{quant} {what}: {len(differ)} bytes differ, first at {differ[0]}"
