"""How a :class:`~tpcomm.Communicator` comes to be on every rank of its group: its settings read and
checked on each rank, the settings every rank must share compared, rank 0's crossover table broadcast,
and the workspace created where every rank can map it (else every call falls back to
``torch.distributed``, and ``fallback_reason`` says why). Collective.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from . import dispatch
from .env import interpreter_enabled, interpreter_problem, read_env
from .errors import SetupTimeoutError
from .validate import checked_limits
from .workspace import Workspace, slot_bytes_for

#: Default bytes one launch can carry per rank. 32 MiB on CUDA keeps a 4096 x 4096 bf16 call in one
#: launch; 1 MiB under the CPU interpreter, whose calls are small. Larger messages run in chunks.
DEFAULT_MAX_BYTES_CUDA = 32 << 20
DEFAULT_MAX_BYTES_CPU = 1 << 20


class SetUp:
    """The set-up steps of :class:`~tpcomm.Communicator`, its base class: they read ``group``, ``rank``
    and ``world_size`` and write the state the ops share (``env``, ``device``, ``max_bytes``,
    ``timeout_s``, ``algorithm``, ``workspace``)."""

    def _configure(self, max_bytes: int | None, timeout_s: float | None) -> None:
        """Read ``TPCOMM_*``, pick the device and check ``max_bytes`` and ``timeout_s``. Local (no
        collective); raises TypeError or ValueError."""
        self.env = read_env()
        backend = str(dist.get_backend(self.group))
        if "nccl" in backend and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if max_bytes is None:
            max_bytes = DEFAULT_MAX_BYTES_CUDA if self.device.type == "cuda" else DEFAULT_MAX_BYTES_CPU
        self.max_bytes, self.timeout_s = checked_limits("Communicator", max_bytes,
                                                        self.env.timeout_s if timeout_s is None else timeout_s)
        self.max_bytes = slot_bytes_for(self.max_bytes)  # what a launch carries: the plans and peers compare it
        self.algorithm = self.env.algo

    def _arrive(self, why: str | None, timeout_s: float) -> list:
        """Every rank's refusal of its own settings (None where it has none), in rank order, once every
        rank of the group has come to create the communicator: the first exchange, which a rank that
        never creates one would leave waiting. Through the group's store, bounded by ``timeout_s``: rank
        ``r`` sets its key of this generation, waits for every rank's key, then the first rank to finish
        waiting records the outcome (all arrived, or who had not) and opens the next generation; every
        rank takes that outcome, so all raise or none does, and a rank arriving after it raises too. Where
        the group has no store to reach, a ``torch.distributed`` collective (its own timeout applies).

        Raises:
            SetupTimeoutError: a rank had not arrived after ``timeout_s`` (on every rank that got here).
        """
        store = _group_store(self.group)
        if store is None:
            errors: list = [None] * self.world_size
            dist.all_gather_object(errors, why, group=self.group)
            return errors
        try:
            return self._arrive_through(store, why, timeout_s)
        except dist.DistNetworkError as e:  # the rank holding the store ended (after giving up on this one)
            raise SetupTimeoutError(self.rank, [], timeout_s, store_lost=str(e).splitlines()[0]) from None

    def _arrive_through(self, store, why: str | None, timeout_s: float) -> list:
        """:meth:`_arrive` through the group's store ``store``."""
        gen = store.add(f"{_SETUP_KEY}/generation", 0)
        keys = [f"{_SETUP_KEY}/{gen}/rank{r}" for r in range(self.world_size)]
        store.set(keys[self.rank], json.dumps(why))
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
            mine = json.dumps({"by": self.rank, "missing": []})
        except dist.DistStoreError:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            mine = json.dumps({"by": self.rank, "missing": missing, "timeout_s": timeout_s})
        outcome = store.compare_set(f"{_SETUP_KEY}/{gen}/outcome", "", mine).decode()
        if outcome == mine:  # this rank decided: later creations use new keys
            store.add(f"{_SETUP_KEY}/generation", 1)
        decided = json.loads(outcome)
        if decided["missing"]:
            raise SetupTimeoutError(self.rank, decided["missing"], decided["timeout_s"])
        return [json.loads(v) for v in store.multi_get(keys)]

    def _load_table(self) -> dispatch.CrossoverTable:
        """Rank 0's crossover table (``TPCOMM_DISPATCH_TABLE``, else the defaults), on every rank. Collective.

        Raises:
            ValueError: rank 0's file cannot be read or is not a table (raised on every rank).
        """
        text, error = None, None
        if self.rank == 0 and self.env.table:
            try:
                text = dispatch.load_table(self.env.table).to_json()
            except Exception as e:  # any failure must reach every rank (they wait in the broadcast)
                error = f"TPCOMM_DISPATCH_TABLE={self.env.table!r} on rank 0: {e}"
        box = [(text, error)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        text, error = box[0]
        if error:
            raise ValueError(f"Communicator: {error}")
        return dispatch.CrossoverTable.from_json(text) if text else dispatch.DEFAULT_TABLE

    def _agreed_settings(self) -> dict:
        """The settings every rank must share, by name: a peer with another value would run other kernels,
        another workspace layout or another protocol. (Settings that may differ: ``timeout_s`` and
        ``TPCOMM_TIMEOUT_S``, each rank waiting its own; ``TPCOMM_MAX_PROGRAMS``, the smallest is used;
        ``TPCOMM_DISPATCH_TABLE``, rank 0's is used; ``TPCOMM_PDL`` and ``TPCOMM_DIRECT_LAUNCH``, how a
        rank launches on its own stream.)"""
        import triton

        from .version import __version__

        return {"max_bytes": self.max_bytes, "TPCOMM_ALGO": self.algorithm, "tpcomm version": __version__,
                "Triton version": triton.__version__,
                "workspace layout": (f"LAMPORT_MAX_BYTES={dispatch.LAMPORT_MAX_BYTES}, "
                                     f"TWO_SHOT_GRID_FACTOR={dispatch.TWO_SHOT_GRID_FACTOR}, "
                                     f"ALL_REDUCE_ROW={dispatch.ALL_REDUCE_ROW}, MAX_BLOCK_H={dispatch.MAX_BLOCK_H}")}

    def _set_up(self) -> str | None:
        """Check that the ranks agree on :meth:`_agreed_settings`, then create the workspace if every rank
        can; returns why not (None when it exists). Collective.

        Raises:
            ValueError: on every rank, when a setting differs between ranks: its name and each rank's value.
        """
        info = (socket.gethostname(), self._local_programs(), interpreter_enabled(), interpreter_problem(),
                self._agreed_settings())
        infos: list = [None] * self.world_size
        dist.all_gather_object(infos, info, group=self.group)
        hosts, programs, interpreted, problems, settings = zip(*infos)
        differ = [name for name in settings[0] if any(s.get(name) != settings[0][name] for s in settings)]
        if differ:
            raise ValueError("Communicator: the ranks must agree on " + "; ".join(
                f"{name} (" + ", ".join(f"rank {r}: {s.get(name)!r}" for r, s in enumerate(settings)) + ")"
                for name in differ))
        reason = None
        if self.world_size < 2:
            reason = "a group of one rank needs no communication"
        elif len(set(hosts)) > 1:
            reason = "the group spans several hosts"
        elif self.device.type == "cpu" and not all(interpreted):  # every rank decides alike
            without = [r for r, i in enumerate(interpreted) if not i]
            reason = (f"CPU ranks need Triton's interpreter, and group rank(s) {without} run without it: set "
                      "TRITON_INTERPRET=1 before Python starts on every rank (importing tpcomm sets it only on "
                      "a machine without CUDA, and only where it is unset)")
        elif self.device.type == "cpu" and any(p for p in problems):
            at = [r for r, p in enumerate(problems) if p]
            reason = f"on group rank(s) {at}: " + next(p for p in problems if p).replace("this process", "that process")
        if reason is not None:
            return reason
        max_programs = min(programs)
        error = None
        try:
            ws = Workspace(self.group, self.device, self.max_bytes, max_programs, self.timeout_s,
                           lamport_slot_bytes=min(self.max_bytes, dispatch.LAMPORT_MAX_BYTES),
                           pdl=self.env.pdl)  # the workspace keeps it only where pdl_supported
        except Exception as e:  # any rank's failure sends every rank to the fallback
            ws, error = None, f"workspace set-up failed on rank {self.rank}: {e}"
        errors: list = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        failed = [e for e in errors if e]
        if failed:
            if ws is not None:
                ws.close()
            return failed[0]
        self.workspace = ws
        return None

    def _local_programs(self) -> int:
        if self.env.max_programs is not None:
            return self.env.max_programs
        if self.device.type == "cuda":
            # Two programs per SM (docs/design.md, "Two programs per SM").
            return 2 * torch.cuda.get_device_properties(self.device).multi_processor_count
        return 4


#: Prefix of the store keys of :meth:`SetUp._arrive` (in the group's own store, whose keys torch prefixes
#: per group).
_SETUP_KEY = "tpcomm/communicator"


def _group_store(group):
    """The ``torch.distributed`` store of ``group`` (torch's ``_get_process_group_store``), or None where
    this torch has no such function or the group has no store."""
    try:
        from torch.distributed.distributed_c10d import _get_process_group_store

        return _get_process_group_store(group)
    except (ImportError, AttributeError, ValueError, RuntimeError):
        return None
