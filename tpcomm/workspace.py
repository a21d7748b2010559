"""Symmetric workspace: one layout, two backends.

Every rank holds one buffer of the same size, mapped by every other rank of the group:

    [ signal pad: int64 flags [2 parities][2 phases][pad_programs][world_size], padded to 256 bytes ]
      (pad_programs: two-shot's grid cap, 2 * max_programs; max_programs in loopback)
    [ receive buffers: [2 parities][world_size slots][slot_bytes] ]
    [ Lamport buffers: [2 parities][world_size slots][lamport_slot_bytes], every 16-bit word 0x8000 ]
    [ Lamport call tags: int64 [2 parities][max_programs][world_size], every 16-bit half 0x8000 ]
    [ abort region: int64 state word, then abort words int64 [pad_programs][world_size], zero but
      the epoch 1, padded to 256 bytes ]

Slot ``q`` of a rank's receive buffer holds what rank ``q`` pushed to it; abort word ``[p][q]`` of a
rank, what program ``p`` of rank ``q`` stored there when it gave up waiting for this rank
(``1 << 32 | epoch``, :func:`tpcomm.kernels.sync.check_abort`). The state word (``state``) holds the
epoch, the start counter and two flags, advanced and set by the kernels (:mod:`tpcomm.kernels.sync`):
it is in the shared buffer because a peer that stores an abort word sets one of its flags. Two int64
tables on the kernel's device give every rank's signal-pad address (``flag_table``), receive-buffer
address (``buf_table``) and Lamport-buffer address (``lamport_table``). Beside the shared buffer each
rank keeps five int32 error words (code, peer, epoch, program, the call's signature), which on CUDA live
in pinned host memory so the host reads them without a device synchronisation.

Backends:
  * CUDA: ``torch.distributed._symmetric_memory`` (``empty`` + ``rendezvous`` over the group).
  * CPU (Triton interpreter): an anonymous shared-memory file (``memfd_create``) per rank, which peers
    open as ``/proc/<pid>/fd/<fd>`` (the paths go round over the (gloo) group): it has no name, so
    nothing is left behind whenever a rank dies. Without memfd, a named file in ``/dev/shm``, unlinked
    as soon as every rank has mapped it.
"""

from __future__ import annotations

import os
import uuid
import weakref

import torch
import torch.distributed as dist

from .dispatch import TWO_SHOT_GRID_FACTOR
from .env import interpreter_enabled
from .kernels.sync import ERR_WORDS

