"""``examples/tp_compile.py``: its rank body on two CPU ranks (the torchrun launch aside) rewrites every site
of a random Llama sharded by transformers and stays within the example's tolerance of eager; its checker
fails a difference beyond it; bad arguments and a launch without torchrun are refused."""

import dataclasses
import os
import sys

import pytest

from tests.inductor import ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import tp_compile  # noqa: E402


def test_example_rewrites_every_site(pool2, tmp_path):
    cfg = tp_compile.Config(layers=1, dtype="fp32")
    tp_compile.save_random_model(cfg, str(tmp_path))
    for r, got in enumerate(pool2.run(ranks.example_case, dataclasses.asdict(cfg), str(tmp_path), timeout_s=300)):
        assert got["sites"] == 3 and got["report"].count("  fused ") == 3, f"rank {r}:\n{got['report']}"
        assert got["difference"] <= tp_compile.tolerance(cfg), f"rank {r}: {got['difference']}"


def test_tolerance_fails_a_wrong_result():
    """The tolerance is far below what a wrong site gives (a residual dropped changes logits by ~1)."""
    for dtype in tp_compile.DTYPES:
        assert tp_compile.tolerance(tp_compile.Config(dtype=dtype)) < 0.05


@pytest.mark.parametrize("argv,message", [(["--layers", "0"], "--layers and --tokens must be >= 1"),
                                          (["--model", "/nonexistent"], "not a directory"),
                                          (["--dtype", "fp8"], "invalid choice")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        tp_compile.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_without_torchrun_it_says_so(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="run it with torchrun"):
        tp_compile.main([])
