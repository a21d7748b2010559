"""The command line's arguments (tpcomm/arguments.py): a bad value is a usage error naming the option; the
console script's front (tpcomm_cli.py) parses without importing torch; the choices agree with the
package's."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpcomm import __version__, arguments as argtypes
from tpcomm.arguments import build_parser as _build_parser

ROOT = Path(__file__).resolve().parents[2]


def build_parser():
    return _build_parser(__version__)


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
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tpcomm {__version__}"


def test_lists_drop_repeats_and_world_lists_need_two_ranks(capsys):
    from tpcomm.arguments import choice_list, int_list, world_list

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


@pytest.mark.parametrize("argv,words", [
    (["demo", "--speculative", "3"], "apply with --model only"),
    (["demo", "--kv-heads", "2"], "apply with --model only"),
    (["demo", "--model", "llama", "--speculative", "3"], "--speculative applies with --model minimax_m2 only"),
])
def test_demo_model_options_need_their_model(argv, words, capsys):
    """The model demo's head and speculative options are usage errors where they do not apply."""
    from tpcomm.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err, err


@pytest.mark.parametrize("model,options,words", [
    ("minimax_m2", ["--heads", "6", "--kv-heads", "3"], "--kv-heads 3 is not divisible by the world size 2 nor"),
    ("llama", ["--kv-heads", "1"], "--kv-heads 1 is not divisible by the world size 2"),
    ("minimax_m2", ["--heads", "6", "--kv-heads", "4"],
     "--heads 6 (given, or the default for 2 ranks) is not divisible by --kv-heads 4"),
])
def test_demo_refuses_heads_it_cannot_shard(model, options, words, capsys):
    """Heads the sharding cannot split are refused before any rank starts (exit 2, naming the option);
    MiniMax-M2 takes fewer key-value heads than ranks where they divide the world size."""
    pytest.importorskip("transformers")
    from tpcomm.cli import main

    assert main(["demo", "--model", model, "--world", "2", "--device", "cpu", *options]) == 2
    out = capsys.readouterr().out
    assert words in out, out


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


FRONT = """
import sys, time
t0 = time.perf_counter()
import tpcomm_cli
try:
    tpcomm_cli.main(sys.argv[1:])
except SystemExit as e:
    print("EXIT", e.code, "torch" in sys.modules, "tpcomm" in sys.modules, f"{time.perf_counter() - t0:.2f}")
"""


@pytest.mark.parametrize("argv,code", [(["--help"], 0), (["--version"], 0), (["demo", "--world", "0"], 2),
                                       (["soak", "--bogus"], 2), ([], 2)],
                         ids=["help", "version", "bad_value", "bad_option", "no_command"])
def test_the_console_script_parses_before_importing_torch(argv, code):
    """``tpcomm --help``, ``--version`` and a usage error end in the front (``tpcomm_cli``) without importing
    torch or the tpcomm package: a fraction of a second instead of the seconds torch's import takes."""
    proc = subprocess.run([sys.executable, "-c", FRONT, *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("EXIT")]
    assert line, proc.stdout + proc.stderr
    _, got, torch_imported, tpcomm_imported, seconds = line[0].split()
    assert int(got) == code and torch_imported == "False" and tpcomm_imported == "False", (line, proc.stderr)


def test_the_console_script_runs_a_command():
    """A valid command goes on to ``tpcomm.cli.run``: ``tpcomm bench --estimate`` prints the sweep's time."""
    proc = subprocess.run([sys.executable, "-c", "import tpcomm_cli, sys; sys.exit(tpcomm_cli.main())", "bench",
                           "--estimate", "--quick", "--world", "2"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "Estimated device time" in proc.stdout, proc.stdout


def test_the_parser_offers_the_packages_choices():
    """The parser's choices (stdlib only, so it cannot import them) are the package's own."""
    from tpcomm.bench import config as bench_config
    from tpcomm.bench.contenders import NAMES
    from tpcomm.tune import config as tune_config

    assert argtypes.BENCH_OPS == tuple(bench_config.OPS)
    assert argtypes.BENCH_MODES == bench_config.MODES
    assert argtypes.DTYPE_NAMES == bench_config.DTYPE_NAMES == tune_config.DTYPE_NAMES
    assert argtypes.BENCH_CONTENDERS == NAMES
    assert argtypes.TUNE_OPS == tuple(tune_config.OPS)


def test_the_parser_imports_nothing_of_tpcomm():
    """tpcomm/arguments.py imports the standard library only (the front loads it without the package)."""
    import ast

    tree = ast.parse((ROOT / "tpcomm" / "arguments.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] if n.module else "." for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.level == 0}
    relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0]
    assert not relative and imported <= {"__future__", "argparse"}, (imported, relative)
