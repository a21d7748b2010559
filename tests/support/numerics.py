"""Inputs from seeds and bit-level comparisons, shared by rank bodies and test assertions.

Every rank's input comes from a seed every rank knows (``rank_input``), so any rank (or the test
process) can rebuild every rank's input and compute the expected result with the plain-torch reference.
Comparisons look at bit patterns, never at float equality: ``-0.0 == +0.0`` and ``NaN != NaN`` would hide
exactly what the numerics contract pins down.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
#: Bound of the small-integer inputs: sums of 3 ranks plus a residual stay below 2**8, where bf16 (8
#: significant bits) still holds every integer, so the exact answer is known without any rounding.
SMALL_INT = 8


def _gen(seed: int, rank: int, role: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * seed + 101 * rank + role)


def rank_input(seed: int, rank: int, shape, dtype, kind: str = "randn") -> torch.Tensor:
    """Rank ``rank``'s input ``x`` for case ``seed``: normal values, or integers in [-8, 8] (``int``)."""
    g = _gen(seed, rank, 1)
    if kind == "int":
        return torch.randint(-SMALL_INT, SMALL_INT + 1, tuple(shape), generator=g).to(dtype)
    return torch.randn(tuple(shape), generator=g).to(dtype)


def all_inputs(seed: int, world_size: int, shape, dtype, kind: str = "randn") -> list[torch.Tensor]:
    """Every rank's input, in rank order."""
    return [rank_input(seed, r, shape, dtype, kind) for r in range(world_size)]


def residual_input(seed: int, shape, dtype, kind: str = "randn") -> torch.Tensor:
    """The residual of case ``seed`` (the same on every rank, as in tensor parallelism)."""
    g = _gen(seed, 0, 2)
    if kind == "int":
        return torch.randint(-SMALL_INT, SMALL_INT + 1, tuple(shape), generator=g).to(dtype)
    return torch.randn(tuple(shape), generator=g).to(dtype)


def weight_input(seed: int, hidden: int, dtype, gemma: bool = False) -> torch.Tensor:
    """Norm weight of case ``seed``: around 1 (around 0 for Gemma's ``1 + w``), both signs present."""
    g = _gen(seed, 0, 3)
    w = 0.5 * torch.randn(hidden, generator=g)
    return (w if gemma else 1.0 + w).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor, as signed integers of the same width."""
    return t.contiguous().view(_BITS[t.dtype])


def ordered(t: torch.Tensor) -> torch.Tensor:
    """int64 keys that grow with the value and step by one per representable float (+0 and -0 -> 0)."""
    i = bits(t).to(torch.int64)
    nbits = 8 * t.element_size()
    mag = i & ((1 << (nbits - 1)) - 1)
    return torch.where(i < 0, -mag, mag)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Representable floats between ``a`` and ``b``, elementwise (NaNs excluded: check them apart)."""
    return (ordered(a) - ordered(b)).abs()


def _where(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor, limit: int = 5) -> str:
    idx = mask.reshape(-1).nonzero().reshape(-1)[:limit].tolist()
    fa, fb = a.reshape(-1), b.reshape(-1)
    shown = ", ".join(f"[{i}] {fa[i].item()!r} vs {fb[i].item()!r}" for i in idx)
    return f"{int(mask.sum())} of {mask.numel()} elements differ, first: {shown}"


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit-for-bit equality (shape, dtype and every bit, signs of zeros and NaN payloads included)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    diff = bits(actual) != bits(expected)
    assert not diff.any(), f"{what}: not bit-identical: {_where(diff, actual, expected)}"


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit equality except that any NaN matches any NaN (payloads are not part of the contract)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    an, en = actual.isnan(), expected.isnan()
    assert torch.equal(an, en), f"{what}: NaN positions differ: {_where(an != en, actual, expected)}"
    diff = (bits(actual) != bits(expected)) & ~an
    assert not diff.any(), f"{what}: not bit-identical: {_where(diff, actual, expected)}"


def out_ulp_tolerance(dtype: torch.dtype, hidden: int) -> int:
    """How far ``out`` may be from the reference, in units in the last place: 0.

    The reference (:func:`tpcomm.reference.add_rmsnorm_reference`) takes the sum of squares in the
    kernels' order (:func:`tpcomm.reference.sum_of_squares`, the pairwise ``epilogue.tree_sum``) and
    rounds every other step as they do, so ``out`` is bit-exact for every dtype (docs/numerics.md allows one
    ulp, for a reference that summed, or multiplied, in another order).
    """
    return 0


def assert_within_ulp(actual: torch.Tensor, expected: torch.Tensor, max_ulp: int, what: str) -> None:
    """Every element within ``max_ulp`` representable values of the reference; NaNs at the same places."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    an, en = actual.isnan(), expected.isnan()
    assert torch.equal(an, en), f"{what}: NaN positions differ: {_where(an != en, actual, expected)}"
    d = ulp_distance(actual, expected)
    far = (d > max_ulp) & ~an
    assert not far.any(), (f"{what}: more than {max_ulp} ulp from the reference (max {int(d[~an].max())}):"
                           f" {_where(far, actual, expected)}")


def assert_ranks_identical(per_rank: list[torch.Tensor], what: str) -> None:
    """Every rank's tensor has the bits of rank 0's (all ranks are checked before failing)."""
    ref = per_rank[0]
    differ = [r for r, t in enumerate(per_rank)
              if t.shape != ref.shape or t.dtype != ref.dtype or not torch.equal(bits(t), bits(ref))]
    assert not differ, f"{what}: ranks {differ} differ from rank 0"


def raised(fn) -> tuple[str, str] | None:
    """``(type name, message)`` of what ``fn()`` raised, or None (the test decides which types are right)."""
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


class Checks:
    """Collects failed assertions so one test reports every failing rank and output, not the first.

    ``check(assert_fn, *args)`` runs an ``assert_*`` helper and records its AssertionError;
    ``check.that(cond, msg)`` records ``msg`` when ``cond`` is false; ``check.done()`` fails with all.
    """

    def __init__(self):
        self.failures: list[str] = []

    def __call__(self, assert_fn, *args, **kwargs) -> None:
        try:
            assert_fn(*args, **kwargs)
        except AssertionError as e:
            self.failures.append(str(e))

    def that(self, cond, msg: str) -> None:
        if not cond:
            self.failures.append(msg)

    def done(self) -> None:
        assert not self.failures, f"{len(self.failures)} check(s) failed:\n" + "\n".join(self.failures)


#: Algorithms the kernels offer, each with the dtypes it runs (a forced algorithm that cannot take a
#: dtype runs another one, so those pairs would only repeat another case).
def kernel_algorithms() -> dict[str, tuple]:
    from tpcomm import dispatch

    algos = getattr(dispatch, "ALGORITHMS", ("one_shot",))
    sixteen = (torch.bfloat16, torch.float16)
    return {a: (sixteen if a == "lamport" else FLOAT_DTYPES) for a in algos}


def algo_dtype_pairs() -> list[tuple[str, torch.dtype]]:
    """Every (forced algorithm, dtype) pair the kernels run."""
    return [(a, d) for a, ds in kernel_algorithms().items() for d in ds]


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")
