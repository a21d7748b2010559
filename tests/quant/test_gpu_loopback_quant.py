"""Every quantised output form of the fused op on ONE GPU, ranks as loopback communicators.

Marked ``gpu``; needs one CUDA GPU. For each algorithm, each form's bytes and scales equal the
standalone op (``tpcomm.quant``) applied to the call's own unquantised ``out`` (asked for with
``emit_unquantized``) bit for bit on every rank, its ``out`` and ``residual_out`` equal the plain fused
call's, and a second call (the call cache's replay) gives the same bits. Numerics of each form (zero,
subnormal, saturating, NaN and Inf blocks) are the CPU suite's (``tests/quant/test_fused_fp8.py``,
``tests/quant/test_quant_formats.py``).

    python -m pytest -q -m gpu tests/quant/test_gpu_loopback_quant.py
"""

import zlib

import pytest
import torch

from tests.quant.ranks import fp4_quant, standalone_quant
from tests.support.numerics import bits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: (quant, options): every form; the FP4 forms with linear and swizzled scales.
FORMS = [("fp8_per_token", {}), ("fp8_per_group", {"group_size": 128}),
         ("fp8_per_group", {"group_size": 128, "column_major_scales": True}),
         ("fp8_per_group_ue8m0", {"group_size": 128}), ("fp8_static", {}),
         ("mxfp4", {}), ("mxfp4", {"swizzled_scales": True}),
         ("nvfp4", {}), ("nvfp4", {"swizzled_scales": True})]


def _bytes(t):
    """The bytes of ``t``'s elements in row-major order (any dtype, any strides)."""
    return t.contiguous().view(torch.uint8)


def _form_id(form):
    quant, kw = form
    return quant + "".join(f"-{k}" for k in kw if k != "group_size")


@pytest.fixture(scope="module")
def ranks():
    from tpcomm.loopback import close_group, loopback_group

    group = loopback_group(2, max_bytes=8 << 20, timeout_s=20.0)
    yield group
    close_group(group)


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
@pytest.mark.parametrize("algo", ["lamport", "one_shot", "two_shot"])
def test_each_form_equals_the_standalone_op_on_out(ranks, algo, form):
    from tpcomm.loopback import run_ranks

    quant, kw = form
    T, H = 67, 4096  # 67 rows: the swizzled layouts pad T to 128
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{algo} {_form_id(form)}".encode()))
    xs = [(torch.randn(T, H, device="cuda", generator=g) * 4).to(torch.bfloat16) for _ in ranks]
    xs[0][3, 7] = 300.0  # a dominant element: its group or block saturates
    res = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    for x in xs:  # row 5: zero input and residual, a zero row after the norm (zero blocks, scale rules)
        x[5] = 0.0
    res[5] = 0.0
    w = (1 + 0.5 * torch.randn(H, device="cuda", generator=g)).to(torch.bfloat16)
    scale = {"fp8_static": torch.tensor([0.02], device="cuda"),
             "nvfp4": torch.tensor([500.0], device="cuda")}.get(quant)
    extra = dict(kw, scale=scale) if scale is not None else kw

    def plain(rank):
        with rank.use_algorithm(algo):
            return rank.fused_add_rmsnorm(xs[rank.rank], res, w, 1e-6)

    def quantised(rank):
        with rank.use_algorithm(algo):
            return rank.fused_add_rmsnorm(xs[rank.rank], res, w, 1e-6, quant=quant, emit_unquantized=True, **extra)

    want = run_ranks(ranks, plain)
    for call in range(2):  # the first call records, the second replays
        got = run_ranks(ranks, quantised)
        torch.cuda.synchronize()
        for r in range(len(ranks)):
            where = f"{algo} {_form_id(form)}, call {call}, rank {r}"
            q, scales, ro, out = got[r]
            assert torch.equal(bits(out), bits(want[r][0])) and torch.equal(bits(ro), bits(want[r][1])), \
                f"{where}: out or residual_out differ from the plain call"
            if quant.startswith("fp8"):
                sq, ss = standalone_quant(out, quant, torch.float8_e4m3fn, kw.get("group_size", 128),
                                          kw.get("column_major_scales", False), scale)
                assert scales.stride() == ss.stride(), f"{where}: scale strides {scales.stride()} vs {ss.stride()}"
            else:
                sq, ss = fp4_quant(out, quant, kw.get("swizzled_scales", False), scale, standalone=True)
                scales = scales.view(torch.uint8)
            assert torch.equal(q.view(torch.uint8), sq.view(torch.uint8)), f"{where}: bytes differ"
            assert torch.equal(_bytes(scales), _bytes(ss)), f"{where}: scales differ"
    for rank in ranks:
        rank.check()
