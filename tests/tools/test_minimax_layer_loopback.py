"""``benchmarks/minimax_layer_loopback.py`` before its GPU run: ``--dry-run`` runs the same MiniMax-M2 layer,
its three variants and its checks on 4 CPU ranks (each key-value head on 2 ranks: ``kv_replicas``) and
writes the JSON; the table prints timed rows with the speed-up and the collectives' share."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "minimax_layer_loopback.py"


def _module():
    spec = importlib.util.spec_from_file_location("minimax_layer_loopback", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_checks_every_collective_on_cpu_ranks(tmp_path):
    out = tmp_path / "layer.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--worlds", "4", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["world"], r["tokens"]) for r in rows] == [(4, 1), (4, 3)], rows
    assert all(r["checked"] and r["kernels"] and r["local_ran"] and r["kv_replicas"] == 2 for r in rows), rows
    assert data["config"]["hidden"] == 256 and data["device"].startswith("cpu"), data["config"]


def test_the_table_shows_the_speed_up_and_the_collectives_share():
    mod = _module()
    row = dict(world=8, tokens=16, kv_replicas=1, checked=True, fused_us=120.0, unfused_us=150.0, local_us=100.0)
    line = mod.table([row]).splitlines()[2]
    assert "| 1.25x" in line and "| 20.0 " in line and "| 50.0 " in line, line
    assert mod.Config().hidden == 3072 and (mod.Config().heads, mod.Config().kv_heads) == (48, 8)
    assert (mod.Config().experts, mod.Config().topk, mod.Config().worlds) == (256, 8, (2, 4, 8))
