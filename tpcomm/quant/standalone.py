"""Standalone quantisation of activations (Triton): FP8 per token, per group (with float32 or UE8M0
scales) and static per tensor, MXFP4 and NVFP4, with the checks of their scales and group sizes that the
fused ops' quant forms (:mod:`tpcomm.quant.forms`) share.

The standalone ops are the unfused path of the quantised epilogues and what their bytes are checked
against; the numerics are docs/numerics.md item 4 and "Quantised output forms", written out in
:mod:`tpcomm.kernels.quant` and :mod:`tpcomm.kernels.fp4`. ``tpcomm.reference`` has the same functions
in plain torch (``per_token_quant_reference``, ``per_group_quant_reference``, ...), the oracle of the
tests.

Equivalent in torch, per row (or per group of ``group_size`` consecutive elements of a row)::

    v = x.float(); amax = v.abs().amax(-1, keepdim=True)
    scale = amax / MAX; scale[scale == 0] = 1                # MAX: 448 e4m3fn, 240 e4m3fnuz
    q = (v / scale).clamp(-MAX, MAX).to(fp8_dtype)          # NaN -> the canonical NaN byte
"""

from __future__ import annotations

import contextlib
import functools
import numbers

import torch
import triton.language as tl

from ..dispatch import row_config
from ..env import interpreter_enabled, interpreter_problem
from ..kernels import fp4 as _fp4, quant as _k

#: FP8 formats and their largest finite values (the ``MAX`` of the scale rule).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
#: Input dtypes the kernels quantise.
QUANT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Default group size: DeepSeek-V3's 1 x 128 activation blocks.
DEFAULT_GROUP_SIZE = 128
#: Largest group size: a group must fit in one tile of a row (``dispatch.MAX_BLOCK_H``).
MAX_GROUP_SIZE = 8192

_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e4m3fnuz: tl.float8e4b8}


def native_fp8(device: torch.device, fp8_dtype: torch.dtype) -> bool:
    """Whether the kernels may use the hardware float32 -> FP8 conversion (``NATIVE_FP8``) for
    ``fp8_dtype`` on ``device``: e4m3fn on NVIDIA GPUs of compute capability 8.9 or newer, outside
    the interpreter. Either choice gives the same bytes; the fused kernels pass the same value."""
    if interpreter_enabled() or device.type != "cuda" or torch.version.cuda is None:
        return False
    return fp8_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.lru_cache(maxsize=64)
def native_fp8_cached(device: torch.device, fp8_dtype: torch.dtype) -> bool:
    """:func:`native_fp8`, asked of the device once per device and format (it was a tenth of a fused
    call's host time)."""
    return native_fp8(device, fp8_dtype)


def _check(op: str, x, fp8_dtype) -> None:
    _check_x(op, x)
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"{op}: fp8_dtype={fp8_dtype}; expected torch.float8_e4m3fn or "
                         "torch.float8_e4m3fnuz")


