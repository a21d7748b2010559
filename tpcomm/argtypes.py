"""argparse value types shared by the ``tpcomm`` subcommands (each raises ``ArgumentTypeError`` with the
value it got, which argparse turns into a usage error naming the option)."""

from __future__ import annotations

import argparse


def _int_at_least(text: str, low: int, what: str = "") -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}{what}, got {text}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def world_size(text: str) -> int:
    """A number of ranks: an integer >= 2 (one rank needs no communication)."""
    return _int_at_least(text, 2, " (ranks)")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    v = _float(text)
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return v


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    v = _float(text)
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return v


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _ints_at_least(text: str, low: int, what: str = "") -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < low for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {low}{what}, got {text!r}")
    return tuple(dict.fromkeys(vals))  # a value given twice counts once


def int_list(text: str) -> tuple[int, ...]:
    """``"1,16,64"`` -> ``(1, 16, 64)``; every value >= 1; repeats dropped."""
    return _ints_at_least(text, 1)


def world_list(text: str) -> tuple[int, ...]:
    """``"2,4"`` -> ``(2, 4)``: numbers of ranks, each >= 2; repeats dropped."""
    return _ints_at_least(text, 2, " (ranks)")


def choice_list(allowed) -> callable:
    """An argparse type: comma-separated names, each one of ``allowed``; repeats dropped."""
    def parse(text: str) -> tuple[str, ...]:
        vals = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [v for v in vals if v not in allowed]
        if not vals or bad:
            raise argparse.ArgumentTypeError(f"expected comma-separated names from {', '.join(allowed)}, "
                                             f"got {text!r}")
        return tuple(dict.fromkeys(vals))  # a name given twice counts once
    return parse