_ALIGN = 256
#: Flag exchanges per launch (kernels/sync.py): two-shot signals after its scatter and its gather.
PHASES = 2


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def slot_bytes_for(max_bytes: int) -> int:
    """The bytes a slot holds for a ``max_bytes`` launch: ``max_bytes`` rounded up to a multiple of 256
    (slots start 256-byte aligned), at least 256. What a communicator's ``max_bytes`` then is."""
    return _round_up(max(max_bytes, _ALIGN), _ALIGN)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch with programmatic dependent launch: a CUDA GPU of compute
    capability 9.0 or more (``griddepcontrol``), kernels compiled (not under the interpreter)."""
    return (device.type == "cuda" and not interpreter_enabled()
            and torch.cuda.get_device_capability(device) >= (9, 0))


class Workspace:
    """The shared buffers and peer tables of one communicator.

    Collective: every rank of ``group`` must construct it with the same arguments.

    Args:
        group: the process group (NCCL for CUDA, gloo for CPU).
        device: ``torch.device`` of the kernels (``cuda:i`` or ``cpu``).
        slot_bytes: bytes of one slot, i.e. the largest message one launch can carry (rounded up to 256).
        lamport_slot_bytes: bytes of one Lamport slot (the largest Lamport launch).
        max_programs: grid cap of every launch except two-shot's on rows of one tile of 4096+
            elements, which run 8-warp programs, up to ``dispatch.TWO_SHOT_GRID_FACTOR`` times as many
            (``dispatch.row_config``); the signal pad has flags for that many (``pad_programs``) per
            peer, phase and parity.
        timeout_s: how long a kernel waits for a peer.
        pdl: launch the kernels with programmatic dependent launch where :func:`pdl_supported` (ignored
            elsewhere): a kernel starts launching while the one before it on the stream finishes.

    Raises:
        RuntimeError: the backend could not allocate or map the buffers (the caller falls back).
    """

    def __init__(self, group, device: torch.device, slot_bytes: int, max_programs: int, timeout_s: float,
                 lamport_slot_bytes: int = 0, pdl: bool = False):
        # ``group`` serves the set-up's collectives only and is not kept (Communicator.group says why)
        self._lay_out(dist.get_rank(group), dist.get_world_size(group), device, slot_bytes, max_programs,
                      timeout_s, lamport_slot_bytes, pdl)
        bases = self._alloc_cuda(group) if device.type == "cuda" else self._alloc_cpu(group)
        self._make_tables(bases)

    def _lay_out(self, rank: int, world_size: int, device: torch.device, slot_bytes: int, max_programs: int,
                 timeout_s: float, lamport_slot_bytes: int, pdl: bool,
                 two_shot_factor: int = TWO_SHOT_GRID_FACTOR) -> None:
        """Sizes of the layout and local settings (no allocation, no collective). ``two_shot_factor``:
        two-shot's grid cap over ``max_programs`` on rows of one tile of 4096+ elements.

        Raises:
            ValueError: a grid cap (``max_programs`` times ``two_shot_factor``) above what the state
                word's start counter counts (``kernels.sync.MAX_PROGRAMS``).
        """
        from .kernels.sync import MAX_PROGRAMS

        if two_shot_factor * max_programs > MAX_PROGRAMS:
            raise ValueError(f"workspace: a grid cap of {two_shot_factor * max_programs} programs "
                             f"(max_programs {max_programs} x {two_shot_factor}); at most {MAX_PROGRAMS}")
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.max_programs = max_programs
        self.pad_programs = two_shot_factor * max_programs
        self.slot_bytes = slot_bytes_for(slot_bytes)
        self.flag_bytes = _round_up(2 * PHASES * self.pad_programs * self.world_size * 8, _ALIGN)
        self.lamport_slot_bytes = _round_up(lamport_slot_bytes, _ALIGN)
        self.data_bytes = 2 * self.world_size * self.slot_bytes
        self.lamport_bytes = 2 * self.world_size * self.lamport_slot_bytes
        self.tag_bytes = _round_up(2 * self.world_size * max_programs * 8, _ALIGN)
        self.abort_bytes = _round_up((1 + self.pad_programs * self.world_size) * 8, _ALIGN)
        self.total_bytes = self.flag_bytes + self.data_bytes + self.lamport_bytes + self.tag_bytes + self.abort_bytes
        self.timeout_s = timeout_s
        # nanoseconds, as the kernels' waits count them; at least 1, since 0 means "an earlier wait failed"
        self.timeout = min(max(1, int(timeout_s * 1e9)), 1 << 62)
        self.pdl = bool(pdl) and pdl_supported(device)
        self._launch_options = {"PDL": self.pdl, "launch_pdl": self.pdl}  # built once: read by every launch
        self._shm_paths: list[str] = []
        self._memfd: int | None = None
        self._handle = None

    def _make_tables(self, bases: list[int]) -> None:
        """The peer tables from every rank's buffer address (rank order), and this rank's state word (in its
        own buffer)."""
        device = self.device
        self.flag_table = torch.tensor(bases, dtype=torch.int64, device=device)
        self.buf_table = torch.tensor([b + self.flag_bytes for b in bases], dtype=torch.int64, device=device)
        self.lamport_table = torch.tensor([b + self.flag_bytes + self.data_bytes for b in bases],
                                          dtype=torch.int64, device=device)
        # this rank's state word, in its own buffer: read by every program at its start, its notified flag
        # set by a peer that stores an abort word after it
        region = self.total_bytes - self.abort_bytes
        self.state = self.buffer[region:region + 8].view(torch.int64)
        self.err = torch.zeros(ERR_WORDS, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._err_words = self.err.numpy()  # the same memory: reading it costs no torch dispatch
        self.closed = False

    @classmethod
    def loopback(cls, world_size: int, device: torch.device, slot_bytes: int, max_programs: int,
                 timeout_s: float, lamport_slot_bytes: int, pdl: bool, two_shot_factor: int = 1) -> list["Workspace"]:
        """Every rank's workspace of a group whose ranks share this process and ``device``
        (:mod:`tpcomm.loopback`): plain device allocations, in rank order. Each keeps every rank's buffer
        alive (``peer_buffers``), so closing one rank never frees memory the others still write.
        ``two_shot_factor``: as :meth:`_lay_out`; 1 by default, so that no launch has more programs than
        ``max_programs`` and every rank's programs fit the GPU together."""
        workspaces = []
        for r in range(world_size):
            ws = cls.__new__(cls)
            ws._lay_out(r, world_size, device, slot_bytes, max_programs, timeout_s, lamport_slot_bytes, pdl,
                        two_shot_factor)
            ws.buffer = torch.empty(ws.total_bytes, dtype=torch.uint8, device=device)
            ws._arm(ws.buffer)
            workspaces.append(ws)
        for ws in workspaces:
            ws.peer_buffers = [w.buffer for w in workspaces]
            ws._make_tables([int(b.data_ptr()) for b in ws.peer_buffers])
        return workspaces

    def launch_options(self) -> dict:
        """Keyword arguments every communication kernel's launch takes: ``PDL`` (the kernels' constexpr,
        :func:`tpcomm.kernels.sync.start_program`) and Triton's ``launch_pdl``, both ``self.pdl``."""
        return self._launch_options

    # -- backends -----------------------------------------------------------------------------------
    def _alloc_cuda(self, group) -> list[int]:
        import torch.distributed._symmetric_memory as symm_mem

        self.buffer = symm_mem.empty(self.total_bytes, dtype=torch.uint8, device=self.device)
        self._arm(self.buffer)
        self._handle = symm_mem.rendezvous(self.buffer, group.group_name)
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)
        return [int(p) for p in self._handle.buffer_ptrs]

    def _alloc_cpu(self, group) -> list[int]:
        fd, path = self._create_shared_file()
        try:
            try:
                os.ftruncate(fd, self.total_bytes)
                self.buffer = torch.from_file(path, shared=True, size=self.total_bytes, dtype=torch.uint8)
            finally:
                if path.startswith("/dev/shm/"):
                    os.close(fd)
            self._arm(self.buffer)
            paths: list = [None] * self.world_size
            dist.all_gather_object(paths, path, group=group)
            self.peer_buffers = [
                self.buffer if q == self.rank
                else torch.from_file(p, shared=True, size=self.total_bytes, dtype=torch.uint8)
                for q, p in enumerate(paths)
            ]
            dist.barrier(group=group)
        except BaseException:
            self._close_memfd()
            raise
        finally:
            self._unlink()
        return [int(b.data_ptr()) for b in self.peer_buffers]

    def _create_shared_file(self) -> tuple[int, str]:
        """An anonymous shared-memory file (``memfd_create``) that peers open as ``/proc/<pid>/fd/<fd>``:
        it has no name to leave behind, whenever a rank dies. Where memfd is missing, a named file in
        ``/dev/shm``, unlinked once every rank has mapped it (:meth:`_unlink`)."""
        try:
            fd = os.memfd_create(f"tpcomm-r{self.rank}")
            self._memfd = fd
            # closed by close(), or when the workspace is collected without it (no descriptor leaks)
            self._memfd_finalizer = weakref.finalize(self, os.close, fd)
            path = f"/proc/{os.getpid()}/fd/{fd}"
            self._shm_paths = [path]
            return fd, path
        except (AttributeError, OSError):
            path = f"/dev/shm/tpcomm-{os.getpid()}-{uuid.uuid4().hex[:12]}-r{self.rank}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            self._shm_paths = [path]
            return fd, path

    def _close_memfd(self) -> None:
        if self._memfd is not None:
            self._memfd_finalizer()  # os.close, once
            self._memfd = None

    def _arm(self, buffer: torch.Tensor) -> None:
        """Zero the signal pad and the abort region, fill the Lamport buffers and tags with the sentinel,
        set the epoch to 1 (before any peer maps it)."""
        buffer[: self.flag_bytes].zero_()
        end = self.total_bytes - self.abort_bytes
        lam = buffer[self.flag_bytes + self.data_bytes:end]
        if lam.numel():
            lam.view(torch.int16).fill_(-32768)
        buffer[end:self.total_bytes].zero_()
        buffer[end:end + 8].view(torch.int64).fill_(1)

    def _unlink(self) -> None:
        for p in self._shm_paths:
            if p.startswith("/dev/shm/"):  # a memfd has no name; its mappings keep it alive
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        self._shm_paths = []

    # -- layout -------------------------------------------------------------------------------------
    @staticmethod
    def row_stride(hidden: int, element_size: int) -> int:
        """Elements between rows in a slot: ``hidden`` rounded up to 16 elements, so every row starts
        16-byte aligned and Triton can prove it (it specialises integers divisible by 16)."""
        return _round_up(hidden, 16)

    def slot_elems(self, element_size: int) -> int:
        """Elements of one slot for this element size."""
        return self.slot_bytes // element_size

    def parity_elems(self, element_size: int) -> int:
        """Elements between the two parities' receive buffers."""
        return self.world_size * self.slot_elems(element_size)

    def rows_per_launch(self, hidden: int, element_size: int) -> int:
        """Rows of ``hidden`` elements one launch can carry (0 if not even one fits)."""
        return self.slot_elems(element_size) // self.row_stride(hidden, element_size)

    def half_slot_elems(self, element_size: int) -> int:
        """Elements of half a slot, a multiple of 16: two-shot receives its share's rows in the first
        half of each slot and gathers the reduced rows of rank ``q``'s share in the second half of slot
        ``q``."""
        return self.slot_elems(element_size) // 2 // 16 * 16

    def share_rows_per_launch(self, hidden: int, element_size: int) -> int:
        """Rows of one rank's share that one two-shot (or reduce-scatter) launch can carry."""
        return self.half_slot_elems(element_size) // self.row_stride(hidden, element_size)

    def abort_offset(self, table: str) -> int:
        """int64 elements from a rank's base in ``table`` (``"flag"``, ``"buf"`` or ``"lamport"``: the
        address its kernel reads from ``flag_table``, ``buf_table`` or ``lamport_table``) to its state
        word, which the abort words follow."""
        start = self.total_bytes - self.abort_bytes
        base = {"flag": 0, "buf": self.flag_bytes, "lamport": self.flag_bytes + self.data_bytes}[table]
        return (start - base) // 8

    def tag_offset(self) -> int:
        """int64 elements from a rank's Lamport base to its call tags (the Lamport kernel's signature
        check: one tag per parity, sending rank and program, holding the call's signature and epoch:
        :func:`tpcomm.kernels.spin.tag_value`)."""
        return self.lamport_bytes // 8

    def lamport_rows_per_launch(self, hidden: int, element_size: int) -> int:
        """Rows of ``hidden`` 16-bit elements one Lamport launch can carry."""
        return (self.lamport_slot_bytes // element_size) // self.row_stride(hidden, element_size)

    # -- errors and life cycle ----------------------------------------------------------------------
    def read_error(self) -> tuple[int, int, int, int, int]:
        """``(code, peer, epoch, program, signature)`` recorded by a kernel; code 0 means none. A mismatch,
        which has a record of its own (``kernels.sync.ERR_WORDS``), wins over a timeout or abort recorded
        by another program. On CUDA the words are in pinned host memory: this reads what has landed so far
        without synchronising."""
        words = self._err_words[5:10] if self._err_words[5] else self._err_words[:5]
        code, peer, epoch, program, signature = (int(v) for v in words)
        return code, peer, epoch & 0xFFFFFFFF, program, signature  # the epoch unsigned, as epoch() gives it

    def error_code(self) -> int:
        """The recorded error's code alone (0: none); what every call checks, twice (a fraction of a µs)."""
        return int(self._err_words[0])

    def epoch(self) -> int:
        """The epoch the next launch will use (synchronises the device on CUDA)."""
        return int(self.state.item()) & 0xFFFFFFFF

    def close(self) -> None:
        """Free the buffers. Idempotent. Not collective, but peers must have finished their calls."""
        if self.closed:
            return
        self.closed = True
        self._unlink()
        self._close_memfd()
        self.peer_buffers = []
        self.buffer = None
        self._handle = None
        # Drop the device tensors too: a closed communicator kept by the caller should hold no memory.
        self.flag_table = self.buf_table = self.lamport_table = self.state = None
