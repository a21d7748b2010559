"""The CLI's value types (tpcomm/argtypes.py): a bad value is a usage error naming the option."""

import argparse

import pytest

from tpcomm import argtypes
from tpcomm.cli import build_parser


@pytest.mark.parametrize("fn,good,bad", [
    (argtypes.positive_int, ("1", "64"), ("0", "-3", "1.5", "x")),
    (argtypes.world_size, ("2", "8"), ("1", "0", "two")),
    (argtypes.positive_float, ("0.5", "10"), ("0", "-1", "inf", "nan", "x")),
    (argtypes.non_negative_float, ("0", "2.5"), ("-1", "inf", "x")),
])
def test_values(fn, good, bad):
    for text in good:
        fn(text)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)


@pytest.mark.parametrize("argv,option", [
    (["soak", "--world", "1"], "--world"), (["demo", "--world", "0"], "--world"),
    (["soak", "--timeout", "0"], "--timeout"), (["soak", "--max-delay", "-1"], "--max-delay"),
    (["bench", "--replays", "0"], "--replays"),
])
def test_bad_option_is_a_usage_error(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and option in capsys.readouterr().err


def test_version(capsys):
    from tpcomm import __version__

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tpcomm {__version__}"
