"""What the GPUs of this machine offer a tensor-parallel group: peer access between every pair, the link
between them, which algorithms can run and why not, and what a :class:`~tpcomm.Communicator` would do.
Used by ``tpcomm check``; reads the machine, launches nothing.

The group is the visible GPUs in CUDA's order (``tpcomm.launch`` puts rank ``r`` on ``cuda:r``).
``CUDA_VISIBLE_DEVICES`` may list GPUs in any order (or by UUID), while ``nvidia-smi`` numbers them by PCI
bus and ignores that variable: each visible GPU is matched to its ``nvidia-smi`` index by UUID (then by
PCI bus id, then by the variable's integers), and the link of a pair is read from ``nvidia-smi topo -m``
at those indices. Without ``nvidia-smi`` the link is ``"unknown"``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

#: ``nvidia-smi topo -m`` legend: what each link code means (NV# is a bonded set of # NVLinks).
LINK_LEGEND = {
    "X": "self",
    "SYS": "PCIe and the SMP interconnect between NUMA nodes (QPI/UPI)",
    "SOC": "PCIe and the SMP interconnect between NUMA nodes (older name of SYS)",
    "NODE": "PCIe and the interconnect between PCIe host bridges of one NUMA node",
    "PHB": "PCIe through a PCIe host bridge (typically the CPU)",
    "PXB": "several PCIe bridges, not through the host bridge",
    "PIX": "at most one PCIe bridge",
    "NV": "NVLink",
}

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DEVICE_LABEL = re.compile(r"^(GPU|NIC)\d+$")


def describe_link(code: str) -> str:
    """A few words for a link code of ``nvidia-smi topo -m`` (``NV18``: "18 bonded NVLinks")."""
    m = re.fullmatch(r"NV(\d+)", code)
    if m:
        return f"{m.group(1)} bonded NVLinks"
    return LINK_LEGEND.get(code, "unknown")


def parse_topo_matrix(text: str) -> dict[tuple[int, int], str]:
    """The GPU-to-GPU links of ``nvidia-smi topo -m`` output: ``{(i, j): code}`` for ``nvidia-smi``
    indices ``i != j`` (codes as printed: ``NV18``, ``PIX``, ``SYS``, ...).

    Columns are whitespace-separated (tabs in practice, with ANSI underline codes in the header); the
    GPU and NIC columns come first, the affinity columns (multi-word headers) after them.

    Raises:
        ValueError: no GPU matrix in ``text``.
    """
    lines = [_ANSI.sub("", ln) for ln in text.splitlines()]
    header = None
    links: dict[tuple[int, int], str] = {}
    for ln in lines:
        tokens = ln.split()
        if not tokens:
            if header is not None and links:
                break  # the blank line before the legend
            continue
        if header is None:
            if tokens[0] == "GPU0":
                cols = []
                for t in tokens:
                    if not _DEVICE_LABEL.match(t):
                        break
                    cols.append(t)
                header = cols
            continue
        label = tokens[0]
        if not label.startswith("GPU") or not _DEVICE_LABEL.match(label):
            continue
        i = int(label[3:])
        for col, value in zip(header, tokens[1:1 + len(header)]):
            if col.startswith("GPU"):
                j = int(col[3:])
                if i != j:
                    links[(i, j)] = value
    if not links and header is None:
        raise ValueError("parse_topo_matrix: no GPU matrix (a header line starting with GPU0) in the text")
    return links


def parse_gpu_query(text: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader``:
    ``[{"index": 0, "uuid": "GPU-...", "bus_id": "00000000:18:00.0"}, ...]``."""
    rows = []
    for ln in text.splitlines():
        parts = [p.strip() for p in ln.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            rows.append({"index": int(parts[0]), "uuid": parts[1], "bus_id": parts[2]})
    return rows


def _norm_uuid(u: str | None) -> str | None:
    if not u:
        return None
    u = str(u).strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def _norm_bus(b: str | None) -> str | None:
    """``"00000000:18:00.0"`` or ``"0000:18:00.0"`` -> ``"0000:18:00"`` (domain:bus:device)."""
    if not b:
        return None
    m = re.fullmatch(r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)(?:\.\d+)?", b.strip())
    if not m:
        return None
    dom = int(m.group(1) or "0", 16)
    return f"{dom:04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}"


def map_visible_to_physical(visible: list[dict], smi_rows: list[dict], cuda_visible_devices: str | None
                            ) -> list[int | None]:
    """The ``nvidia-smi`` index of each visible GPU (in CUDA's order), or None when it cannot be told.

    Args:
        visible: per visible GPU, ``{"uuid": ..., "bus_id": ...}`` as CUDA reports them (either may be
            None).
        smi_rows: :func:`parse_gpu_query` of ``nvidia-smi`` (empty when it is not available).
        cuda_visible_devices: the variable's value (None: unset).
    Matching: by UUID, else by PCI bus id, else (no ``nvidia-smi`` data to match) the variable's
    integer entries in order (``CUDA_VISIBLE_DEVICES=3,1``: ``cuda:0`` is GPU 3), else the identity when
    the variable is unset.
    """
    by_uuid = {_norm_uuid(r["uuid"]): r["index"] for r in smi_rows if r.get("uuid")}
    by_bus = {_norm_bus(r["bus_id"]): r["index"] for r in smi_rows if r.get("bus_id")}
    entries = None
    if cuda_visible_devices is not None:
        raw = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
        entries = []
        for e in raw:
            if e.isdigit():
                entries.append(int(e))
            elif _norm_uuid(e) is not None and smi_rows:  # a UUID (or a unique prefix of one)
                hits = [i for u, i in by_uuid.items() if u and u.startswith(_norm_uuid(e))]
                entries.append(hits[0] if len(hits) == 1 else None)
            else:
                entries.append(None)
    out: list[int | None] = []
    for k, v in enumerate(visible):
        idx = by_uuid.get(_norm_uuid(v.get("uuid")))
        if idx is None:
            idx = by_bus.get(_norm_bus(v.get("bus_id")))
        if idx is None and entries is not None and k < len(entries):
            idx = entries[k]
        if idx is None and cuda_visible_devices is None:
            idx = k
        out.append(idx)
    return out


@dataclass
class Topology:
    """What :func:`probe` found.

    Attributes:
        gpus: per visible GPU (CUDA order): ``{"visible": k, "physical": nvidia-smi index or None,
            "name", "uuid", "bus_id"}``.
        peer: ``{(i, j): bool}``: ``torch.cuda.can_device_access_peer(i, j)`` for visible ``i != j``.
        links: ``{(i, j): code}`` for visible ``i != j`` (``"unknown"`` without ``nvidia-smi``).
        link_source: where the links come from, or why they are unknown.
        cuda_visible_devices: the variable's value (None: unset).
        symm_mem: None when ``torch.distributed._symmetric_memory`` imports, else why not.
        shm: None when the CPU workspace can be made (``memfd_create``, else a writable ``/dev/shm``),
            else why not.
    """

    gpus: list = field(default_factory=list)
    peer: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)
    link_source: str = ""
    cuda_visible_devices: str | None = None
    symm_mem: str | None = None
    shm: str | None = None

    @property
    def missing_peer(self) -> list[tuple[int, int]]:
        """Visible pairs ``(i, j)`` where ``i`` cannot map ``j``'s memory."""
        return sorted(p for p, ok in self.peer.items() if not ok)


