"""From measured times to the two thresholds of a :class:`tpcomm.dispatch.Crossover` (pure, no GPU).

The rule (docs/tuning.md):

* **Beating.** Algorithm ``a`` *beats* ``b`` at a size when it is faster by more than the margin:
  ``t_a < t_b - max(margin_us, margin_rel * t_b)``. Anything closer is a tie. The times are already
  robust statistics (the median over replays of the slowest rank); the margin keeps a difference of a
  few tenths of a µs, which is run-to-run noise at decode sizes (about ±1 µs between runs on 2 H200s,
  less within one), from moving a threshold.
* **Ties go to the algorithm that owns that end of the range**, so noise where two curves lie on top of
  each other cannot split a range in two:
* ``lamport_max_bytes``: walking up from the smallest size, Lamport is kept while no other algorithm
  beats it; the threshold is the last size kept (contiguous from the smallest size). 0 (Lamport off)
  when another algorithm beats it at the smallest size. Lamport is timed only up to
  ``LAMPORT_MAX_BYTES``, so the walk also stops there.
* ``two_shot_min_bytes``: walking down from the largest size, two-shot is kept while one-shot does not
  beat it; among the sizes kept, the threshold is the smallest one from which two-shot beats one-shot
  at that size (ties below it go to one-shot, which has one step fewer). When two-shot never beats
  one-shot in that range: :data:`NEVER`. Lamport is left out of this comparison: below
  ``lamport_max_bytes`` the dispatch takes Lamport first anyway, and a table is also used by 32-bit
  inputs, which have no Lamport.

A size where an algorithm was not measured (``None``) is skipped in comparisons with it. Measurements that
contradict the contiguous ranges (Lamport beating every other algorithm again above its range, two-shot
beating one-shot below its range) are reported in ``notes``: they suggest noise or an odd machine, and a
second run tells which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..dispatch import LAMPORT_MAX_BYTES

#: ``two_shot_min_bytes`` when two-shot never wins: above any message (and still a plain JSON integer).
NEVER = 1 << 62


@dataclass(frozen=True)
class Margin:
    """The tie margin: ``a`` beats ``b`` only when ``t_a < t_b - max(abs_us, rel * t_b)``.

    Attributes:
        rel: relative part (default 2 %).
        abs_us: absolute part in µs (default 0.3 µs: the spread of a median at decode sizes is of this
            order; whole runs on 2 H200s differed by about ±1 µs).
    """

    rel: float = 0.02
    abs_us: float = 0.3

    def beats(self, a_us: float | None, b_us: float | None) -> bool:
        """Whether a time of ``a_us`` beats ``b_us`` (False when either is missing)."""
        if a_us is None or b_us is None:
            return False
        return a_us < b_us - max(self.abs_us, self.rel * b_us)


@dataclass
class Derived:
    """The thresholds derived for one op.

    Attributes:
        lamport_max_bytes: bytes; 0 when Lamport loses at the smallest size; None when Lamport was not
            measured at all (32-bit dtype): the caller keeps the default table's value.
        two_shot_min_bytes: bytes; :data:`NEVER` when two-shot never wins.
        notes: measurements that contradict the rule's contiguous ranges, one line each.
    """

    lamport_max_bytes: int | None
    two_shot_min_bytes: int
    notes: list = field(default_factory=list)


def format_bytes(n: int) -> str:
    """``12288`` -> ``"12 KiB"``, ``3 << 20`` -> ``"3 MiB"``, ``NEVER`` -> ``"never"``."""
    if n >= NEVER:
        return "never"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.3g} {unit}" if v != int(v) else f"{int(v)} {unit}"
    return f"{n} B"


def derive(sizes: list[int], times: dict[str, list[float | None]], margin: Margin = Margin(),
           lamport_cap: int = LAMPORT_MAX_BYTES) -> Derived:
    """The crossovers of one op from its times (the rule of the module docstring).

    Args:
        sizes: message bytes per rank, strictly ascending.
        times: µs per call at each size for ``"lamport"``, ``"one_shot"`` and ``"two_shot"`` (a list as
            long as ``sizes``; ``None`` where not measured). A missing key is an algorithm not measured.
        margin: the tie margin.
        lamport_cap: Lamport is not considered above this many bytes (the dispatch never uses it there).
    Returns:
        :class:`Derived`.
    Raises:
        ValueError: ``sizes`` is empty or not strictly ascending, a list's length differs from
            ``sizes``', or ``times`` has an unknown algorithm.
    """
    if not sizes or any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"derive: sizes must be non-empty and strictly ascending, got {sizes}")
    for algo, ts in times.items():
        if algo not in ("lamport", "one_shot", "two_shot"):
            raise ValueError(f"derive: unknown algorithm {algo!r} in times")
        if len(ts) != len(sizes):
            raise ValueError(f"derive: times[{algo!r}] has {len(ts)} values for {len(sizes)} sizes")
    none = [None] * len(sizes)
    lam = [t if n <= lamport_cap else None for n, t in zip(sizes, times.get("lamport", none))]
    one, two = times.get("one_shot", none), times.get("two_shot", none)
    notes: list[str] = []

    # Lamport: contiguous from the smallest size while nothing beats it.
    lamport_max: int | None
    if all(t is None for t in lam):
        lamport_max = None
    else:
        lamport_max, stop = 0, None
        for i, n in enumerate(sizes):
            others = [t for t in (one[i], two[i]) if t is not None]
            if lam[i] is None or any(margin.beats(t, lam[i]) for t in others):
                stop = i
                break
            lamport_max = n
        if stop is not None:
            for i in range(stop + 1, len(sizes)):
                others = [t for t in (one[i], two[i]) if t is not None]
                if lam[i] is not None and others and all(margin.beats(lam[i], t) for t in others):
                    notes.append(f"Lamport beats the others again at {format_bytes(sizes[i])} after losing at "
                                 f"{format_bytes(sizes[stop])}: kept only up to {format_bytes(lamport_max)} "
                                 "(noise? run again)")
                    break

    # Two-shot: contiguous from the largest size while one-shot does not beat it; the threshold is the
    # smallest size of that range where two-shot beats one-shot.
    both = [i for i in range(len(sizes)) if one[i] is not None and two[i] is not None]
    two_min, low = NEVER, len(sizes)
    for i in reversed(both):
        if margin.beats(one[i], two[i]):
            break
        low = i
        if margin.beats(two[i], one[i]):
            two_min = sizes[i]
    if two_min != NEVER:
        early = [i for i in both if i < low and margin.beats(two[i], one[i])]
        if early:
            notes.append(f"two-shot beats one-shot at {', '.join(format_bytes(sizes[i]) for i in early)} but not at "
                         f"every size above: kept from {format_bytes(two_min)} (noise? run again)")
    elif any(margin.beats(two[i], one[i]) for i in both):
        wins = [sizes[i] for i in both if margin.beats(two[i], one[i])]
        notes.append(f"two-shot beats one-shot at {', '.join(map(format_bytes, wins))} but loses at a larger size: "
                     "not used (noise? run again)")
    return Derived(lamport_max, two_min, notes)


def winner(times: dict[str, float | None]) -> str | None:
    """The fastest algorithm at one size (raw medians, no margin), or None when nothing was timed."""
    timed = {a: t for a, t in times.items() if t is not None}
    return min(timed, key=timed.get) if timed else None
