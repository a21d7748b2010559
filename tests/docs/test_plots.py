"""The performance page's plots (``benchmarks/plots.py``): the script draws every figure from the committed
JSON in docs/data/, the page shows each one, and the committed PNGs are the script's figures. Skipped
without matplotlib (the ``test`` or ``bench`` extra)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


def _plots():
    spec = importlib.util.spec_from_file_location("perf_plots", ROOT / "benchmarks" / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_draws_every_figure_from_the_committed_data(tmp_path):
    plots = _plots()
    assert plots.main(["--out", str(tmp_path)]) == 0
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(drawn) == len(plots.FIGURES), drawn
    for name in drawn:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, name
    committed = sorted(p.name for p in (ROOT / "docs" / "img").glob("perf-*.png"))
    assert committed == drawn, f"docs/img holds {committed}; the script draws {drawn}"
    page = (ROOT / "docs" / "performance.md").read_text()
    missing = [name for name in drawn if f"img/{name}" not in page]
    assert not missing, f"docs/performance.md does not show {missing}"
