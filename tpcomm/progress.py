"""Progress of long work (the bench and tune sweeps, the demo, the soak), shown by rank 0: a rich progress
bar on a terminal, else (a log file) a line at most every ``every_s`` seconds."""

from __future__ import annotations

import sys
import time

#: Default seconds between progress lines when stdout is not a terminal.
LOG_EVERY_S = 15.0


class Progress:
    """Counts ``total`` steps; shows them only when ``show`` (rank 0), titled ``title``; without a
    terminal, a line at most every ``every_s`` seconds (and at the end)."""

    def __init__(self, show: bool, total: int, title: str = "tpcomm bench", every_s: float = LOG_EVERY_S):
        self.show, self.total, self.done, self.every_s = show, max(1, total), 0, every_s
        self.t0 = self.last = time.monotonic()
        self.bar = self.task = None
        if show and sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress as RichProgress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TimeElapsedColumn(), TimeRemainingColumn(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(title, total=self.total)

    def advance(self, what: str) -> None:
        """One step done; ``what`` names it."""
        self.done += 1
        if not self.show:
            return
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=what[:60])
            return
        now = time.monotonic()
        if now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            el = now - self.t0
            left = el / self.done * (self.total - self.done)
            print(f"  [{self.done}/{self.total}] {100 * self.done / self.total:.0f}%, {el:.0f} s, "
                  f"~{left:.0f} s left: {what}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
