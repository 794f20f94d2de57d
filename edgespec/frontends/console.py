"""What the front ends share for the terminal: a rich console on standard error (progress bars
and notes go there; results go to standard output)."""

from __future__ import annotations

import logging
import sys


def stderr_console():
    from rich.console import Console

    return Console(file=sys.stderr)


class LogBars:
    """The core's measured progress (logging records with `task`, `done` and `total`, in
    seconds: see costmeasure.Meter) as rich progress bars on standard error, one per task, with
    what is being done and the time left; other notes printed above a live bar."""

    def __init__(self):
        self.progress = None
        self.tasks: dict[str, int] = {}

    @staticmethod
    def is_bar(record: logging.LogRecord) -> bool:
        return getattr(record, "total", None) is not None

    def show(self, record: logging.LogRecord) -> None:
        from rich.progress import BarColumn, Progress, TextColumn

        done, total = float(record.done), max(float(record.total), 1e-9)
        if self.progress is None:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[left]}"),
                                     console=stderr_console())
            self.progress.start()
        key = str(getattr(record, "task", ""))
        left = f"about {total - done:.0f} s left" if done < total else ""
        if key not in self.tasks:
            self.tasks[key] = self.progress.add_task(record.getMessage(), total=total, left=left)
        self.progress.update(self.tasks[key], description=record.getMessage(), completed=done, total=total, left=left)
        if done >= total:
            del self.tasks[key]  # its last line stays on the screen
            if not self.tasks:
                self.progress.stop()
                self.progress = None

    def write(self, line: str) -> None:
        if self.progress is not None:
            self.progress.console.print(line, markup=False, highlight=False)
        else:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
