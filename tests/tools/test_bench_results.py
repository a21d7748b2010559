"""The results file of ``tpcomm bench`` (``tpcomm/bench/results.py``): a run's rows carry its machine,
commit and versions; the tables rendered from the file are the ones the run printed; runs are chosen by
id, date or commit; a damaged file is refused with its line number."""

import json

import pytest

from tests.tools.test_bench_report import _doc
from tpcomm.bench import results
from tpcomm.bench.report import format_report
from tpcomm.cli import main as cli_main


def _loopback_doc():
    rows = [{"library": lib, "op": "fused", "hidden": 6144, "tokens": t, "us": us, "checked": True}
            for lib, t, us in (("tpcomm", 1, 3.5), ("trtllm", 1, 3.9), ("tpcomm", 16, 4.0), ("trtllm", 16, 5.0))]
    return {"world": 2, "torch": "2.11", "triton": "3.6", "flashinfer": "0.6", "commit": "abc1234",
            "device": "NVIDIA H200", "rows": rows, "notes": []}


def test_a_sweep_renders_as_it_was_printed(tmp_path):
    doc = _doc()
    path = str(tmp_path / "results.jsonl")
    rows = results.sweep_rows(doc, date="2026-12-01", commit="abc1234")
    assert {r["machine"] for r in rows} == {"H200 x 2"} and {r["commit"] for r in rows} == {"abc1234"}
    assert all(r["torch"] == "x" and r["triton"] == "y" and r["nccl"] == "z" for r in rows)
    results.append(rows, path)
    text = results.render(results.load(path))
    assert "H200 x 2, commit abc1234, 2026-12-01" in text
    # every table line of the run's own report, FAIL and n/a cells included
    for line in format_report(dict(doc, unavailable={})).splitlines():
        if line.startswith("|"):
            assert line in text, line


def test_a_loopback_run_gives_the_ratio_table(tmp_path):
    path = str(tmp_path / "results.jsonl")
    results.append(results.loopback_rows(_loopback_doc(), date="2026-12-02"), path)
    text = results.render(results.load(path))
    assert "NVIDIA H200 x 1 (2 loopback ranks), commit abc1234" in text
    assert "| 6144     | fused | 1        | 3.50        | 3.90         | 0.90               |" in text
    assert "| 6144     | fused | 16       | 4.00        | 5.00         | 0.80               |" in text


def test_runs_are_chosen_by_id_date_or_commit(tmp_path):
    path = str(tmp_path / "results.jsonl")
    results.append(results.loopback_rows(_loopback_doc(), date="2026-12-02"), path)
    results.append(results.sweep_rows(_doc(), date="2026-12-03", commit="def5678"), path)
    rows = results.load(path)
    assert len(results.runs(rows)) == 2
    assert "commit def5678" in results.render(rows)                      # the latest
    assert "loopback ranks" in results.render(rows, "abc1234")            # by commit
    assert "loopback ranks" in results.render(rows, "2026-12-02")         # by date
    with pytest.raises(ValueError, match="matches 0 runs"):
        results.render(rows, "nothing")
    with pytest.raises(ValueError, match="no runs"):
        results.render([])


def test_a_damaged_file_names_its_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"run": "a", "date": "d"}) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"results.jsonl:3: not JSON"):
        results.load(str(path))
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r":1: not a results row"):
        results.load(str(path))


def test_the_commands_add_and_render(tmp_path, capsys):
    doc_path, path = tmp_path / "run.json", str(tmp_path / "out" / "results.jsonl")
    doc_path.write_text(json.dumps(_loopback_doc()))
    assert results.main(["add", str(doc_path), "--date", "2026-12-02", "--results", path]) == 0
    assert cli_main(["bench", "--render", path]) == 0
    assert "tpcomm / TRT-LLM" in capsys.readouterr().out
    assert cli_main(["bench", "--render", path, "--run", "nothing"]) == 2
    assert results.main(["render", str(tmp_path / "missing.jsonl")]) == 2