def _check_x(op: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in QUANT_INPUT_DTYPES:
        raise TypeError(f"{op}: x has dtype {x.dtype}; expected bfloat16, float16 or float32")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (T, H), got shape {tuple(x.shape)}")
    if x.shape[1] < 1:
        raise ValueError(f"{op}: x has shape {tuple(x.shape)}; rows need at least one element (H >= 1)")
    problem = interpreter_problem()
    if problem is not None and x.device.type == "cpu":
        raise RuntimeError(f"{op}: {problem}")
    want = "cpu" if interpreter_enabled() else "cuda"
    if x.device.type != want:
        how = "Triton's CPU interpreter (TRITON_INTERPRET=1)" if want == "cpu" else "CUDA"
        raise ValueError(f"{op}: x is on {x.device}, but the kernels run on {how} in this process; "
                         f"move x to {want}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def per_token_quant_fp8(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of ``x`` to FP8 with one float32 scale per row (docs/numerics.md item 4).

    ``scale = amax / MAX`` (1 where that is 0; ``MAX`` 448 for e4m3fn, 240 for e4m3fnuz) and
    ``q = fp8(f32(x) / scale)``, the division correctly rounded, saturated to ``[-MAX, MAX]``,
    rounded to nearest-even; every NaN becomes the canonical NaN byte (0x7F e4m3fn, 0x80 e4m3fnuz),
    so a row holding a NaN has scale NaN and all bytes NaN. Dequantise with ``q.float() * scale``.
    Plain torch: :func:`tpcomm.reference.per_token_quant_reference` (same bytes).

    Args:
        x: ``(T, H)`` bfloat16, float16 or float32, on CUDA (on the CPU under the interpreter). Any
            row stride; a column stride other than 1 is copied to contiguous first. ``T`` may be 0.
        fp8_dtype: ``torch.float8_e4m3fn`` (default; NVIDIA) or ``torch.float8_e4m3fnuz`` (AMD MI300).
    Returns:
        ``(q, scales)``: ``q`` ``(T, H)`` of ``fp8_dtype``, contiguous; ``scales`` ``(T, 1)`` float32.
        Safe to capture in a CUDA graph (one launch, no host synchronisation).
    Raises:
        TypeError: ``x`` is not a tensor or has another dtype.
        ValueError: ``x`` is not 2-D or has ``H == 0``; ``fp8_dtype`` is not one of the two formats;
            ``x`` is on a device the kernels do not run on in this process.
        RuntimeError: ``x`` is on the CPU and the kernels cannot run under the interpreter in this process
            (:func:`tpcomm.env.interpreter_problem` says why; every standalone quantiser alike).
    """
    _check("per_token_quant_fp8", x, fp8_dtype)
    x = _rows(x)
    T, H = x.shape
    q = torch.empty((T, H), dtype=fp8_dtype, device=x.device)
    scales = torch.empty((T, 1), dtype=torch.float32, device=x.device)
    cfg = row_config(H, 1)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _k.launch_per_token_quant(x, q.view(torch.uint8), scales, _TL_FP8[fp8_dtype],
                                  native_fp8(x.device, fp8_dtype), cfg.block_h, cfg.num_tiles, cfg.num_warps)
    return q, scales


def per_group_quant_fp8(x: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                        fp8_dtype: torch.dtype = torch.float8_e4m3fn, column_major_scales: bool = False,
                        ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to FP8 with one float32 scale per ``group_size`` consecutive elements of a row
    (DeepSeek-V3's 1 x 128 activation quantisation; numerics of :func:`per_token_quant_fp8` applied to
    each group). With ``ue8m0`` each scale is rounded up to a power of two (the smallest that is
    ``>= amax / MAX`` and ``>= 2^-127``; 1 for a zero group) before the division, as DeepGEMM's FP8 GEMMs
    on SM100 and vLLM's ``use_ue8m0=True`` want them (docs/numerics.md, "Quantised output forms");
    :func:`pack_ue8m0_scales` packs them as those GEMMs read them.

    Args:
        x: ``(T, H)`` bfloat16, float16 or float32, as for :func:`per_token_quant_fp8`.
        group_size: elements per scale; a power of two from 1 to 8192 (a group lies within one tile
            of a row) dividing ``H``. Default 128 (DeepSeek-V3).
        fp8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e4m3fnuz``.
        column_major_scales: False (default): ``scales`` is ``(T, H // group_size)`` contiguous, scale of
            row ``t``, group ``g`` at ``scales[t, g]``. True: the layout grouped GEMMs (DeepGEMM, vLLM's
            ``column_major_scales``) read: storage is a contiguous ``(H // group_size, T)`` tensor and
            ``scales`` is its transpose view, shape ``(T, H // group_size)``, strides ``(1, T)``; the
            values are the same, ``scales.t()`` is the contiguous storage.
        ue8m0: power-of-two scales (above). Default False.
    Returns:
        ``(q, scales)``: ``q`` ``(T, H)`` of ``fp8_dtype``, contiguous; ``scales`` float32 as above.
        Safe to capture in a CUDA graph.
    Raises:
        TypeError: ``x`` is not a tensor or has another dtype; ``group_size`` is not an int; ``ue8m0`` or
            ``column_major_scales`` is not a bool.
        ValueError: as :func:`per_token_quant_fp8`; ``group_size`` is not a power of two in
            [1, 8192]; ``H`` is not a multiple of ``group_size``.
    """
    op = "per_group_quant_fp8"
    _check(op, x, fp8_dtype)
    if not isinstance(ue8m0, bool):
        raise TypeError(f"{op}: ue8m0 must be a bool, got {type(ue8m0).__name__}")
    if not isinstance(column_major_scales, bool):
        raise TypeError(f"{op}: column_major_scales must be a bool, got {type(column_major_scales).__name__}")
    group_size = group_size_int(op, group_size)
    if not 1 <= group_size <= MAX_GROUP_SIZE or group_size & (group_size - 1):
        raise ValueError(f"{op}: group_size={group_size}; expected a power of two from 1 to {MAX_GROUP_SIZE}")
    T, H = x.shape
    if H % group_size:
        raise ValueError(f"{op}: x has H={H} elements per row, not a multiple of group_size={group_size}")
    x = _rows(x)
    q = torch.empty((T, H), dtype=fp8_dtype, device=x.device)
    n_groups = H // group_size
    if column_major_scales:
        scales = torch.empty((n_groups, T), dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty((T, n_groups), dtype=torch.float32, device=x.device)
    cfg = row_config(H, 1)  # block_h is a power of two >= min(H, 8192) >= group_size
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _k.launch_per_group_quant(x, q.view(torch.uint8), scales, group_size, _TL_FP8[fp8_dtype],
                                  native_fp8(x.device, fp8_dtype), cfg.block_h, cfg.num_tiles, cfg.num_warps,
                                  ue8m0)
    return q, scales


def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                     ) -> torch.Tensor:
    """Quantise ``x`` to FP8 with one calibrated float32 scale for the whole tensor (static per-tensor
    FP8, as vLLM's FP8 checkpoints run): ``inv = f32(1 / scale)`` (correctly rounded) and
    ``q = fp8(f32(x) * inv)``, saturated to ``[-MAX, MAX]``, rounded to nearest-even, NaN as the
    canonical NaN byte (docs/numerics.md, "Static per-tensor FP8"; the product, as vLLM computes it).
    Dequantise with ``q.float() * scale``. Plain torch: :func:`tpcomm.reference.static_fp8_quant_reference`.

    Args:
        x: ``(T, H)`` bfloat16, float16 or float32, as for :func:`per_token_quant_fp8`.
        scale: float32 tensor of one element (shape ``()``, ``(1,)`` or ``(1, 1)``) on ``x``'s device,
            finite, positive and more than 2**-128 (its float32 reciprocal finite); a tensor, so a CUDA
            graph replays with its current value.
        fp8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e4m3fnuz``.
    Returns:
        ``q``: ``(T, H)`` of ``fp8_dtype``, contiguous. One launch.
    Raises:
        TypeError: ``x`` or ``scale`` is not a tensor, or has another dtype.
        ValueError: as :func:`per_token_quant_fp8`; ``scale`` has more than one element or is on another
            device; outside CUDA-graph capture, ``scale`` is not finite, not positive or at most 2**-128
            (that check reads the scale: one device synchronisation on CUDA; during a capture it is
            skipped, and such a scale gives NaN or saturated bytes).
    """
    op = "static_quant_fp8"
    _check(op, x, fp8_dtype)
    _check_one_float32(op, "scale", scale, x)
    x = _rows(x)
    T, H = x.shape
    q = torch.empty((T, H), dtype=fp8_dtype, device=x.device)
    cfg = row_config(H, 1)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _k.launch_static_quant(x, scale.reshape(1), q.view(torch.uint8), _TL_FP8[fp8_dtype],
                               native_fp8(x.device, fp8_dtype), cfg.block_h, cfg.num_tiles, cfg.num_warps)
    return q


def _check_one_float32(op: str, name: str, t, x: torch.Tensor) -> None:
    """A standalone op's scale input ``t``: a float32 tensor of one element on ``x``'s device, finite
    and positive outside CUDA-graph capture (the check reads it: one synchronisation on CUDA)."""
    check_scale_tensor(op, name, t, x)
    if not (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        check_scale_value(op, name, t, static=name == "scale")


def check_scale_tensor(op: str, name: str, t, x: torch.Tensor) -> None:
    """``t`` is a float32 tensor of one element on ``x``'s device (TypeError / ValueError naming it)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor (float32, one element), got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected torch.float32")
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} must hold one element, got shape {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}; expected the same device")


def check_scale_value(op: str, name: str, t: torch.Tensor, static: bool) -> None:
    """The value of a one-element float32 ``t`` (read: a synchronisation on CUDA): finite and positive,
    and for a static FP8 scale (``static``) one whose float32 reciprocal is finite (ValueError)."""
    value = float(t.reshape(()).item())
    if not (value > 0 and value != float("inf")):  # NaN fails both
        raise ValueError(f"{op}: {name}={value!r}; expected a finite positive float32")
    if static and bool(torch.isinf(torch.reciprocal(t.detach().reshape(()).cpu()))):
        raise ValueError(f"{op}: {name}={value!r}; its float32 reciprocal overflows (q = fp8(x * (1 / scale)) "
                         "would be NaN for zeros): expected more than 2**-128")


def _check_fp4(op: str, x, block: int, swizzled_scales) -> None:
    _check_x(op, x)
    if not isinstance(swizzled_scales, bool):
        raise TypeError(f"{op}: swizzled_scales must be a bool, got {type(swizzled_scales).__name__}")
    if x.shape[1] % block:
        raise ValueError(f"{op}: x has H={x.shape[1]} elements per row, not a multiple of the block size "
                         f"{block}")


def _fp4_scales(x: torch.Tensor, block: int, swizzled: bool, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The block scales of ``x`` (``(T, H)``): ``(T, H // block)`` row-major, or the zeroed ``(Rp, Cp)``
    128x4 buffer; and ``Cp // 4``."""
    T, H = x.shape
    C = H // block
    if not swizzled:
        return torch.empty((T, C), dtype=dtype, device=x.device), 0
    Rp, Cp = -(-T // 128) * 128, -(-C // 4) * 4
    return torch.zeros((Rp, Cp), dtype=dtype, device=x.device), Cp // 4


def mxfp4_quant(x: torch.Tensor, scale_rule: str = "floor", swizzled_scales: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to MXFP4 (OCP Microscaling v1.0): per block of 32 consecutive elements of a row,
    one E8M0 scale ``2^e`` with ``e = floor(log2(amax)) - 2`` (``scale_rule="floor"``, the spec's;
    ``"even"`` and ``"rceil"`` as other producers round), clamped to ``[-127, 127]``, and E2M1 elements
    ``x / 2^e`` rounded to nearest-even, saturating at +-6, packed two to a byte; a block holding NaN or
    Inf gets the scale byte 0xFF and zero codes (docs/numerics.md, "MXFP4"). Plain torch:
    :func:`tpcomm.reference.mxfp4_quant_reference` (same bytes); dequantise with
    :func:`tpcomm.reference.mxfp4_dequant_reference`.

    Args:
        x: ``(T, H)`` bfloat16, float16 or float32, ``H`` a multiple of 32, on CUDA (on the CPU under the
            interpreter). Any row stride; a column stride other than 1 is copied first. ``T`` may be 0.
        scale_rule: ``"floor"`` (default), ``"even"`` or ``"rceil"``.
        swizzled_scales: False (default): ``scales`` is ``(T, H // 32)`` row-major. True: the 128x4
            layout of SM100 FP4 GEMMs, a contiguous ``(ceil(T / 128) * 128, ceil(H / 128) * 4)`` uint8
            buffer, padding zero (:func:`tpcomm.reference.swizzle_128x4` of the row-major scales).
    Returns:
        ``(q, scales)``: ``q`` ``(T, H // 2)`` uint8, element ``2i`` of a row in the low nibble of byte
        ``i``; ``scales`` uint8 E8M0 bytes (``e + 127``) as above. One launch (and a fill of the
        swizzled buffer); safe to capture in a CUDA graph.
    Raises:
        TypeError: ``x`` is not a tensor or has another dtype; ``swizzled_scales`` is not a bool.
        ValueError: ``x`` is not 2-D, has ``H == 0`` or ``H`` not a multiple of 32, or is on a device
            the kernels do not run on in this process; another ``scale_rule``.
    """
    op = "mxfp4_quant"
    _check_fp4(op, x, 32, swizzled_scales)
    if scale_rule not in _fp4.MX_RULES:
        raise ValueError(f"{op}: scale_rule={scale_rule!r}; expected 'floor', 'even' or 'rceil'")
    x = _rows(x)
    T, H = x.shape
    q = torch.empty((T, H // 2), dtype=torch.uint8, device=x.device)
    scales, n_col_tiles = _fp4_scales(x, 32, swizzled_scales, torch.uint8)
    cfg = row_config(H, 1)  # block_h: a power of two >= min(H, 8192), so tiles hold whole blocks
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _fp4.launch_mxfp4_quant(x, q, scales, _fp4.MX_RULES[scale_rule], swizzled_scales, n_col_tiles,
                                cfg.block_h, cfg.num_tiles, cfg.num_warps)
    return q, scales


def nvfp4_quant(x: torch.Tensor, global_scale: torch.Tensor, swizzled_scales: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to NVFP4: per block of 16 consecutive elements of a row, the e4m3fn block scale
    ``s = e4m3(f32(amax / 6) * global_scale)`` (nearest-even, subnormals kept, at most 448) and E2M1
    elements ``x * f32(global_scale / s)`` (0 times ``x`` where ``s`` is 0), nearest-even, saturating at
    +-6, packed two to a byte; a block holding NaN or Inf gets the NaN block scale 0x7F and zero codes
    (docs/numerics.md, "NVFP4"; TensorRT-LLM's quantiser with correctly rounded divisions). Plain torch:
    :func:`tpcomm.reference.nvfp4_quant_reference` (same bytes); dequantise with
    :func:`tpcomm.reference.nvfp4_dequant_reference`.

    Args:
        x: ``(T, H)`` bfloat16, float16 or float32, ``H`` a multiple of 16, as for :func:`mxfp4_quant`.
        global_scale: float32 tensor of one element on ``x``'s device, finite and positive (TensorRT-LLM's
            ``448 * 6 / amax(tensor)``, :func:`tpcomm.reference.nvfp4_global_scale`); a tensor, so a CUDA
            graph replays with its current value.
        swizzled_scales: False (default): ``block_scales`` is ``(T, H // 16)`` row-major. True: the 128x4
            layout TensorRT-LLM and CUTLASS read, a contiguous ``(ceil(T / 128) * 128, ceil(H / 64) * 4)``
            buffer, padding zero (:func:`tpcomm.reference.swizzle_128x4` of the row-major scales).
    Returns:
        ``(q, block_scales)``: ``q`` ``(T, H // 2)`` uint8, element ``2i`` of a row in the low nibble of
        byte ``i``; ``block_scales`` ``torch.float8_e4m3fn`` as above. One launch (and a fill of the
        swizzled buffer).
    Raises:
        TypeError: ``x`` or ``global_scale`` is not a tensor or has another dtype; ``swizzled_scales`` is
            not a bool.
        ValueError: as :func:`mxfp4_quant` (``H`` a multiple of 16); ``global_scale`` has more than one
            element or is on another device; outside CUDA-graph capture, ``global_scale`` is not finite
            or not positive (that check reads it: one device synchronisation on CUDA; during a capture
            it is skipped).
    """
    op = "nvfp4_quant"
    _check_fp4(op, x, 16, swizzled_scales)
    _check_one_float32(op, "global_scale", global_scale, x)
    x = _rows(x)
    T, H = x.shape
    q = torch.empty((T, H // 2), dtype=torch.uint8, device=x.device)
    scales, n_col_tiles = _fp4_scales(x, 16, swizzled_scales, torch.float8_e4m3fn)
    cfg = row_config(H, 1)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _fp4.launch_nvfp4_quant(x, global_scale.reshape(1), q, scales.view(torch.uint8), swizzled_scales,
                                n_col_tiles, cfg.block_h, cfg.num_tiles, cfg.num_warps)
    return q, scales


def pack_ue8m0_scales(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``(T, G)`` (``per_group_quant_fp8(..., ue8m0=True)``'s) in the packed,
    MN-major, TMA-aligned int32 layout DeepGEMM's SM100 FP8 GEMMs read (docs/numerics.md, "Per-group FP8
    with UE8M0 scales"): each scale as its E8M0 byte (its float32 exponent bits: ``log2(scale) + 127``, 0xFF for
    NaN and Inf), groups ``4k .. 4k + 3`` of row ``t`` in int32 ``[t, k]`` (group ``4k + j`` in byte
    ``j``), stored column by column with ``Tp = ceil(T / 4) * 4`` int32s a column; padding bytes are zero.
    Torch operations only (no host synchronisation; safe in a CUDA graph).

    Args:
        scales: ``(T, G)`` float32, any strides, each a power of two in ``[2^-127, 2^127]``, Inf or NaN.
    Returns:
        int32 ``(T, ceil(G / 4))`` with strides ``(1, Tp)``: a view of a ``(ceil(G / 4), Tp)`` buffer.
    Raises:
        TypeError: ``scales`` is not a float32 tensor.
        ValueError: ``scales`` is not 2-D.
    """
    op = "pack_ue8m0_scales"
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise TypeError(f"{op}: scales must be a float32 tensor, got "
                        f"{getattr(scales, 'dtype', type(scales).__name__)}")
    if scales.dim() != 2:
        raise ValueError(f"{op}: scales must be 2-D (T, G), got shape {tuple(scales.shape)}")
    T, G = scales.shape
    K, Tp = -(-G // 4), -(-T // 4) * 4
    exponents = ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    padded = torch.zeros((Tp, 4 * K), dtype=torch.uint8, device=scales.device)
    padded[:T, :G] = exponents
    words = padded.view(torch.int32)  # (Tp, K): byte j of a word is group 4k + j (little-endian)
    buf = torch.empty((K, Tp), dtype=torch.int32, device=scales.device)
    buf.copy_(words.t())
    return buf.as_strided((T, K), (1, Tp))


def group_size_int(op: str, group_size) -> int:
    """``group_size`` as an int (numpy integers too); TypeError for anything else (a float, a bool),
    whatever the quant form, so that ``128.0`` is refused where ``64.0`` is."""
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise TypeError(f"{op}: group_size must be an int, got {type(group_size).__name__} {group_size!r}")
    return int(group_size)


def check_static_scale(op: str, x: torch.Tensor, scale, quant: str = "fp8_static") -> None:
    """The ``scale`` of ``quant='fp8_static'`` (or NVFP4's global scale): a float32 tensor of one element
    on ``x``'s device, and, where reading it costs no device synchronisation (a CPU tensor, outside
    tracing), finite and positive. A CUDA scale's value is not read: a non-finite or non-positive one
    gives NaN, zero or saturated bytes (as :func:`static_quant_fp8` during a graph capture).

    Raises:
        ValueError: ``scale`` is None, has more than one element, is on another device, or (CPU) is not
            finite and positive, or (static FP8) is at most 2**-128 (its reciprocal overflows).
        TypeError: ``scale`` is not a tensor or not float32.
    """
    if scale is None:
        what = ("the calibrated scale: q = fp8(out * (1 / scale))" if quant == "fp8_static"
                else "the global scale, 448 * 6 / amax as TensorRT-LLM defines it")
        raise ValueError(f"{op}: quant={quant!r} needs scale, a float32 tensor of one element ({what})")
    check_scale_tensor(op, "scale", scale, x)
    if scale.device.type == "cpu" and not torch.compiler.is_compiling() and not _is_fake(scale):
        check_scale_value(op, "scale", scale, static=quant == "fp8_static")


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)
