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


def test_lists_drop_repeats_and_world_lists_need_two_ranks(capsys):
    from tpcomm.argtypes import choice_list, int_list, world_list

    assert int_list("2,2,16") == (2, 16) and choice_list(("graph", "eager"))("graph,graph") == ("graph",)
    assert world_list("2,4,2") == (2, 4)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "--world", "1"])
    assert e.value.code == 2 and "--world" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "soak", "bench", "tune"])
@pytest.mark.parametrize("variable,value", [("TPCOMM_ALGO", "bogus"), ("TPCOMM_TIMEOUT_S", "abc"),
                                            ("TPCOMM_DISPATCH_TABLE", "/nonexistent/table.json"),
                                            ("TPCOMM_PDL", "yes")])
def test_a_bad_environment_variable_is_one_line_before_any_rank_starts(command, variable, value, monkeypatch,
                                                                        capsys):
    """A bad ``TPCOMM_*`` value ends a command that starts ranks with exit 2 and one line naming it, instead
    of a traceback from every rank (``tpcomm check`` reports it as INVALID)."""
    from tpcomm.cli import main
    monkeypatch.setenv(variable, value)
    assert main([command]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tpcomm {command}: {variable}=") and len(err.strip().splitlines()) == 1, err


def test_empty_environment_variables_count_as_unset(monkeypatch):
    from tpcomm.env import read_env
    monkeypatch.setenv("TPCOMM_ALGO", "")
    monkeypatch.setenv("TPCOMM_TIMEOUT_S", "")
    cfg = read_env()
    assert cfg.algo == "auto" and cfg.timeout_s == 30.0


@pytest.mark.parametrize("value,expected", [(None, True), ("", True), ("1", True), (" 0 ", False)])
def test_tpcomm_pdl(value, expected, monkeypatch):
    """``TPCOMM_PDL``: on unless 0."""
    from tpcomm.env import read_env
    if value is None:
        monkeypatch.delenv("TPCOMM_PDL", raising=False)
    else:
        monkeypatch.setenv("TPCOMM_PDL", value)
    assert read_env().pdl is expected


def test_a_communicator_dropped_without_close_leaks_no_descriptor(pool2):
    """A CPU workspace's memfd is closed when the workspace is collected, close() or not."""
    from tests.host import ranks
    opened = pool2.run(ranks.descriptors_after_dropped_communicators, 10)
    for r, (before, after) in enumerate(opened):
        assert after <= before + 2, f"rank {r}: {before} descriptors before, {after} after 10 dropped communicators"


def test_a_cpu_workspace_never_launches_with_pdl():
    """Asked for PDL, a CPU (interpreter) workspace still launches without it: the interpreter has no
    ``griddepcontrol``."""
    import torch

    from tpcomm.workspace import Workspace, pdl_supported
    assert not pdl_supported(torch.device("cpu"))
    assert not pdl_supported(torch.device("cuda", 0))  # the interpreter is on: decided before any CUDA query
    ws = Workspace.__new__(Workspace)
    ws._lay_out(0, 2, torch.device("cpu"), 1 << 16, 4, 1.0, 0, pdl=True)
    assert ws.launch_options() == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("timeout_s", [1e-12, 1e-10])
def test_a_sub_nanosecond_timeout_still_waits(timeout_s):
    """A timeout below 1 ns is 1 ns in the kernels, never 0 (which the kernels read as "an earlier wait
    failed", and which would skip every wait without recording an error)."""
    import torch

    from tpcomm.workspace import Workspace
    ws = Workspace.__new__(Workspace)
    ws._lay_out(0, 2, torch.device("cpu"), 1 << 16, 4, timeout_s, 0, pdl=False)
    assert ws.timeout == 1


@pytest.mark.parametrize("kwargs,error", [(dict(world_size=1), ValueError), (dict(timeout_s=0), ValueError),
                                          (dict(timeout_s="1"), TypeError), (dict(max_bytes=0), ValueError),
                                          (dict(max_bytes=1.5), TypeError)])
def test_loopback_group_checks_its_arguments_before_looking_for_a_gpu(kwargs, error):
    from tpcomm.loopback import loopback_group
    args = dict(world_size=2) | kwargs
    with pytest.raises(error):
        loopback_group(**args)


@pytest.mark.parametrize("model", ["llama", "gemma"])
def test_demo_refuses_quick_with_model(model, capsys):
    """``--quick`` shortens the op sweep only; with ``--model`` it is a usage error, not ignored."""
    from tpcomm.cli import main

    assert main(["demo", "--model", model, "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--quick applies without --model only" in err and "--steps" in err, err


def test_version_matches_the_changelog_and_the_package_metadata():
    """``tpcomm --version``, the changelog's latest release and pyproject's version are one number."""
    import re
    from pathlib import Path

    from tpcomm import __version__

    root = Path(__file__).resolve().parents[2]
    releases = re.findall(r"^## \[?(\d+\.\d+\.\d+)\]?", (root / "docs" / "changelog.md").read_text(), re.M)
    assert releases and releases[0] == __version__, f"changelog's latest release {releases[:1]}, tpcomm {__version__}"
    project = re.search(r'^version = "([^"]+)"', (root / "pyproject.toml").read_text(), re.M)
    assert project and project.group(1) == __version__, f"pyproject says {project and project.group(1)}"