def _run(cmd: list[str]) -> str | None:
    """stdout of ``cmd``, or None when it is missing, fails or takes more than 20 s."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def probe() -> Topology:
    """Read the visible GPUs, peer access between every pair, the links (``nvidia-smi``), and whether
    the workspaces can be set up (symmetric memory on CUDA, a memfd or ``/dev/shm`` on the CPU)."""
    import torch

    topo = Topology(cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except Exception as e:  # an old torch, or a build without it
        topo.symm_mem = f"{type(e).__name__}: {e}"
    if not hasattr(os, "memfd_create") and not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        topo.shm = "no memfd_create, and /dev/shm is missing or not writable"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = []
    for k in range(n):
        p = torch.cuda.get_device_properties(k)
        uuid = getattr(p, "uuid", None)
        bus = None
        if getattr(p, "pci_bus_id", None) is not None:
            bus = f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{getattr(p, 'pci_device_id', 0):02x}"
        visible.append({"visible": k, "name": p.name, "uuid": str(uuid) if uuid is not None else None,
                        "bus_id": bus})
    smi = _run(["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"]) if n else None
    physical = map_visible_to_physical(visible, parse_gpu_query(smi or ""), topo.cuda_visible_devices)
    for v, ph in zip(visible, physical):
        topo.gpus.append(dict(v, physical=ph))
    for i in range(n):
        for j in range(n):
            if i != j:
                topo.peer[(i, j)] = bool(torch.cuda.can_device_access_peer(i, j))
    matrix_text = _run(["nvidia-smi", "topo", "-m"]) if n >= 2 else None
    matrix: dict = {}
    if n < 2:
        topo.link_source = "fewer than 2 GPUs"
    elif matrix_text is None:
        topo.link_source = "unknown: nvidia-smi is not available or failed"
    else:
        try:
            matrix = parse_topo_matrix(matrix_text)
            topo.link_source = "nvidia-smi topo -m"
        except ValueError as e:
            topo.link_source = f"unknown: {e}"
    for i in range(n):
        for j in range(n):
            if i != j:
                pi, pj = physical[i], physical[j]
                topo.links[(i, j)] = matrix.get((pi, pj), "unknown") if pi is not None and pj is not None \
                    else "unknown"
    return topo


def algorithm_availability(topo: Topology, device: str, world_size: int) -> list[tuple[str, bool, str]]:
    """``[(algorithm, available, why)]`` for a group of ``world_size`` ranks on ``device`` (``cuda``: the
    first ``world_size`` visible GPUs; ``cpu``: ranks under Triton's interpreter)."""
    from . import dispatch

    if world_size < 2:
        why_not = "a group of one rank needs no communication"
    elif device == "cuda":
        missing = [(i, j) for i, j in topo.missing_peer if i < world_size and j < world_size]
        why_not = ("no peer access for " + ", ".join(f"{i}->{j}" for i, j in missing) if missing else
                   f"torch symmetric memory unavailable ({topo.symm_mem})" if topo.symm_mem else None)
    else:
        why_not = topo.shm
    kernels = []
    for a in dispatch.ALGORITHMS:
        note = {"lamport": "bf16/fp16 only", "one_shot": "every float dtype",
                "two_shot": "every float dtype"}.get(a, "")
        kernels.append((a, why_not is None, note if why_not is None else why_not))
    gather = [("push (all_gather)", why_not is None,
               "any dtype, as bytes; integer sums too (gathered, then added in int64)" if why_not is None
               else why_not)]
    fallback = [("fallback", True, "torch.distributed (" + ("NCCL" if device == "cuda" else "gloo")
                 + "): groups across hosts, and whenever the kernels cannot run")]
    return kernels + gather + fallback


def communicator_outcome(topo: Topology, device: str, world_size: int, settings_valid: bool = True) -> str:
    """What a Communicator over that group would do, in one sentence (``settings_valid`` False: the
    TPCOMM_* settings are invalid, so it would raise instead of planning calls)."""
    avail = algorithm_availability(topo, device, world_size)
    if avail[0][1]:
        where = (f"{world_size} GPUs, symmetric-memory workspace" if device == "cuda"
                 else f"{world_size} CPU ranks, shared-memory workspace (memfd), Triton interpreter")
        then = ("every call planned by the dispatch table below" if settings_valid else
                "but TPCOMM_* settings are INVALID (above), so a Communicator would raise")
        return f"kernels ({where}); {then}"
    return f"fallback to torch.distributed on every rank: {avail[0][2]}"


#: What ``tpcomm check`` cites for the built-in dispatch table's thresholds: the manual's page, where the
#: measurements behind each threshold are given (the table's own sources name the runs).
DEFAULTS_PAGE = 'docs/tuning.md, "Where the defaults came from"'


def cite(reason: str) -> str:
    """``reason`` (a plan's) with a citation of a run's log file replaced by the manual's page."""
    import re

    return re.sub(r"docs/(?:data|history)/[^\s),;]+", DEFAULTS_PAGE, reason)


def report_lines(topo: Topology, device: str, world_size: int, settings_valid: bool = True) -> list[str]:
    """Lines for ``tpcomm check``: the GPUs (visible and nvidia-smi indices), peer access and link of
    every pair, the algorithms available and why not, and what a Communicator would do
    (:func:`communicator_outcome`, ``settings_valid`` as there)."""
    out = []
    n = len(topo.gpus)
    cvd = topo.cuda_visible_devices
    out.append(f"CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else "CUDA_VISIBLE_DEVICES unset")
    for g in topo.gpus:
        ph = "nvidia-smi index unknown" if g["physical"] is None else f"nvidia-smi GPU{g['physical']}"
        out.append(f"cuda:{g['visible']} = {ph}: {g['name']}" + (f", {g['bus_id']}" if g.get("bus_id") else ""))
    if n >= 2:
        out.append(f"pairs (links from {topo.link_source}):")
        for i in range(n):
            for j in range(i + 1, n):
                fwd, back = topo.peer[(i, j)], topo.peer[(j, i)]
                if fwd and back:
                    access = "peer access both ways"
                elif fwd or back:
                    access = f"peer access only {i}->{j}" if fwd else f"peer access only {j}->{i}"
                else:
                    access = "NO peer access"
                link = topo.links[(i, j)]
                out.append(f"  cuda:{i} <-> cuda:{j}: {access}; link {link} ({describe_link(link)})")
    out.append(f"a group of {world_size} {'GPUs' if device == 'cuda' else 'CPU ranks'}:")
    for name, ok, why in algorithm_availability(topo, device, world_size):
        out.append(f"  {name:<18} {'available' if ok else 'NOT available'}" + (f" ({why})" if why else ""))
    out.append("Communicator: " + communicator_outcome(topo, device, world_size, settings_valid))
    return out
