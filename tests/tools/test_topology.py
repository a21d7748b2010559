"""``tpcomm/topology.py`` and ``tpcomm check`` on the CPU: parsing ``nvidia-smi`` output (captured
texts), mapping ``CUDA_VISIBLE_DEVICES`` in any order to ``nvidia-smi`` indices, the report of what
a group could run, and the ``check`` command itself."""

import pytest

from tpcomm import topology
from tpcomm.cli import main as cli_main

#: ``nvidia-smi topo -m`` of a 2 x H200 machine as nvidia-smi prints it: tab-separated, the header
#: underlined with ANSI codes, NICs after the GPUs, then the multi-word affinity columns and the legend.
TOPO_2_NVLINK = (
    "\t\x1b[4mGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\tPIX\tSYS\t0-47,96-143\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tSYS\tPIX\t48-95,144-191\t1\t\tN/A\n"
    "NIC0\tPIX\tSYS\t X \tSYS\t\t\t\t\n"
    "NIC1\tSYS\tPIX\tSYS\t X \t\t\t\t\n"
    "\n"
    "Legend:\n\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
    "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node\n"
    "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n"
    "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n"
    "  PIX  = Connection traversing at most a single PCIe bridge\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n\n"
    "NIC Legend:\n\n"
    "  NIC0: mlx5_0\n"
    "  NIC1: mlx5_1\n"
)

