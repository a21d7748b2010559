"""The CPU path's interpreted launches (``tpcomm.kernels.interpreted``): device-function calls inside a
launch patch the language once, not once per call, and the kernel's result is unchanged."""
# tpcomm first: on CPU it turns Triton's interpreter on before triton is imported
# isort: skip_file

import pytest
import torch

import tpcomm  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, before triton is imported)
import triton
import triton.language as tl

from tpcomm.env import interpreter_enabled

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="the interpreter's launches only")


@triton.jit
def _twice(v):
    return v * 2


@triton.jit
def _calls_helpers(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    v = tl.load(x_ptr + offs)
    for _ in tl.static_range(10):
        v = _twice(v) - v  # ten device-function calls: v unchanged
    tl.store(out_ptr + offs, v + 1)


def test_a_launch_patches_the_language_once(monkeypatch):
    from triton.runtime import interpreter as interp

    from tpcomm.kernels import interpreted

    assert interpreted.install() and getattr(interp._patch_lang, "_tpcomm", False)
    walks = []
    builtin = interp._patch_builtin
    monkeypatch.setattr(interp, "_patch_builtin", lambda *a, **k: (walks.append(a[0]), builtin(*a, **k))[1])
    x = torch.arange(16, dtype=torch.float32)
    out = torch.empty_like(x)
    _calls_helpers[(1,)](x, out, N=16)
    assert torch.equal(out, x + 1)
    per_launch = len(walks)
    walks.clear()
    _calls_helpers[(3,)](x, out, N=16)  # three programs: still one walk of each module
    assert len(walks) == per_launch and 0 < per_launch <= 4, \
        f"{per_launch} module walks for one launch, {len(walks)} for three programs"
    assert tl.load is not None and not getattr(tl.load, "__module__", "").startswith("triton.runtime.interpreter")