#: A 4-GPU PCIe machine with one NVLink bridge (GPU0-GPU1), space-separated as some versions print it.
TOPO_4_PCIE = """        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      NV4     PXB     SYS     0-15    0
GPU1    NV4      X      PXB     SYS     0-15    0
GPU2    PXB     PXB      X      SYS     0-15    0
GPU3    SYS     SYS     SYS      X      16-31   1

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""

SMI_QUERY_4 = """0, GPU-aaaaaaaa-0000-0000-0000-000000000000, 00000000:18:00.0
1, GPU-bbbbbbbb-0000-0000-0000-000000000000, 00000000:2A:00.0
2, GPU-cccccccc-0000-0000-0000-000000000000, 00000000:3A:00.0
3, GPU-dddddddd-0000-0000-0000-000000000000, 00000000:5D:00.0
"""


def test_parse_two_gpu_nvlink_matrix():
    links = topology.parse_topo_matrix(TOPO_2_NVLINK)
    assert links == {(0, 1): "NV18", (1, 0): "NV18"}
    assert topology.describe_link("NV18") == "18 bonded NVLinks"


def test_parse_four_gpu_pcie_matrix():
    links = topology.parse_topo_matrix(TOPO_4_PCIE)
    assert len(links) == 12
    assert links[(0, 1)] == links[(1, 0)] == "NV4"
    assert links[(0, 2)] == "PXB" and links[(2, 3)] == "SYS" and links[(3, 0)] == "SYS"
    assert topology.describe_link("PXB").startswith("several PCIe bridges")
    assert topology.describe_link("XYZ") == "unknown"


@pytest.mark.parametrize("text", ["", "nvidia-smi: command failed\n", "Legend:\n  X = Self\n"])
def test_parse_refuses_text_without_a_matrix(text):
    with pytest.raises(ValueError, match="no GPU matrix"):
        topology.parse_topo_matrix(text)


def test_gpu_query_rows():
    rows = topology.parse_gpu_query(SMI_QUERY_4 + "\nsome warning line\n")
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["uuid"].startswith("GPU-dddd") and rows[3]["bus_id"] == "00000000:5D:00.0"


def _visible(*uuids, buses=None):
    buses = buses or [None] * len(uuids)
    return [{"uuid": u, "bus_id": b} for u, b in zip(uuids, buses)]


@pytest.mark.parametrize("cvd,visible,expected", [
    # CUDA reports UUIDs without the GPU- prefix; the order follows CUDA_VISIBLE_DEVICES
    ("3,1", _visible("dddddddd-0000-0000-0000-000000000000", "bbbbbbbb-0000-0000-0000-000000000000"), [3, 1]),
    # UUIDs unknown to CUDA (an old torch): the PCI bus ids decide
    ("2,0", _visible(None, None, buses=["0000:3a:00", "0000:18:00"]), [2, 0]),
    # neither: the variable's integers
    ("2,0", _visible(None, None), [2, 0]),
    # unset: CUDA's order is nvidia-smi's
    (None, _visible(None, None, None), [0, 1, 2]),
    # UUIDs in the variable, matched through nvidia-smi
    ("GPU-cccccccc,GPU-aaaaaaaa", _visible(None, None), [2, 0]),
])
def test_visible_gpus_map_to_nvidia_smi_indices(cvd, visible, expected):
    rows = topology.parse_gpu_query(SMI_QUERY_4)
    assert topology.map_visible_to_physical(visible, rows, cvd) == expected


def test_without_nvidia_smi_uuids_in_the_variable_stay_unknown():
    assert topology.map_visible_to_physical(_visible(None), [], "GPU-cccccccc") == [None]


def _topo(cvd, physical, peer_missing=(), links=None):
    n = len(physical)
    t = topology.Topology(cuda_visible_devices=cvd)
    t.gpus = [{"visible": k, "physical": p, "name": "NVIDIA H200", "uuid": None, "bus_id": None}
              for k, p in enumerate(physical)]
    t.peer = {(i, j): (i, j) not in peer_missing for i in range(n) for j in range(n) if i != j}
    matrix = topology.parse_topo_matrix(TOPO_4_PCIE)
    t.links = links or {(i, j): matrix[(physical[i], physical[j])] for i in range(n) for j in range(n) if i != j}
    t.link_source = "nvidia-smi topo -m"
    return t


def test_report_follows_cuda_visible_devices_order():
    """CUDA_VISIBLE_DEVICES=3,1,0: cuda:0 is GPU3, so cuda:1 <-> cuda:2 is the NVLink pair (GPU1-GPU0)."""
    lines = topology.report_lines(_topo("3,1,0", [3, 1, 0]), "cuda", 3)
    text = "\n".join(lines)
    assert "CUDA_VISIBLE_DEVICES=3,1,0" in text
    assert "cuda:0 = nvidia-smi GPU3" in text and "cuda:2 = nvidia-smi GPU0" in text
    assert "cuda:1 <-> cuda:2: peer access both ways; link NV4 (4 bonded NVLinks)" in text
    assert "cuda:0 <-> cuda:1: peer access both ways; link SYS" in text
    assert "Communicator: kernels (3 GPUs" in text


def test_report_without_peer_access_says_fallback_and_why():
    t = _topo(None, [0, 1, 2, 3], peer_missing={(0, 3), (3, 0), (2, 3)})
    text = "\n".join(topology.report_lines(t, "cuda", 4))
    assert "cuda:0 <-> cuda:3: NO peer access" in text
    assert "cuda:2 <-> cuda:3: peer access only 3->2" in text
    for algo in ("lamport", "one_shot"):
        assert f"{algo:<18} NOT available (no peer access for 0->3, 2->3, 3->0)" in text
    assert "fallback           available" in text
    assert "Communicator: fallback to torch.distributed on every rank: no peer access for 0->3" in text
    # the first three GPUs alone have peer access between every pair: kernels
    assert "Communicator: kernels" in "\n".join(topology.report_lines(t, "cuda", 3))


def test_report_of_a_single_gpu_group():
    text = "\n".join(topology.report_lines(_topo(None, [0]), "cuda", 1))
    assert "Communicator: fallback to torch.distributed on every rank: a group of one rank" in text


def test_unknown_links_when_nvidia_smi_is_missing():
    t = _topo("1,0", [None, None], links={(0, 1): "unknown", (1, 0): "unknown"})
    t.link_source = "unknown: nvidia-smi is not available or failed"
    text = "\n".join(topology.report_lines(t, "cuda", 2))
    assert "cuda:0 = nvidia-smi index unknown" in text
    assert "link unknown (unknown)" in text and "links from unknown: nvidia-smi" in text


def test_probe_on_this_machine():
    """On a machine without GPUs: no GPUs, no pairs, and a CPU group of 2 can run the kernels when
    /dev/shm is writable (it is, on every machine the CPU suite runs on)."""
    import torch

    t = topology.probe()
    assert len(t.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if not t.gpus:
        assert t.peer == {} and t.links == {}
        assert t.shm is None
        assert topology.communicator_outcome(t, "cpu", 2).startswith("kernels (2 CPU ranks")


def test_tpcomm_check_runs_on_cpu(capsys):
    """``tpcomm check`` exits 0 and prints the topology section, the algorithms and a plan per op."""
    status = cli_main(["check"])
    out = capsys.readouterr().out
    assert status == 0, out
    for word in ("versions", "topology (tpcomm/topology.py)", "Communicator:", "algorithms",
                 "fused_add_rmsnorm 1x4096", "all_reduce 4096x4096"):
        assert word in out, f"{word!r} missing from:\n{out}"


def test_tpcomm_check_plans_at_another_world_size(capsys):
    """``tpcomm check --world 4`` prints the plans of a 4-rank group, at decode and prefill sizes."""
    assert cli_main(["check", "--world", "4"]) == 0
    out = capsys.readouterr().out
    for word in ("fused_add_rmsnorm 16x4096", "fused_add_rmsnorm 256x4096", "(world 4, bf16)"):
        assert word in out, f"{word!r} missing from:\n{out}"
    assert "(world 2, bf16)" not in out


def test_tpcomm_check_reports_an_invalid_setting(capsys, monkeypatch):
    """An invalid setting: INVALID, exit 1, no plans, and no line saying that calls are planned."""
    monkeypatch.setenv("TPCOMM_TIMEOUT_S", "soon")
    assert cli_main(["check"]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and "plans                        none" in out, out
    assert "planned by the dispatch table" not in out and "1x4096" not in out, out


def test_parse_the_captured_h200_matrix():
    """The real output of 2 H200s (tests/tools/data/topo_2xH200.txt: ``nvidia-smi topo -m``, then ``---``
    and the ``--query-gpu`` lines), as captured on 2 H200s."""
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "topo_2xH200.txt")
    matrix, query = open(path).read().split("\n---\n")
    assert topology.parse_topo_matrix(matrix) == {(0, 1): "NV18", (1, 0): "NV18"}
    rows = topology.parse_gpu_query(query)
    assert [r["index"] for r in rows] == [0, 1]
    # CUDA_VISIBLE_DEVICES=1,0 as CUDA reports the GPUs (UUID without GPU-, bus id from the properties)
    visible = [{"uuid": rows[1]["uuid"][4:], "bus_id": None}, {"uuid": None, "bus_id": "0000:00:06"}]
    assert topology.map_visible_to_physical(visible, rows, "1,0") == [1, 0]


def test_check_cites_the_manual_not_run_logs(capsys):
    """Every plan ``tpcomm check`` prints cites a page of the manual for the default thresholds, never a
    run's log file."""
    from tpcomm.cli import check

    check(2)
    out = capsys.readouterr().out
    plans = [ln for ln in out.splitlines() if "x4096 " in ln]
    assert plans, out
    assert "docs/data" not in out and "docs/history" not in out, out
    assert any('docs/tuning.md, "Where the defaults came from"' in ln for ln in plans), plans
    assert topology.cite("x (2xH200 tpcomm tune, docs/data/run-1/tune.log)") == \
        f"x (2xH200 tpcomm tune, {topology.DEFAULTS_PAGE})"
